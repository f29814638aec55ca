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
  `layer.impl.do_kv_cache_update(...)`, `current_platform.get_attn_backend_cls(...)`);
- super-call: what the adapter passes to `super().m(...)` binds to the host's method;
- abstract: every abstract member of its vLLM ancestors is implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from atom_plugin.vllm.compat.hosts import ClassRef, _is_host
from atom_plugin.vllm.compat.signature import (
    call_problems,
    constructor_contract,
    override_problems,
)
from atom_plugin.vllm.compat.source import INSTANCE, PROPERTY, ModuleInfo, SourceTree

ADAPTER_PACKAGE = "atom_plugin.vllm"
# Attribute or variable names through which vLLM calls an object of a role, keyed by the
# ending of the vLLM base class's name. Calls through them are checked like call sites.
ROLE_RECEIVERS: dict[str, tuple[str, ...]] = {
    "Impl": ("impl",),
    "Platform": ("current_platform",),
}
# Dunder methods vLLM never calls on these classes directly (object's own protocol).
_SKIPPED = {"__repr__", "__str__", "__eq__", "__hash__", "__post_init__", "__init_subclass__"}


@dataclass(frozen=True)
class Problem:
    kind: str  # import, signature, call, super-call, abstract
    where: str  # file:line and the adapter's name for it
    detail: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.detail}"


@dataclass(frozen=True)
class AdapterClass:
    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


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


def check(host, adapter: Adapter | None = None) -> list[Problem]:
    """Every problem found with `adapter` on `host` (an InstalledHost or SourceHost)."""
    return _Checker(host, adapter or Adapter()).run()


class _Checker:
    def __init__(self, host, adapter: Adapter) -> None:
        self.host = host
        self.adapter = adapter
        self.problems: list[Problem] = []
        self._mro_cache: dict = {}

    def run(self) -> list[Problem]:
        for module, info in self.adapter.modules.items():
            self._check_imports(module, info)
        for module, info in self.adapter.modules.items():
            for name in info.classes:
                self._check_class(AdapterClass(module, name))
        return self.problems

    def _add(self, kind: str, where: str, detail: str) -> None:
        self.problems.append(Problem(kind, where, detail))

    # imports ---------------------------------------------------------------
    def _check_imports(self, module: str, info: ModuleInfo) -> None:
        for imp in info.imports:
            if not _is_host(imp.module):
                continue
            found = self.host.lookup(imp.module, imp.name)
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
        from atom_plugin.vllm.compat.source import dotted_name

        dotted = dotted_name(expr)
        if dotted is None:
            return None
        head, *rest = dotted.split(".")
        if not rest and head in info.classes:
            return AdapterClass(info.name, head)
        if head not in info.bindings:
            return None
        module, name = info.bindings[head]
        if name is None:
            if not rest:
                return None
            module, name = ".".join([module, *rest[:-1]]), rest[-1]
        elif rest:
            module, name = ".".join([module, name, *rest[:-1]]), rest[-1]
        if module in self.adapter.modules and name in self.adapter.modules[module].classes:
            return AdapterClass(module, name)
        if _is_host(module):
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
        info = self.adapter.modules[cls.module].classes[cls.name]
        where_base = self.adapter.location(cls.module)
        for name, method in info.methods.items():
            if name in _SKIPPED:
                continue
            host_def = self._first_host_definition(mro, name)
            if host_def is None:
                continue
            owner, base = host_def
            where = f"{where_base}:{method.line} {cls.name}.{name}"
            self._check_override(where, method, owner, base)
            self._check_calls(where, method, name, owner, base, host_classes)
        for site in info.super_calls:
            self._check_super_call(cls, mro, site, where_base)
        self._check_abstract(cls, mro, f"{where_base}:{info.line} {cls.name}")

    def _first_host_definition(self, mro: list, name: str):
        for node in mro[1:]:
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
        for suffix, receivers in ROLE_RECEIVERS.items():
            if any(ref.name.endswith(suffix) for ref in host_classes):
                for receiver in receivers:
                    for call in self.host.calls_through(receiver, name):
                        if not call_problems(base.sig, call.shape):
                            sites.append((call.where, call.shape))
        for site_where, shape in sites:
            for reason in call_problems(method.sig, shape):
                self._add(
                    "call",
                    where,
                    f"vLLM calls it at {site_where} with {shape}: {reason}; adapter {method.sig}",
                )

    def _check_super_call(self, cls: AdapterClass, mro: list, site, where_base: str) -> None:
        index = next(i for i, node in enumerate(mro) if node == cls)
        for node in mro[index + 1 :]:
            methods = self._methods(node)
            if site.method in methods:
                if not isinstance(node, ClassRef):
                    return  # another adapter class: checked as that class's override
                target = methods[site.method]
                for reason in call_problems(target.sig, site.shape):
                    self._add(
                        "super-call",
                        f"{where_base}:{site.line} {cls.name}.{site.caller}",
                        f"super().{site.method}({site.shape}) on {node}{target.sig}: {reason}",
                    )
                return

    def _check_abstract(self, cls: AdapterClass, mro: list, where: str) -> None:
        seen: set[str] = set()
        missing = []
        for node in mro:
            for name, method in self._methods(node).items():
                if name in seen:
                    continue
                seen.add(name)
                if isinstance(node, ClassRef) and method.abstract:
                    missing.append(f"{name} (abstract in {node})")
        for item in missing:
            self._add("abstract", where, f"does not implement {item}")
