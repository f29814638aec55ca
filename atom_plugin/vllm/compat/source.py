"""Python sources read without importing them: a directory tree or a wheel, parsed with `ast`.

`SourceTree` finds a module's text; `ModuleInfo` is what the checks need from one
module (its imports, classes, methods and the calls inside them).
"""

from __future__ import annotations

import ast
import functools
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from atom_plugin.vllm.compat.signature import CallShape, Sig, sig_from_ast

INSTANCE, CLASS, STATIC, PROPERTY = "instance", "classmethod", "staticmethod", "property"


class SourceTree:
    """The `.py` files under a directory (a checkout or site-packages) or inside a wheel."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no such source tree or wheel: {self.path}")
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
        if self._zip is not None:
            self._files = {n for n in self._zip.namelist() if n.endswith(".py")}
        else:
            self._files = None

    def __repr__(self) -> str:
        return f"SourceTree({str(self.path)!r})"

    def _file_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if self._files is not None:
                if candidate in self._files:
                    return candidate
            elif (self.path / candidate).is_file():
                return candidate
        return None

    def has_module(self, module: str) -> bool:
        return self._file_of(module) is not None

    def is_package(self, module: str) -> bool:
        found = self._file_of(module)
        return found is not None and found.endswith("__init__.py")

    def location(self, module: str) -> str:
        return self._file_of(module) or module.replace(".", "/") + ".py"

    @functools.cache  # noqa: B019 - one tree per check run; the cache dies with it
    def text(self, module: str) -> str | None:
        found = self._file_of(module)
        if found is None:
            return None
        if self._zip is not None:
            return self._zip.read(found).decode("utf-8")
        return (self.path / found).read_text(encoding="utf-8")

    @functools.cache  # noqa: B019
    def module(self, module: str) -> ModuleInfo | None:
        text = self.text(module)
        if text is None:
            return None
        return ModuleInfo.parse(module, text, self.is_package(module))

    @functools.cache  # noqa: B019
    def modules_under(self, package: str) -> list[str]:
        """Every module of `package` (the package itself included), sorted."""
        prefix = package.replace(".", "/")
        if self._files is not None:
            names = [n for n in self._files if n == f"{prefix}.py" or n.startswith(prefix + "/")]
        else:
            root = self.path / prefix
            names = [str(p.relative_to(self.path)) for p in root.rglob("*.py")]
            if (self.path / f"{prefix}.py").is_file():
                names.append(f"{prefix}.py")
        modules = []
        for name in names:
            mod = name[: -len(".py")].replace("/", ".")
            modules.append(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
        return sorted(modules)

    @functools.cache  # noqa: B019
    def attribute_calls(self, receiver: str, package: str) -> dict[str, tuple[str, ...]]:
        """{method: modules of `package` whose text has `receiver.method(`}, one pass."""
        pattern = re.compile(rf"\b{re.escape(receiver)}\s*\.\s*(\w+)\s*\(")
        found: dict[str, list[str]] = {}
        for module in self.modules_under(package):
            for method in set(pattern.findall(self.text(module) or "")):
                found.setdefault(method, []).append(module)
        return {method: tuple(modules) for method, modules in found.items()}


@dataclass(frozen=True)
class ImportedName:
    module: str  # absolute
    name: str | None  # None: `import module`
    line: int


@dataclass
class MethodInfo:
    name: str
    kind: str  # INSTANCE, CLASS, STATIC or PROPERTY
    abstract: bool
    line: int
    args: ast.arguments

    @property
    def sig(self) -> Sig:
        return sig_from_ast(self.args, bound=self.kind != STATIC)


@dataclass(frozen=True)
class CallSite:
    method: str  # the method called
    shape: CallShape
    line: int
    caller: str  # the method the call is in


@dataclass
class ClassInfo:
    name: str
    line: int
    bases: list[ast.expr]
    methods: dict[str, MethodInfo]
    self_calls: list[CallSite]  # self.m(...) / cls.m(...) inside its methods
    super_calls: list[CallSite]  # super().m(...) inside its methods
    # names its body binds (fields, class attributes, nested classes) -> annotation or None
    fields: dict[str, ast.expr | None] = field(default_factory=dict)
    assigned: set[str] = field(default_factory=set)  # `self.x = ...` in any method

    @property
    def defines(self) -> set[str]:
        """Every attribute name the class itself gives its instances."""
        return set(self.methods) | set(self.fields) | self.assigned

    @property
    def class_defines(self) -> set[str]:
        """The names the class object itself has (a classmethod's `cls.x`)."""
        return set(self.methods) | set(self.fields)


def decorator_target(dec: ast.expr) -> ast.expr:
    """The decorator itself (`@cached(...)` -> `cached`)."""
    return dec.func if isinstance(dec, ast.Call) else dec


def decorator_name(dec: ast.expr) -> str:
    """A decorator's last name (`@functools.cache` -> 'cache'); '' for other forms."""
    target = decorator_target(dec)
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {name for dec in node.decorator_list if (name := decorator_name(dec))}


# The decorators that change how a method binds or make it abstract: all the reader
# looks at (and all `scripts/vllm_api_stubs.py` keeps).
BINDING_DECORATORS = {"staticmethod": STATIC, "classmethod": CLASS, "property": PROPERTY}
PROPERTY_DECORATORS = {"setter", "getter", "deleter", "cached_property"}
ABSTRACT_DECORATORS = {"abstractmethod", "abstractproperty"}
MEANINGFUL_DECORATORS = set(BINDING_DECORATORS) | PROPERTY_DECORATORS | ABSTRACT_DECORATORS


def _method(node: ast.FunctionDef | ast.AsyncFunctionDef) -> MethodInfo:
    decorators = decorator_names(node)
    kind = INSTANCE
    for dec, k in BINDING_DECORATORS.items():
        if dec in decorators:
            kind = k
    if decorators & PROPERTY_DECORATORS:
        kind = PROPERTY
    abstract = bool(decorators & ABSTRACT_DECORATORS)
    return MethodInfo(node.name, kind, abstract, node.lineno, node.args)


def first_parameter(method: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The name a method's first parameter gives its receiver (`self`, `cls`), or None."""
    params = [*method.args.posonlyargs, *method.args.args]
    return params[0].arg if params else None


def self_assignments(method: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Attribute names `method` sets on its first parameter: `self.x = ...`, `self.x: T =
    ...`, `self.a, self.b = ...`, `for self.x in ...`, `setattr(self, "x", ...)` and
    `object.__setattr__(self, "x", ...)`."""
    me = first_parameter(method)
    if me is None:
        return set()
    names = set()
    for sub in ast.walk(method):
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.ctx, ast.Store)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == me
        ):
            names.add(sub.attr)
        elif (
            isinstance(sub, ast.Call)
            and dotted_name(sub.func) in ("setattr", "object.__setattr__")
            and len(sub.args) >= 2
        ):
            target, name = sub.args[0], sub.args[1]
            if (
                isinstance(target, ast.Name)
                and target.id == me
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
            ):
                names.add(name.value)
    return names


def class_bindings(body: list[ast.stmt]) -> Iterator[tuple[str, ast.stmt]]:
    """(name, statement) for each name a class body binds: fields and class attributes
    (annotated or assigned) and nested classes, inside `if` and `try` blocks too."""
    for item in body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            yield item.target.id, item
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        yield sub.id, item
        elif isinstance(item, ast.ClassDef):
            yield item.name, item
        elif isinstance(item, ast.If | ast.Try):  # `if TYPE_CHECKING:` and the like
            for branch in (
                item.body,
                item.orelse,
                *(h.body for h in getattr(item, "handlers", [])),
            ):
                yield from class_bindings(branch)


def _class_fields(body: list[ast.stmt]) -> dict[str, ast.expr | None]:
    """name -> annotation (the last one written) or None, for each name `body` binds."""
    fields: dict[str, ast.expr | None] = {}
    for name, statement in class_bindings(body):
        if isinstance(statement, ast.AnnAssign):
            fields[name] = statement.annotation
        else:
            fields.setdefault(name, None)
    return fields


def class_info(node: ast.ClassDef) -> ClassInfo:
    methods: dict[str, MethodInfo] = {}
    self_calls: list[CallSite] = []
    super_calls: list[CallSite] = []
    assigned: set[str] = set()
    for item in node.body:
        if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        methods[item.name] = _method(item)
        if methods[item.name].kind != STATIC:
            assigned |= self_assignments(item)
        for sub in ast.walk(item):
            if not (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)):
                continue
            receiver = sub.func.value
            site = CallSite(sub.func.attr, CallShape.of(sub), sub.lineno, item.name)
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                self_calls.append(site)
            elif (
                isinstance(receiver, ast.Call)
                and isinstance(receiver.func, ast.Name)
                and receiver.func.id == "super"
            ):
                super_calls.append(site)
    return ClassInfo(
        node.name,
        node.lineno,
        list(node.bases),
        methods,
        self_calls,
        super_calls,
        _class_fields(node.body),
        assigned,
    )


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    keep = len(parts) - level + (1 if is_package else 0)
    base = parts[:keep]
    return ".".join([*base, target] if target else base)


@dataclass
class ModuleInfo:
    name: str
    imports: list[ImportedName] = field(default_factory=list)
    # local name -> (absolute module, name or None for a module)
    bindings: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    star_imports: list[str] = field(default_factory=list)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    defined: set[str] = field(default_factory=set)  # functions, assignments, classes
    # top-level functions -> the parameter lists of their definitions (one per branch)
    functions: dict[str, list[ast.arguments]] = field(default_factory=dict)
    # `X = A`, `X = A if cond else B`: the names X may stand for (a class chosen at import)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    lazy_names: set[str] = field(default_factory=set)  # strings, when `__getattr__` exists
    # top-level `NAME = "text"` assignments (the adapter's ONLY_WITH_RUNNER marks)
    strings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, name: str, text: str, is_package: bool) -> ModuleInfo:
        tree = ast.parse(text)
        info = cls(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(name, is_package, node.level, node.module)
                for alias in node.names:
                    if alias.name == "*":
                        info.star_imports.append(module)
                        continue
                    info.imports.append(ImportedName(module, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    info.imports.append(ImportedName(alias.name, None, node.lineno))
        info._top_level(tree.body, is_package)
        if "__getattr__" in info.defined:
            info.lazy_names = {
                n.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
        return info

    def _top_level(self, body: list[ast.stmt], is_package: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = class_info(node)
                self.defined.add(node.name)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.defined.add(node.name)
                if "overload" not in decorator_names(node):  # typing stubs, not the function
                    self.functions.setdefault(node.name, []).append(node.args)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                choices = _alias_choices(node.value) if node.value is not None else []
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            self.defined.add(sub.id)
                    if isinstance(target, ast.Name) and choices:
                        self.aliases[target.id] = choices
                    value = node.value
                    if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                        if isinstance(value.value, str):
                            self.strings[target.id] = value.value
            elif isinstance(node, ast.Import | ast.ImportFrom):
                self.bindings.update(import_bindings(node, self.name, is_package))
            elif isinstance(node, ast.If | ast.Try | ast.With):
                # try/except ImportError, version switches, TYPE_CHECKING: every branch binds
                for branch in ("body", "orelse", "finalbody"):
                    self._top_level(getattr(node, branch, []), is_package)
                for handler in getattr(node, "handlers", []):
                    self._top_level(handler.body, is_package)


def import_bindings(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> dict:
    """local name -> (absolute module, name or None for a module) for one import."""
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            local = alias.asname or alias.name.split(".")[0]
            out[local] = (alias.name if alias.asname else local, None)
        return out
    source = _absolute(module, is_package, node.level, node.module)
    for alias in node.names:
        if alias.name != "*":
            out[alias.asname or alias.name] = (source, alias.name)
    return out


def code_scopes(tree: ast.Module):
    """(label, node) for each top-level function and each method ('Class.method'), and
    ('', statement) for the module's other statements; a nested function or lambda is
    part of the scope around it."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item
                else:
                    yield node.name, item
        else:
            yield "", node


def binding_target(info: ModuleInfo, dotted: str) -> tuple[str, str] | None:
    """(absolute module, name) that `dotted` (`C`, `mod.C`, `pkg.mod.C`, as written in
    the module `info`) refers to; None when it is not a class name or an imported one."""
    head, *rest = dotted.split(".")
    if not rest and head in info.classes:
        return info.name, head
    if head not in info.bindings:
        return None
    module, name = info.bindings[head]
    if name is None:  # `import a.b` then `a.b.C`
        return (".".join([module, *rest[:-1]]), rest[-1]) if rest else None
    if rest:
        return ".".join([module, name, *rest[:-1]]), rest[-1]
    return module, name


def _alias_choices(value: ast.expr) -> list[str]:
    if isinstance(value, ast.IfExp):
        return _alias_choices(value.body) + _alias_choices(value.orelse)
    if isinstance(value, ast.Name | ast.Attribute):
        name = dotted_name(value)
        return [name] if name else []
    return []


def receiver_name(expr: ast.expr) -> str | None:
    """The last name of a call's receiver: `impl` for `layer.impl.m()` and for `impl.m()`."""
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else None


def dotted_name(expr: ast.expr) -> str | None:
    """`a.b.C` or `C` (a subscript `C[T]` gives `C`); None for anything else."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None
