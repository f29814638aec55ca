"""Write signature-only stubs of a few vLLM modules: the facts the host-API check reads.

    python -m scripts.vllm_api_stubs --source vllm-0.33.0-...whl --out DIR MODULE...

Each stub keeps a module's imports, the names it defines, its classes with their bases,
methods (parameters, defaults as `...`, the decorators that change binding or make a
member abstract) and attributes (class-level names with their annotations, dataclass
fields among them; `self.x = _` for each attribute a method assigns), top-level functions'
parameters and, inside methods, the shape of the calls the check looks at (`self.m(...)`,
`<x>.impl.m(...)`, `current_platform.m(...)`) with `_` for every argument. No function
body is kept. `tests/fixtures/vllm_0_33_api/` and `vllm_0_34_api/` were made this way.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from atom_plugin.vllm.compat.check import ROLE_RECEIVERS
from atom_plugin.vllm.compat.hosts import (
    ATTRIBUTES_MARK,
    KEPT_NAMES_MARK,
    STUB_MARK,
    SourceHost,
)
from atom_plugin.vllm.compat.source import (
    MEANINGFUL_DECORATORS,
    class_bindings,
    decorator_name,
    decorator_names,
    decorator_target,
    first_parameter,
    receiver_name,
    self_assignments,
)

RECEIVERS = {r for receivers in ROLE_RECEIVERS.values() for r in receivers} | {"self", "cls"}
ANY = ast.Name("_")


def _call_stub(call: ast.Call) -> ast.stmt:
    func = call.func
    assert isinstance(func, ast.Attribute)
    receiver = receiver_name(func.value)
    value = ast.Name(receiver) if receiver in ("self", "cls") else ast.Attribute(ANY, receiver)
    args = [ast.Starred(ANY) if isinstance(a, ast.Starred) else ANY for a in call.args]
    keywords = [ast.keyword(k.arg, ANY) for k in call.keywords]
    return ast.Expr(ast.Call(ast.Attribute(value, func.attr), args, keywords))


def _signature_only(args: ast.arguments) -> ast.arguments:
    def strip(a: ast.arg) -> ast.arg:
        return ast.arg(a.arg)

    return ast.arguments(
        posonlyargs=[strip(a) for a in args.posonlyargs],
        args=[strip(a) for a in args.args],
        vararg=strip(args.vararg) if args.vararg else None,
        kwonlyargs=[strip(a) for a in args.kwonlyargs],
        kw_defaults=[None if d is None else ast.Constant(...) for d in args.kw_defaults],
        kwarg=strip(args.kwarg) if args.kwarg else None,
        defaults=[ast.Constant(...) for _ in args.defaults],
    )


def _decorators(node) -> list[ast.expr]:
    return [
        decorator_target(dec)
        for dec in node.decorator_list
        if decorator_name(dec) in MEANINGFUL_DECORATORS
    ]


def _function(node, in_class: bool) -> ast.FunctionDef:
    body: list[ast.stmt] = []
    if in_class:
        if "staticmethod" not in decorator_names(node):
            me = first_parameter(node)
            for name in sorted(self_assignments(node)):
                body.append(ast.Assign([ast.Attribute(ast.Name(me), name)], ANY))
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and receiver_name(sub.func.value) in RECEIVERS
                and not isinstance(sub.func.value, ast.Call)
            ):
                body.append(_call_stub(sub))
    return ast.FunctionDef(
        name=node.name,
        args=_signature_only(node.args),
        body=body or [ast.Expr(ast.Constant(...))],
        decorator_list=_decorators(node),
        returns=None,
        type_params=[],
    )


def _class_attributes(body: list[ast.stmt]) -> list[ast.stmt]:
    """`name: annotation = ...` / `name = ...` for each name a class body binds, as the
    reader finds them (`class_bindings`)."""
    out: list[ast.stmt] = []
    for name, item in class_bindings(body):
        if isinstance(item, ast.AnnAssign):
            value = None if item.value is None else ast.Constant(...)
            out.append(ast.AnnAssign(ast.Name(name), item.annotation, value, 1))
        else:
            out.append(ast.Assign([ast.Name(name)], ast.Constant(...)))
    return out


def _alias(value: ast.expr | None) -> ast.expr | None:
    """A name the module binds to another, kept for the reader (`CudaPlatform = Nvml...
    if nvml_available else NonNvml...` becomes `... if _ else ...`); None for any other value."""
    if isinstance(value, ast.Name | ast.Attribute):
        return value
    if isinstance(value, ast.IfExp):
        body, orelse = _alias(value.body), _alias(value.orelse)
        if body is not None and orelse is not None:
            return ast.IfExp(ANY, body, orelse)
    return None


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.ClassDef):
            members = _class_attributes(node.body) + [
                _function(item, in_class=True)
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
            out.append(
                ast.ClassDef(
                    name=node.name,
                    bases=node.bases,
                    keywords=node.keywords,
                    body=members or [ast.Expr(ast.Constant(...))],
                    decorator_list=[],
                    type_params=[],
                )
            )
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append(_function(node, in_class=False))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            alias = _alias(node.value)
            for target in targets:
                if alias is not None and isinstance(target, ast.Name):
                    out.append(ast.Assign([ast.Name(target.id)], alias))
                    continue
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        out.append(ast.Assign([ast.Name(sub.id)], ast.Constant(...)))
        elif isinstance(node, ast.If | ast.Try):
            out.extend(_statements(node.body))
            out.extend(_statements(getattr(node, "orelse", [])))
            for handler in getattr(node, "handlers", []):
                out.extend(_statements(handler.body))
    return out


def stub(text: str, origin: str, only: set[str] | None = None) -> str:
    """`only`: keep just these top-level names (imports are always kept)."""
    body = _statements(ast.parse(text).body)
    if only is not None:
        body = [node for node in body if _keeps(node, only)]
    module = ast.Module(body=body, type_ignores=[])
    header = f"{STUB_MARK} {origin} (scripts/vllm_api_stubs.py); no bodies.\n"
    if only is not None:
        header += f"{KEPT_NAMES_MARK} {', '.join(sorted(only))}\n"
    header += f"{ATTRIBUTES_MARK} class-level names and `self.x = _` per method\n"
    return header + ast.unparse(ast.fix_missing_locations(module)) + "\n"


def _keeps(node: ast.stmt, only: set[str]) -> bool:
    if isinstance(node, ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id in only for t in node.targets)
    return getattr(node, "name", None) in only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="a vLLM wheel or source directory")
    parser.add_argument("--out", required=True, help="directory to write the stub tree into")
    parser.add_argument(
        "modules",
        nargs="+",
        help="modules to stub, e.g. vllm.v1.attention.backend; MODULE:NAME,NAME keeps only "
        "those top-level names",
    )
    args = parser.parse_args(argv)
    host = SourceHost(args.source)
    tree = host.tree
    out = Path(args.out)
    for spec in ["vllm", *args.modules]:
        module, _, names = spec.partition(":")
        only = set(names.split(",")) if names else None
        text = tree.text(module)
        if text is None:
            raise SystemExit(f"{module} is not in {args.source}")
        path = out / tree.location(module)
        path.parent.mkdir(parents=True, exist_ok=True)
        origin = f"{tree.location(module)} from {Path(args.source).name}"
        if module == "vllm":
            body = f"# Package marker; {origin}.\nfrom vllm._version import __version__\n"
        else:
            body = stub(text, origin, only)
        path.write_text(body)
        print(f"wrote {path} ({len(body.splitlines())} lines)")
    (out / "vllm" / "_version.py").write_text(f"__version__ = {host.version()!r}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
