"""Call shapes, compared without running anything: what a host passes vs what an override takes.

A `Sig` is a function's parameter list (from `inspect.signature` or from the source's
`ast.arguments`); a `CallShape` is one call site (positional count, keyword names).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

POSITIONAL_ONLY = "positional-only"
POSITIONAL = "positional-or-keyword"
VAR_POSITIONAL = "*args"
KEYWORD_ONLY = "keyword-only"
VAR_KEYWORD = "**kwargs"

_FROM_INSPECT = {
    inspect.Parameter.POSITIONAL_ONLY: POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: POSITIONAL,
    inspect.Parameter.VAR_POSITIONAL: VAR_POSITIONAL,
    inspect.Parameter.KEYWORD_ONLY: KEYWORD_ONLY,
    inspect.Parameter.VAR_KEYWORD: VAR_KEYWORD,
}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    has_default: bool


@dataclass(frozen=True)
class Sig:
    """Parameters after the bound one (self/cls), so method and call shapes line up."""

    params: tuple[Param, ...]

    @property
    def positional(self) -> list[Param]:
        return [p for p in self.params if p.kind in (POSITIONAL_ONLY, POSITIONAL)]

    def has(self, kind: str) -> bool:
        return any(p.kind == kind for p in self.params)

    def keyword(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name and p.kind in (POSITIONAL, KEYWORD_ONLY):
                return p
        return None

    def __str__(self) -> str:
        parts = []
        for p in self.params:
            text = {VAR_POSITIONAL: f"*{p.name}", VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
            parts.append(text + ("=..." if p.has_default else ""))
        return f"({', '.join(parts)})"


def sig_from_callable(func, bound: bool) -> Sig:
    """`bound`: drop the first parameter (self or cls)."""
    params = [
        Param(p.name, _FROM_INSPECT[p.kind], p.default is not inspect.Parameter.empty)
        for p in inspect.signature(func, follow_wrapped=True).parameters.values()
    ]
    return Sig(tuple(params[1:] if bound and params else params))


def sig_from_ast(args: ast.arguments, bound: bool) -> Sig:
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    n_posonly = len(args.posonlyargs)
    params = [
        Param(a.arg, POSITIONAL_ONLY if i < n_posonly else POSITIONAL, i >= first_default)
        for i, a in enumerate(positional)
    ]
    if args.vararg is not None:
        params.append(Param(args.vararg.arg, VAR_POSITIONAL, False))
    for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(Param(a.arg, KEYWORD_ONLY, default is not None))
    if args.kwarg is not None:
        params.append(Param(args.kwarg.arg, VAR_KEYWORD, False))
    if bound and params and params[0].kind in (POSITIONAL_ONLY, POSITIONAL):
        params = params[1:]
    return Sig(tuple(params))


def override_problems(override: Sig, base: Sig) -> list[str]:
    """Why some call that `base` accepts would fail on `override` (empty: none would).

    One leniency: optional parameters an override takes only through `**kwargs` are not
    reported here (callers pass them by keyword in practice); `call_problems` on the
    host's call sites reports any that pass them by position."""
    problems = []
    over_pos = override.positional
    for i, b in enumerate(base.positional):
        if i < len(over_pos):
            o = over_pos[i]
            if b.kind == POSITIONAL and o.name != b.name and not override.keyword(b.name):
                if not override.has(VAR_KEYWORD):
                    problems.append(
                        f"parameter {i + 1} is {o.name!r} where the host's is {b.name!r} "
                        f"(a call passing {b.name}= fails)"
                    )
            if b.has_default and not o.has_default:
                problems.append(f"{o.name!r} has no default; the host may leave it out")
        elif override.has(VAR_POSITIONAL):
            break
        elif all(p.has_default and p.kind == POSITIONAL for p in base.positional[i:]) and (
            override.has(VAR_KEYWORD)
        ):
            # `def m(self, a, **kwargs)` over optional parameters: fine by keyword; the
            # call-site checks catch a host call that passes them by position.
            break
        else:
            problems.append(
                f"takes {len(over_pos)} positional argument(s); the host's signature has "
                f"{len(base.positional)} ({', '.join(p.name for p in base.positional)}): "
                f"{b.name!r} is missing"
            )
            break
    takes_any_keyword = override.has(VAR_KEYWORD)
    for b in base.params:
        if b.kind == KEYWORD_ONLY and not override.keyword(b.name) and not takes_any_keyword:
            problems.append(f"keyword argument {b.name!r} of the host is not accepted")
    for kind in (VAR_POSITIONAL, VAR_KEYWORD):
        if base.has(kind) and not override.has(kind):
            problems.append(f"the host's signature takes {kind}; the override does not")
    base_names = {p.name for p in base.params}
    for i, o in enumerate(over_pos):
        if o.has_default or i < len(base.positional) or o.name in base_names:
            continue
        problems.append(f"requires {o.name!r}, which the host never passes")
    for o in override.params:
        if o.kind == KEYWORD_ONLY and not o.has_default and o.name not in base_names:
            problems.append(f"requires keyword {o.name!r}, which the host never passes")
    return problems


def constructor_contract(base: Sig) -> Sig:
    """What vLLM's constructions of a subclass pass: the base's required parameters, by
    name (a subclass may drop the optional ones that exist for other subclasses)."""
    required = [
        Param(p.name, KEYWORD_ONLY, False)
        for p in base.params
        if not p.has_default and p.kind in (POSITIONAL, KEYWORD_ONLY)
    ]
    return Sig(tuple(required))


@dataclass(frozen=True)
class CallShape:
    """One call: how many positional arguments and which keywords (splats: unknown)."""

    positional: int
    keywords: tuple[str, ...]
    splat_args: bool = False
    splat_kwargs: bool = False

    @classmethod
    def of(cls, call: ast.Call) -> CallShape:
        splat_args = any(isinstance(a, ast.Starred) for a in call.args)
        positional = sum(1 for a in call.args if not isinstance(a, ast.Starred))
        keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
        splat_kwargs = any(k.arg is None for k in call.keywords)
        return cls(positional, keywords, splat_args, splat_kwargs)

    def __str__(self) -> str:
        parts = [f"{self.positional} positional"]
        if self.keywords:
            parts.append("keywords " + ", ".join(self.keywords))
        return " + ".join(parts)


def call_problems(sig: Sig, call: CallShape) -> list[str]:
    """Why `call` would not bind to `sig` (empty: it would, as far as its shape shows)."""
    problems = []
    pos = sig.positional
    if call.positional > len(pos) and not sig.has(VAR_POSITIONAL):
        problems.append(f"passes {call.positional} positional argument(s); {len(pos)} accepted")
    filled = {p.name for p in pos[: call.positional]}
    for name in call.keywords:
        param = sig.keyword(name)
        if param is None and not sig.has(VAR_KEYWORD):
            problems.append(f"passes keyword {name!r}, which is not a parameter")
        elif param is not None and name in filled:
            problems.append(f"passes {name!r} both by position and by keyword")
        filled.add(name)
    if not (call.splat_args or call.splat_kwargs):
        for p in sig.params:
            if p.kind in (VAR_POSITIONAL, VAR_KEYWORD) or p.has_default or p.name in filled:
                continue
            problems.append(f"leaves required {p.name!r} unfilled")
    return problems
