"""Host-API conformance: does a vLLM still offer what the adapter package relies on?

Generic over the adapter package (`atom_plugin.vllm` by default, any package in tests):
every module under it is parsed (never imported, so a broken import cannot hide the
other findings), and for every class with a vLLM class among its ancestors:

- import: every vLLM name any adapter module imports resolves in the host;
- signature: every method the class defines that a vLLM ancestor also defines accepts
  every call the ancestor's signature accepts (`signature.override_problems`), and is
  bound the same way (an instance method cannot replace a static or class method);
- call: it accepts what the host's own calls pass: `self.m(...)` inside the vLLM
  ancestors, and calls through the role's attribute elsewhere in vLLM (`ROLE_RECEIVERS`:
  `layer.impl.do_kv_cache_update(...)`, `current_platform.get_attn_backend_cls(...)`,
  `self.ubatch_runner.prepare(...)`);
- call (undeclared): a method vLLM calls through the role's attribute without declaring
  it on the base (the MHA impl's `do_kv_cache_update` in 0.32) binds to one of the calls;
- super-call: what the adapter passes to `super().m(...)` binds to the host's method;
- abstract: every abstract member of its vLLM ancestors is implemented;
- attribute: every `self.x` its methods read is given by it or a vLLM ancestor (`reads`).

Methods of mixins without vLLM bases (`AtomPlatformMixin`) are checked on each class
that uses them, against that class's vLLM ancestors. Over every module:

- attribute: reads of vLLM config objects (`vllm_config.x`, `vllm_config.y.z`) name what
  the host's config classes have (`reads` says how a config is recognised);
- function: calls of vLLM's module-level functions bind to the host's signature (`calls`).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

from atom_plugin.vllm.compat.calls import function_calls
from atom_plugin.vllm.compat.hosts import (
    ATTRIBUTELESS_BASES,
    ClassRef,
    QualifiedClass,
    is_host_module,
)
from atom_plugin.vllm.compat.reads import ConfigReads, HostClasses, self_reads
from atom_plugin.vllm.compat.runners import release_has_v1_runner
from atom_plugin.vllm.compat.signature import (
    call_problems,
    constructor_contract,
    override_problems,
)
from atom_plugin.vllm.compat.source import (
    CLASS,
    INSTANCE,
    PROPERTY,
    STATIC,
    ModuleInfo,
    SourceTree,
    binding_target,
    code_scopes,
    dotted_name,
)

ADAPTER_PACKAGE = "atom_plugin.vllm"
# A module-level `ONLY_WITH_RUNNER = "v1"`: the module is imported only where vLLM has its
# V1 model runner (0.32, 0.33), so hosts without that runner do not check it.
RUNNER_MARK = "ONLY_WITH_RUNNER"
# Attribute or variable names through which vLLM calls an object of a role, keyed by the
# ending of the vLLM base class's name. Calls through them are checked like call sites.
ROLE_RECEIVERS: dict[str, tuple[str, ...]] = {
    "Impl": ("impl",),
    "Platform": ("current_platform",),
    # Model Runner V2's parts that two-batch overlap replaces (docs/tbo.md)
    "CudaGraphManager": ("cudagraph_manager",),
    "UBatchRunner": ("ubatch_runner",),
}
# Dunder methods vLLM never calls on these classes directly (object's own protocol).
_SKIPPED = {"__repr__", "__str__", "__eq__", "__hash__", "__post_init__", "__init_subclass__"}


@dataclass(frozen=True)
class Problem:
    kind: str  # import, signature, call, super-call, abstract, attribute, function
    where: str  # file:line and the adapter's name for it
    detail: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.detail}"


@dataclass(frozen=True)
class AdapterClass(QualifiedClass):
    """A class of the adapter's."""


class Adapter:
    """The adapter package's sources (default: this installation's `atom_plugin.vllm`)."""

    def __init__(self, root: str | Path | None = None, package: str = ADAPTER_PACKAGE) -> None:
        if root is None:
            import atom_plugin

            root = Path(atom_plugin.__file__).parent.parent
        self.tree = SourceTree(root)
        self.package = package
        self.modules: dict[str, ModuleInfo] = {}
        for name in self.tree.modules_under(package):
            info = self.tree.module(name)
            if info is not None:
                self.modules[name] = info
        if not self.modules:
            raise FileNotFoundError(f"no modules of {package} under {root}")

    def location(self, module: str) -> str:
        return self.tree.location(module)

    @functools.cache  # noqa: B019 - one adapter per check run
    def syntax(self, module: str) -> ast.Module:
        return ast.parse(self.tree.text(module))

    def method_nodes(self, cls: QualifiedClass) -> dict[str, ast.FunctionDef]:
        for node in self.syntax(cls.module).body:
            if isinstance(node, ast.ClassDef) and node.name == cls.name:
                return {
                    item.name: item
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                }
        return {}


@dataclass
class Coverage:
    """What a run compared, so a clean result can be told from an empty one."""

    imports: int = 0
    classes: list[str] = field(default_factory=list)  # adapter classes with vLLM bases
    overrides: list[str] = field(default_factory=list)  # "Class.method"
    call_sites: int = 0
    attribute_reads: int = 0  # config and `self` reads compared with the host's classes
    function_calls: int = 0  # calls of vLLM functions
    skipped: list[str] = field(default_factory=list)  # modules for a runner the host lacks

    def __str__(self) -> str:
        text = (
            f"{self.imports} vLLM imports, {len(self.classes)} classes with vLLM bases, "
            f"{len(self.overrides)} overrides, {self.call_sites} vLLM call sites, "
            f"{self.attribute_reads} attribute reads, {self.function_calls} function calls"
        )
        if self.skipped:
            text += f"; not checked (V1 runner only): {', '.join(self.skipped)}"
        return text


def check(host, adapter: Adapter | None = None, coverage: Coverage | None = None) -> list[Problem]:
    """Every problem found with `adapter` on `host` (an InstalledHost or SourceHost);
    `coverage`, when given, is filled with what was compared."""
    return _Checker(host, adapter or Adapter(), coverage or Coverage()).run()


class _Checker:
    def __init__(self, host, adapter: Adapter, coverage: Coverage) -> None:
        self.host = host
        self.adapter = adapter
        self.coverage = coverage
        self.problems: list[Problem] = []
        self._mro_cache: dict = {}
        self.classes = HostClasses(host)

    def run(self) -> list[Problem]:
        modules = {m: info for m, info in self.adapter.modules.items() if self._loads_here(info)}
        for module, info in modules.items():
            self._check_imports(module, info)
        for module, info in modules.items():
            for name in info.classes:
                self._check_class(AdapterClass(module, name))
        for module, info in modules.items():
            self._check_config_reads(module, info)
            self._check_function_calls(module, info)
        return self.problems

    def _loads_here(self, info: ModuleInfo) -> bool:
        """False for a module marked `ONLY_WITH_RUNNER = "v1"` when the host has no V1
        model runner: the adapter imports it only where vLLM runs that runner."""
        runner = info.strings.get(RUNNER_MARK)
        if runner != "v1" or release_has_v1_runner(self.host.version()):
            return True
        self.coverage.skipped.append(info.name)
        return False

    def _add(self, kind: str, where: str, detail: str) -> None:
        self.problems.append(Problem(kind, where, detail))

    # imports ---------------------------------------------------------------
    def _check_imports(self, module: str, info: ModuleInfo) -> None:
        for imp in info.imports:
            if not is_host_module(imp.module):
                continue
            found = self.host.lookup(imp.module, imp.name)
            self.coverage.imports += found.kind != "unchecked"
            if found.kind == "missing":
                what = imp.module if imp.name is None else f"{imp.name} from {imp.module}"
                where = f"{self.adapter.location(module)}:{imp.line}"
                self._add("import", where, f"imports {what}: {found.detail}")

    # classes ---------------------------------------------------------------
    def _adapter_bases(self, cls: AdapterClass) -> list:
        info = self.adapter.modules[cls.module]
        out = []
        for expr in info.classes[cls.name].bases:
            base = self._resolve_adapter_base(info, expr)
            if base is not None:
                out.append(base)
        return out

    def _resolve_adapter_base(self, info: ModuleInfo, expr):
        dotted = dotted_name(expr)
        target = None if dotted is None else binding_target(info, dotted)
        if target is None:
            return None
        module, name = target
        if module in self.adapter.modules and name in self.adapter.modules[module].classes:
            return AdapterClass(module, name)
        if is_host_module(module):
            found = self.host.lookup(module, name)
            return found.ref if found.kind == "class" else None
        return None

    def _bases(self, node) -> list:
        if isinstance(node, AdapterClass):
            return self._adapter_bases(node)
        return self.host.bases(node)

    def _mro(self, node) -> list:
        """C3 linearization over adapter and host classes (object and non-vLLM bases left out)."""
        if node in self._mro_cache:
            return self._mro_cache[node]
        self._mro_cache[node] = [node]  # a cycle guard while this one is computed
        seqs = [list(self._mro(b)) for b in self._bases(node)] + [list(self._bases(node))]
        result = [node]
        while any(seqs):
            for seq in seqs:
                if not seq:
                    continue
                head = seq[0]
                if not any(head in s[1:] for s in seqs):
                    break
            else:  # inconsistent: fall back to depth-first order
                head = next(s[0] for s in seqs if s)
            result.append(head)
            seqs = [s[1:] if s and s[0] == head else [x for x in s if x != head] for s in seqs]
        self._mro_cache[node] = result
        return result

    def _methods(self, node) -> dict:
        if isinstance(node, AdapterClass):
            return self.adapter.modules[node.module].classes[node.name].methods
        return self.host.methods(node)

    def _check_class(self, cls: AdapterClass) -> None:
        mro = self._mro(cls)
        host_classes = [c for c in mro if isinstance(c, ClassRef)]
        if not host_classes:
            return
        self.coverage.classes.append(str(cls))
        seen: set[str] = set()
        for position, node, label in self._own_parts(cls, mro):
            info = self.adapter.modules[node.module].classes[node.name]
            location = self.adapter.location(node.module)
            for name, method in info.methods.items():
                if name in _SKIPPED or name in seen:
                    continue
                seen.add(name)
                host_def = self._first_host_definition(mro[position + 1 :], name)
                where = f"{location}:{method.line} {label}.{name}"
                if host_def is None:
                    self._check_undeclared_hook(where, method, name, cls.name, host_classes)
                    continue
                owner, base = host_def
                self.coverage.overrides.append(f"{cls.name}.{name}")
                self._check_override(where, method, owner, base)
                self._check_calls(where, method, name, owner, base, host_classes)
            for site in info.super_calls:
                where = f"{location}:{site.line} {label}.{site.caller}"
                self._check_super_call(mro[position + 1 :], site, where)
        info = self.adapter.modules[cls.module].classes[cls.name]
        where = f"{self.adapter.location(cls.module)}:{info.line} {cls.name}"
        self._check_abstract(cls, mro, where)
        self._check_self_reads(cls, mro)

    def _own_parts(self, cls: AdapterClass, mro: list):
        """(position in `mro`, class, label) for `cls` and each mixin of it
        (AtomPlatformMixin), which are checked against cls's vLLM bases; an adapter class
        with vLLM bases of its own is left out (checked as itself)."""
        for position, node in enumerate(mro):
            if not isinstance(node, AdapterClass):
                continue
            if node != cls and any(isinstance(c, ClassRef) for c in self._bases(node)):
                continue
            yield position, node, node.name if node == cls else f"{node.name} (in {cls.name})"

    def _first_host_definition(self, later: list, name: str):
        for node in later:
            if isinstance(node, ClassRef):
                methods = self.host.methods(node)
                if name in methods:
                    return node, methods[name]
        return None

    def _check_override(self, where: str, method, owner: ClassRef, base) -> None:
        if method.kind == PROPERTY or base.kind == PROPERTY:
            return
        if base.kind != INSTANCE and method.kind == INSTANCE:
            self._add(
                "signature",
                where,
                f"is an instance method; {owner}.{method.name} is a {base.kind} "
                "(vLLM calls it on the class)",
            )
            return
        contract = constructor_contract(base.sig) if method.name == "__init__" else base.sig
        for reason in override_problems(method.sig, contract):
            self._add(
                "signature",
                where,
                f"{reason}; host {owner}.{method.name}{base.sig}, adapter {method.sig}",
            )

    def _check_calls(self, where, method, name, owner, base, host_classes) -> None:
        """Calls through a role's attribute count when they bind to the host's own
        signature (others call a different class's method of the same name)."""
        if method.kind == PROPERTY:
            return
        sites = []
        for ref in host_classes:
            for site in self.host.self_calls(ref):
                if site.method == name:
                    sites.append((f"{ref}.{site.caller} (line {site.line})", site.shape))
        for call in self._role_calls(name, host_classes):
            if not call_problems(base.sig, call.shape):
                sites.append((call.where, call.shape))
        self.coverage.call_sites += len(sites)
        for site_where, shape in sites:
            reasons = call_problems(method.sig, shape)
            if reasons:
                self._add(
                    "call",
                    where,
                    f"vLLM calls it at {site_where} with {shape}: {'; '.join(reasons)}; "
                    f"adapter {method.sig}",
                )

    def _role_calls(self, name: str, host_classes: list[ClassRef]):
        for suffix, receivers in ROLE_RECEIVERS.items():
            if any(ref.name.endswith(suffix) for ref in host_classes):
                for receiver in receivers:
                    yield from self.host.calls_through(receiver, name)

    def _check_undeclared_hook(self, where, method, name, class_name, host_classes) -> None:
        """A method vLLM calls by name without declaring it on the base (the MHA impl's
        `do_kv_cache_update` in 0.32): its calls through the role's attribute are made
        on several classes, so at least one must bind to the adapter's signature."""
        if method.kind == PROPERTY or self.host.partial:
            return  # a cut-down tree may lack the one call that binds
        calls = list(self._role_calls(name, host_classes))
        if not calls:
            return
        self.coverage.overrides.append(f"{class_name}.{name}")
        self.coverage.call_sites += len(calls)
        if any(not call_problems(method.sig, call.shape) for call in calls):
            return
        shown = "; ".join(f"{c.where} with {c.shape}" for c in calls[:3])
        self._add(
            "call",
            where,
            f"none of vLLM's {len(calls)} calls of {name} binds to adapter {method.sig} ({shown})",
        )

    def _check_super_call(self, later: list, site, where: str) -> None:
        for node in later:
            methods = self._methods(node)
            if site.method in methods:
                if not isinstance(node, ClassRef):
                    return  # another adapter class: checked as that class's override
                target = methods[site.method]
                for reason in call_problems(target.sig, site.shape):
                    self._add(
                        "super-call",
                        where,
                        f"super().{site.method}({site.shape}) on {node}{target.sig}: {reason}",
                    )
                return

    def _check_abstract(self, cls: AdapterClass, mro: list, where: str) -> None:
        seen: set[str] = set()
        for node in mro:
            for name, method in self._methods(node).items():
                if name in seen:
                    continue
                seen.add(name)
                if isinstance(node, ClassRef) and method.abstract:
                    self._add("abstract", where, f"does not implement {name} (abstract in {node})")

    # attribute reads and function calls ------------------------------------------
    def _known_names(self, mro: list, of_class: bool) -> set[str] | None:
        """Every name the classes of `mro` give an instance (`of_class`: the class object);
        None when one of them is unknown."""
        known: set[str] = set()
        for node in mro:
            if isinstance(node, ClassRef):
                names = self.classes.names(node, of_class)
                if names is None:
                    return None
                known |= names
                continue
            info = self.adapter.modules[node.module]
            for expr in info.classes[node.name].bases:
                resolved = self._resolve_adapter_base(info, expr)
                if resolved is None and dotted_name(expr) not in ATTRIBUTELESS_BASES:
                    return None  # a base outside vLLM and the adapter
            cls_info = info.classes[node.name]
            if "__getattr__" in cls_info.methods and not of_class:
                return None  # any name may resolve on an instance
            known |= cls_info.class_defines if of_class else cls_info.defines
        return known

    def _check_self_reads(self, cls: AdapterClass, mro: list) -> None:
        known = {False: self._known_names(mro, False), True: self._known_names(mro, True)}
        host_base = next(c for c in mro if isinstance(c, ClassRef))
        for _, node, label in self._own_parts(cls, mro):
            methods = self.adapter.modules[node.module].classes[node.name].methods
            location = self.adapter.location(node.module)
            for name, method in self.adapter.method_nodes(node).items():
                names = None if methods[name].kind == STATIC else known[methods[name].kind == CLASS]
                if names is None:
                    continue
                for line, attr in self_reads(method):
                    self.coverage.attribute_reads += 1
                    if attr not in names:
                        me = "cls" if methods[name].kind == CLASS else "self"
                        self._add(
                            "attribute",
                            f"{location}:{line} {label}.{name}",
                            f"reads {me}.{attr}, which neither {cls.name} nor its vLLM bases "
                            f"({host_base} and its ancestors) define",
                        )

    def _check_config_reads(self, module: str, info: ModuleInfo) -> None:
        if self.classes.vllm_config is None:
            return  # a tree without vLLM's configs (a cut that leaves them out)
        location = self.adapter.location(module)
        for label, scope in code_scopes(self.adapter.syntax(module)):
            reads = ConfigReads(scope, info, self.classes)
            self.coverage.attribute_reads += reads.checked
            for read in reads.missing:
                self._add(
                    "attribute",
                    f"{location}:{read.line} {label}".rstrip(),
                    f"reads {read.text}: {read.owner} has no attribute {read.attr!r}",
                )

    def _check_function_calls(self, module: str, info: ModuleInfo) -> None:
        location = self.adapter.location(module)
        is_package = self.adapter.tree.is_package(module)
        for call in function_calls(self.host, self.adapter.syntax(module), info, is_package):
            self.coverage.function_calls += 1
            problems = call.problems
            if problems:
                self._add(
                    "function",
                    f"{location}:{call.line} {call.scope}".rstrip(),
                    f"calls {call.written}({call.shape}); host {call.target}"
                    f"{call.sigs[0]}: {'; '.join(problems)}",
                )
