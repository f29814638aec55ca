"""The calls of a Kimi-K3 tools channel as a token automaton, built from the tools' schemas.

It starts right after the channel's forced opening `<|open|>tools<|sep|><|open|>call
tool="` and ends on `<|end_of_msg|>`:

    NAME" index="DIGITS"<|sep|> ARGUMENT* <|close|>call<|sep|>
    ( <|open|>call tool="NAME" ... )*          (only with parallel calls)
    <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
    ARGUMENT = <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>

`CallSpec` is what a request sends (ids only, made by k3_schema.py from its tools
and tokenizer); `CallAutomaton(spec, classes)` compiles it for a vocabulary's
token classes (token_classes.py). Each state has explicit edges (id -> state) and
class edges (class -> state): a token takes its explicit edge if it has one, else
its class's. Its allowed ids are those with an edge; a state with one explicit
edge and no class edge forces that id. `FINAL` (-1) follows `<|end_of_msg|>`.

Arguments follow the schema's property order: at property i the next argument is
any property from i up to the first required one (each written at most once), and
the call may close only once no required property is left. Values:
- "text": any TEXT or number-class token, up to `<|close|>` (a string);
- "integer" / "number" / the call index: the character DFA of token_classes.py,
  `<|close|>` (or the index's closing quote) allowed in accepting states;
- "options": one of a fixed set of id sequences (enums, booleans, null).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from atom_plugin.parsers.token_classes import (
    ACCEPTING,
    DEAD,
    SPECIAL,
    STARTS,
    TEXT,
    TokenClasses,
)

FINAL = -1
VALUE_KINDS = ("text", "integer", "number", "options")
_PIECES = ("open", "close", "sep", "end")
_SEQUENCES = ("call", "index", "index_end", "argument", "call_end", "tools_end", "message_end")


class CallSpecError(ValueError):
    """A call spec (or a schema turned into one) that the automaton cannot hold."""


def _ids(what: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise CallSpecError(f"{what} must be a non-empty list of token ids, got {value!r}")
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise CallSpecError(f"{what} must hold non-negative int token ids; bad values: {bad}")
    return tuple(value)


@dataclass(frozen=True)
class ArgSpec:
    head: tuple[int, ...]  # ids of `argument key="K" type="T"` (between <|open|> and <|sep|>)
    required: bool
    kind: str
    options: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class ToolSpec:
    name: tuple[int, ...]  # ids of the escaped name
    args: tuple[ArgSpec, ...]


@dataclass(frozen=True)
class CallSpec:
    """The ids of a request's calls: control ids, fixed sequences, tools, and `parallel`."""

    pieces: tuple[tuple[str, int], ...]  # (name, id) for open, close, sep, end
    sequences: tuple[tuple[str, tuple[int, ...]], ...]
    tools: tuple[ToolSpec, ...]
    parallel: bool

    def piece(self, name: str) -> int:
        return dict(self.pieces)[name]

    def sequence(self, name: str) -> tuple[int, ...]:
        return dict(self.sequences)[name]

    def to_json(self) -> dict[str, Any]:
        return {
            **dict(self.pieces),
            **{k: list(v) for k, v in self.sequences},
            "parallel": self.parallel,
            "tools": [
                {
                    "name": list(t.name),
                    "args": [
                        {
                            "head": list(a.head),
                            "required": a.required,
                            "kind": a.kind,
                            **({"options": [list(o) for o in a.options]} if a.options else {}),
                        }
                        for a in t.args
                    ],
                }
                for t in self.tools
            ],
        }

    @classmethod
    def from_json(cls, value: Any) -> CallSpec:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, Mapping):
            raise CallSpecError(f"a call spec must be an object, got {value!r}")
        expected = {*_PIECES, *_SEQUENCES, "parallel", "tools"}
        if set(value) != expected:
            raise CallSpecError(
                f"a call spec has exactly the keys {', '.join(sorted(expected))}; "
                f"got {', '.join(sorted(value))}"
            )
        pieces = tuple((p, _ids(p, [value[p]])[0]) for p in _PIECES)
        sequences = tuple((s, _ids(s, value[s])) for s in _SEQUENCES)
        if not isinstance(value["parallel"], bool):
            raise CallSpecError(f"parallel must be true or false, got {value['parallel']!r}")
        tools = value["tools"]
        if not isinstance(tools, list) or not tools:
            raise CallSpecError(f"tools must be a non-empty list, got {tools!r}")
        return cls(pieces, sequences, tuple(_tool(t) for t in tools), value["parallel"])


def _tool(value: Any) -> ToolSpec:
    if not isinstance(value, Mapping) or set(value) != {"name", "args"}:
        raise CallSpecError(f"a tool has exactly the keys args, name; got {value!r}")
    if not isinstance(value["args"], list):
        raise CallSpecError(f"a tool's args must be a list, got {value['args']!r}")
    return ToolSpec(_ids("name", value["name"]), tuple(_arg(a) for a in value["args"]))


def _arg(value: Any) -> ArgSpec:
    if not isinstance(value, Mapping) or not {"head", "required", "kind"} <= set(value):
        raise CallSpecError(f"an argument has the keys head, required, kind; got {value!r}")
    kind = value["kind"]
    if kind not in VALUE_KINDS:
        raise CallSpecError(f"argument kind {kind!r} is not one of {', '.join(VALUE_KINDS)}")
    options = tuple(_ids("option", o) for o in value.get("options", ()))
    if (kind == "options") != bool(options):
        raise CallSpecError(f"only kind 'options' has options (and needs them), got {value!r}")
    return ArgSpec(_ids("head", value["head"]), bool(value["required"]), kind, options)


@dataclass
class _State:
    edges: dict[int, int] = field(default_factory=dict)
    classes: dict[int, int] = field(default_factory=dict)


class CallAutomaton:
    """A compiled call spec: `states[i]` has `edges` and `classes`; starts at state 0."""

    def __init__(self, spec: CallSpec, classes: TokenClasses) -> None:
        self.spec = spec
        self.token_classes = classes
        self._states: list[_State] = []
        self._build()
        self.states: tuple[_State, ...] = tuple(self._states)
        del self._states

    # ---- queries ------------------------------------------------------------
    @property
    def num_states(self) -> int:
        return len(self.states)

    def explicit_ids(self) -> frozenset[int]:
        return frozenset(t for s in self.states for t in s.edges)

    def step(self, state: int, token: int) -> int | None:
        """The next state (FINAL after the end), or None if `token` is not allowed."""
        node = self.states[state]
        if token in node.edges:
            return node.edges[token]
        return node.classes.get(self.token_classes.class_of(token))

    def step_class(self, state: int, cls: int) -> int | None:
        return self.states[state].classes.get(cls)

    def forced_token(self, state: int) -> int | None:
        node = self.states[state]
        if len(node.edges) == 1 and not node.classes:
            return next(iter(node.edges))
        return None

    def allowed_ids(self, state: int, vocab: int) -> list[int]:
        """Every allowed id below `vocab` (for tests and references)."""
        node = self.states[state]
        of = self.token_classes.of
        by_class = [t for t in range(min(vocab, len(of))) if int(of[t]) in node.classes]
        return sorted(set(by_class) | {t for t in node.edges if t < vocab})

    # ---- construction ---------------------------------------------------------
    def _new(self) -> int:
        self._states.append(_State())
        return len(self._states) - 1

    def _chain(self, ids: Sequence[int], target: int) -> int:
        """States forcing `ids` then going to `target`; returns the first."""
        if not ids:
            return target
        first = current = self._new()
        for token in ids[:-1]:
            nxt = self._new()
            self._states[current].edges[token] = nxt
            current = nxt
        self._states[current].edges[ids[-1]] = target
        return first

    def _trie(self, root: int, branches: Sequence[tuple[Sequence[int], int]]) -> None:
        """Edges from `root` spelling each sequence, its last id going to its target."""
        for ids, target in branches:
            node = root
            for i, token in enumerate(ids):
                edges = self._states[node].edges
                last = i == len(ids) - 1
                if token in edges:
                    nxt = edges[token]
                    if last or nxt in self._ends:
                        raise CallSpecError(
                            f"id sequence {list(ids)} and another one of the same choice "
                            "are prefixes of each other: the automaton cannot tell them apart"
                        )
                    node = nxt
                elif last:
                    edges[token] = target
                    self._ends.add(target)
                else:
                    edges[token] = node = self._new()

    def _build(self) -> None:
        spec, seq = self.spec, self.spec.sequence
        open_, close, sep, end = (spec.piece(p) for p in _PIECES)
        self._ends: set[int] = set()
        name_root = self._new()  # state 0: right after `call tool="`
        tools_close = self._chain(
            (*seq("tools_end"), sep, close, *seq("message_end"), sep, end), FINAL
        )
        after_call = self._new()
        if spec.parallel:
            self._states[after_call].edges[open_] = self._chain(seq("call"), name_root)
        self._states[after_call].edges[close] = tools_close
        call_close = self._chain((*seq("call_end"), sep), after_call)
        branches = []
        for tool in spec.tools:
            first_arg = self._arguments(tool.args, close, open_, sep, call_close)
            # The index's first closing id is the edge out of its digits.
            index_end = self._chain((*seq("index_end")[1:], sep), first_arg)
            digits = self._number("index", index_end, explicit_end=seq("index_end")[0])
            branches.append(((*tool.name, *seq("index")), digits))
        self._trie(name_root, branches)

    def _arguments(
        self, args: Sequence[ArgSpec], close: int, open_: int, sep: int, call_close: int
    ) -> int:
        """State "before property i" for i = 0..n, wired; returns the one for i = 0."""
        n = len(args)
        before = [self._new() for _ in range(n + 1)]
        arg_close_of = []
        for i in range(n):
            after_value = self._chain((*self.spec.sequence("argument"), sep), before[i + 1])
            arg_close_of.append(after_value)
        for i in range(n + 1):
            node = self._states[before[i]]
            required_left = [j for j in range(i, n) if args[j].required]
            last = required_left[0] if required_left else n - 1
            choices = range(i, last + 1)
            if not required_left:
                node.edges[close] = call_close
            if choices:
                keys = self._new()
                node.edges[open_] = keys
                branches = []
                for j in choices:
                    value = self._value(args[j], close, arg_close_of[j])
                    branches.append(((*args[j].head, sep), value))
                self._trie(keys, branches)
        return before[0]

    def _value(self, arg: ArgSpec, close: int, arg_close: int) -> int:
        if arg.kind == "text":
            state = self._new()
            node = self._states[state]
            node.edges[close] = arg_close
            for cls in range(self.token_classes.num_classes):
                if cls != SPECIAL:
                    node.classes[cls] = state
            return state
        if arg.kind == "options":
            root = self._new()
            self._trie(root, [((*o, close), arg_close) for o in arg.options])
            return root
        return self._number(arg.kind, arg_close, explicit_end=close)

    def _number(self, language: str, after: int, explicit_end: int) -> int:
        """States of a character DFA language; `explicit_end` leaves an accepting state."""
        classes = self.token_classes
        numbers = [c for c in range(classes.num_classes) if c not in (TEXT, SPECIAL)]
        reach, todo = {STARTS[language]}, [STARTS[language]]
        while todo:
            q = todo.pop()
            for c in numbers:
                nxt = classes.number_step(c, q)
                if nxt != DEAD and nxt not in reach:
                    reach.add(nxt)
                    todo.append(nxt)
        state_of = {q: self._new() for q in sorted(reach)}
        for q, state in state_of.items():
            node = self._states[state]
            for c in numbers:
                nxt = classes.number_step(c, q)
                if nxt != DEAD:
                    node.classes[c] = state_of[nxt]
            if q in ACCEPTING:
                node.edges[explicit_end] = after
        if not any(q in ACCEPTING for q in reach):
            raise CallSpecError(
                f"the vocabulary has no tokens that write a {language} value "
                f"(its number classes: {len(numbers)})"
            )
        return state_of[STARTS[language]]
