"""Attribute reads on vLLM objects the adapter touches: does the host still have them?

Two kinds of receiver are checked (the `attribute` findings of `compat.check`):

- vLLM's configs: `VllmConfig` and the config classes of `vllm.config` its fields hold.
  What they have is read from the host's class definitions: dataclass fields and other
  class-level names (annotated or assigned), properties, methods, and the attributes any
  method assigns to `self`, with those of their vLLM bases. An expression is taken for a
  config when
  - its last name is `vllm_config` (a parameter or variable, `self.vllm_config`,
    `runner.vllm_config`; leading underscores are ignored: `self._vllm_config`):
    VllmConfig;
  - its last name is that of a VllmConfig field holding a `vllm.config` class
    (`model_config`, `self.parallel_config`): that field's class;
  - it is a parameter or variable annotated with a `vllm.config` class, or a local variable
    assigned only from recognised configs (`model = vllm_config.model_config`, tuples too);
  and an attribute of a config whose field holds a `vllm.config` class is itself one
  (`vllm_config.parallel_config.worker_cls`). Writes count as reads: a field the host lost
  would take the value silently.
- `self.x` in the methods of an adapter class with vLLM bases and of its mixins
  (`self_reads`): x must be given by an adapter class of its MRO or by a vLLM ancestor (a
  method, property, class attribute, or `self.x = ...` in any method); `cls.x` in a
  classmethod, by a method or class attribute of one of them. A class with an ancestor
  whose attributes are unknown (a base outside vLLM other than object/ABC/Generic, a class
  the tree or its stub lacks; for `self`, a `__getattr__`) is not checked.

Deliberate release probes are not reported: `obj.x` in a function that also calls
`getattr(obj, "x", default)` or `hasattr(obj, "x")` on the same `obj`, and reads inside a
`try` whose handler catches AttributeError. `getattr(obj, "x")` without a default is a read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from atom_plugin.vllm.compat.hosts import ClassRef, annotation_names, is_host_module
from atom_plugin.vllm.compat.source import ModuleInfo, binding_target, first_parameter

CONFIG_PACKAGE = "vllm.config"
VLLM_CONFIG_NAME = "vllm_config"
# Where VllmConfig is defined, then where it is re-exported.
VLLM_CONFIG_HOMES = ("vllm.config.vllm", "vllm.config")


def is_config_class(ref: ClassRef | None) -> bool:
    return ref is not None and (
        ref.module == CONFIG_PACKAGE or ref.module.startswith(CONFIG_PACKAGE + ".")
    )


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class HostClasses:
    """What instances of the host's classes have, their vLLM bases' included."""

    def __init__(self, host) -> None:
        self.host = host
        self._names: dict[tuple[ClassRef, bool], frozenset[str] | None] = {}
        self.vllm_config = self._find_vllm_config()
        self._by_name: dict[str, ClassRef] = {}
        if self.vllm_config is not None:
            self._by_name[VLLM_CONFIG_NAME] = self.vllm_config
            attrs = host.attributes(self.vllm_config)
            for name in attrs.fields if attrs is not None else ():
                sub = self.field_type(self.vllm_config, name)
                if sub is not None and name.endswith("_config"):
                    self._by_name[name] = sub

    def _find_vllm_config(self) -> ClassRef | None:
        for module in VLLM_CONFIG_HOMES:
            found = self.host.lookup(module, "VllmConfig")
            if found.kind == "class":
                return found.ref
        return None

    def by_name(self, name: str) -> ClassRef | None:
        """The config class an expression named `name` is taken for, or None."""
        return self._by_name.get(name.lstrip("_"))

    def names(self, ref: ClassRef, of_class: bool = False) -> frozenset[str] | None:
        """Every attribute name of `ref`'s instances (`of_class`: of the class itself,
        as a classmethod's `cls` sees it); None when they cannot be known."""
        key = (ref, of_class)
        if key in self._names:
            return self._names[key]
        self._names[key] = None  # a cycle guard while this one is computed
        attrs = self.host.attributes(ref)
        if attrs is None or attrs.open_bases or (attrs.dynamic and not of_class):
            return None
        out = set(attrs.class_names if of_class else attrs.names)
        for base in self.host.bases(ref):
            inherited = self.names(base, of_class)
            if inherited is None:
                return None
            out |= inherited
        self._names[key] = frozenset(out)
        return self._names[key]

    def field_type(self, ref: ClassRef, name: str, _depth: int = 0) -> ClassRef | None:
        """The `vllm.config` class field `name` of `ref` holds (first along its bases)."""
        attrs = self.host.attributes(ref)
        if attrs is not None and name in attrs.fields:
            found = self.host.annotation_class(ref, attrs.fields[name])
            return found if is_config_class(found) else None
        if _depth > 20:
            return None
        for base in self.host.bases(ref):
            found = self.field_type(base, name, _depth + 1)
            if found is not None:
                return found
        return None


@dataclass(frozen=True)
class Read:
    line: int
    text: str  # the expression as written: `vllm_config.use_v2_model_runner`
    owner: ClassRef | None  # the config class (None for a `self` read)
    attr: str


def probes(node: ast.AST) -> tuple[set[tuple[str, str]], set[int]]:
    """({(receiver text, name)} probed by getattr-with-default or hasattr in `node`,
    {id of every node inside a try whose handler catches AttributeError})."""
    probed, shielded = set(), set()
    for sub in ast.walk(node):
        named = _named_getattr(sub)
        if named is not None:
            func, receiver, name, nargs = named
            if func == "hasattr" or nargs >= 3:
                probed.add((ast.unparse(receiver), name))
        if isinstance(sub, ast.Try) and any(_catches_attribute_error(h) for h in sub.handlers):
            for stmt in sub.body:
                shielded.update(id(inner) for inner in ast.walk(stmt))
    return probed, shielded


def _named_getattr(node: ast.AST):
    """(func, receiver, name, number of arguments) of `getattr(r, "name", ...)` or
    `hasattr(r, "name")`, else None."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return None
    return node.func.id, node.args[0], node.args[1].value, len(node.args)


def _catches_attribute_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(n, ast.Name) and n.id == "AttributeError" for n in names)


def _reads(node: ast.AST, walk=ast.walk):
    """(the node, receiver, name) for each attribute read in `node`: `r.name` (written or
    deleted too) and `getattr(r, "name")` without a default."""
    for sub in walk(node):
        if isinstance(sub, ast.Attribute):
            yield sub, sub.value, sub.attr
        else:
            named = _named_getattr(sub)
            if named is not None and named[0] == "getattr" and named[3] == 2:
                yield sub, named[1], named[2]


class ConfigReads:
    """The config reads of one scope of an adapter module (`code_scopes`)."""

    def __init__(self, scope: ast.AST, info: ModuleInfo, classes: HostClasses) -> None:
        self.info = info
        self.classes = classes
        self.types: dict[str, ClassRef | None] = {}
        self._type_parameters(scope)
        for _ in range(2):  # a variable assigned from another assigned one
            self._type_variables(scope)
        self.checked = 0
        self.missing: list[Read] = []
        probed, shielded = probes(scope)
        for node, receiver, attr in _reads(scope):
            owner = self.type_of(receiver)
            names = None if owner is None else classes.names(owner)
            if names is None:
                continue
            self.checked += 1
            if attr in names or _dunder(attr):
                continue
            if (ast.unparse(receiver), attr) in probed or id(node) in shielded:
                continue
            self.missing.append(Read(node.lineno, ast.unparse(node), owner, attr))

    def _annotated(self, annotation) -> ClassRef | None:
        found = set()
        for dotted in annotation_names(annotation):
            target = binding_target(self.info, dotted)
            if target is None or not is_host_module(target[0]):
                return None
            lookup = self.classes.host.lookup(*target)
            found.add(lookup.ref if lookup.kind == "class" else None)
        ref = found.pop() if len(found) == 1 else None
        return ref if is_config_class(ref) else None

    def _type_parameters(self, scope: ast.AST) -> None:
        for node in ast.walk(scope):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                ref = self._annotated(arg.annotation)
                if ref is not None:
                    self.types[arg.arg] = ref

    def _type_variables(self, scope: ast.AST) -> None:
        assigned: dict[str, set] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                ref = self._annotated(node.annotation)
                if ref is None and node.value is not None:
                    ref = self.type_of(node.value)
                assigned.setdefault(node.target.id, set()).add(ref)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name, value in _pairs(target, node.value):
                        if not (isinstance(value, ast.Constant) and value.value is None):
                            ref = None if value is None else self.type_of(value)
                            assigned.setdefault(name, set()).add(ref)
        for name, refs in assigned.items():
            self.types[name] = refs.pop() if len(refs) == 1 else None

    def type_of(self, expr: ast.expr) -> ClassRef | None:
        if isinstance(expr, ast.Name):
            if expr.id in self.types:
                return self.types[expr.id]
            return self.classes.by_name(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.type_of(expr.value)
            if owner is not None:
                return self.classes.field_type(owner, expr.attr)
            return self.classes.by_name(expr.attr)
        return None


def _pairs(target: ast.expr, value: ast.expr | None):
    """(name, value or None) bound by `target = value`, tuples unpacked pairwise."""
    if isinstance(target, ast.Name):
        yield target.id, value
    elif isinstance(target, ast.Tuple | ast.List):
        values = value.elts if isinstance(value, ast.Tuple | ast.List) else None
        if values is not None and len(values) != len(target.elts):
            values = None
        for i, element in enumerate(target.elts):
            yield from _pairs(element, None if values is None else values[i])


def _walk_outside_classes(node: ast.AST):
    """ast.walk, leaving out the bodies of classes defined inside (their own `self`)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, ast.ClassDef):
                todo.append(child)


def self_reads(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[int, str]]:
    """(line, name) of each `self.name` (or `cls.name`) the method reads, probes left out."""
    me = first_parameter(method)
    if me is None:
        return []
    probed, shielded = probes(method)
    out = []
    for node, receiver, attr in _reads(method, _walk_outside_classes):
        if not (isinstance(receiver, ast.Name) and receiver.id == me):
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            continue  # a write defines it
        if _dunder(attr) or (me, attr) in probed or id(node) in shielded:
            continue
        out.append((node.lineno, attr))
    return out
