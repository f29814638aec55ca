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
- "options": one of a fixed set of id sequences (enums, booleans, null);
- "json": a JSON value (`JsonSpec`: objects, arrays, JSON strings, numbers,
  options) written compactly in fixed pieces (`{`, `"K": `, `, "K": `, `}`, `[`,
  `, `, `]`, `"`), then `<|close|>`. An object's keys follow its properties'
  order as the arguments do; a JSON string is TEXT and number-class tokens (no
  QUOTED one, so no quote, backslash or control character) up to its closing
  quote; a value's end takes the edges of the state after it (merged once the
  states are built, so numbers and options end on whatever may follow them).

The result is a `CallTable` (call_table.py: flat arrays, what the engine receives),
laid out with numpy (table_layout.py): states built whole at once (runs of forced ids,
a number argument's states) and the key windows' copied nodes (node_versions.py) keep
no dict per state. Building stops with `CallsTooLarge` once it passes `LIMITS.states`,
so a hostile schema costs at most that much work.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from atom_plugin.k3 import call_table
from atom_plugin.k3.call_table import FINAL, CallSpecError, CallTable, too_large
from atom_plugin.k3.node_versions import NodeVersions
from atom_plugin.k3.table_layout import Chains, NumberRuns, table_arrays
from atom_plugin.k3.token_classes import (
    ACCEPTING,
    DEAD,
    QUOTED,
    SPECIAL,
    STARTS,
    TokenClasses,
)

VALUE_KINDS = ("text", "integer", "number", "options", "json")
JSON_KINDS = ("object", "array", "string", "integer", "number", "options")
# The fixed pieces each JSON kind has (ids of `{` `}`, `[` `]` `, `, the quote twice).
_JSON_PIECES = {
    "object": ("open", "close"),
    "array": ("open", "close", "sep"),
    "string": ("open", "close"),
}
MAX_JSON_DEPTH = 16  # objects and arrays nested in one argument value
_JSON_FIELDS = {"object": {"props"}, "array": {"items"}, "options": {"options"}}
_PIECES = ("open", "close", "sep", "end")
_SEQUENCES = ("call", "index", "index_end", "argument", "call_end", "tools_end", "message_end")


def _ids(what: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise CallSpecError(f"{what} must be a non-empty list of token ids, got {value!r}")
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise CallSpecError(f"{what} must hold non-negative int token ids; bad values: {bad}")
    return tuple(value)


@dataclass(frozen=True)
class JsonProp:
    first: tuple[int, ...]  # ids of `"K": ` (the object's first key written)
    more: tuple[int, ...]  # ids of `, "K": ` (a later key)
    required: bool
    value: JsonSpec


@dataclass(frozen=True)
class JsonSpec:
    """A JSON value in ids. `kind` is one of JSON_KINDS; `open`/`close`/`sep` are the
    kind's fixed pieces (see _JSON_PIECES), `props` an object's properties in order,
    `items` an array's item, `options` the values of kind "options"."""

    kind: str
    open: tuple[int, ...] = ()
    close: tuple[int, ...] = ()
    sep: tuple[int, ...] = ()
    props: tuple[JsonProp, ...] = ()
    items: JsonSpec | None = None
    options: tuple[tuple[int, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for piece in _JSON_PIECES.get(self.kind, ()):
            out[piece] = list(getattr(self, piece))
        if self.kind == "object":
            out["props"] = [
                {
                    "first": list(p.first),
                    "more": list(p.more),
                    "required": p.required,
                    "value": p.value.to_json(),
                }
                for p in self.props
            ]
        if self.items is not None:
            out["items"] = self.items.to_json()
        if self.options:
            out["options"] = [list(o) for o in self.options]
        return out

    @classmethod
    def from_json(cls, value: Any, depth: int = 0) -> JsonSpec:
        if depth > MAX_JSON_DEPTH:
            raise CallSpecError(f"a JSON value spec nests deeper than {MAX_JSON_DEPTH} levels")
        if not isinstance(value, Mapping) or value.get("kind") not in JSON_KINDS:
            raise CallSpecError(
                f"a JSON value spec has a kind, one of {', '.join(JSON_KINDS)}; got {value!r}"
            )
        kind = value["kind"]
        pieces = _JSON_PIECES.get(kind, ())
        expected = {"kind", *pieces}
        expected |= _JSON_FIELDS.get(kind, set())
        if set(value) != expected:
            raise CallSpecError(
                f"a JSON {kind} spec has exactly the keys {', '.join(sorted(expected))}; "
                f"got {', '.join(sorted(value))}"
            )
        fields: dict[str, Any] = {p: _ids(f"{kind} {p}", value[p]) for p in pieces}
        if kind == "object":
            if not isinstance(value["props"], list):
                raise CallSpecError(f"an object's props must be a list, got {value['props']!r}")
            fields["props"] = tuple(_json_prop(p, depth + 1) for p in value["props"])
        elif kind == "array":
            fields["items"] = cls.from_json(value["items"], depth + 1)
        elif kind == "options":
            if not isinstance(value["options"], list) or not value["options"]:
                raise CallSpecError(f"options must be a non-empty list, got {value['options']!r}")
            fields["options"] = tuple(_ids("option", o) for o in value["options"])
        return cls(kind, **fields)


def _json_prop(value: Any, depth: int) -> JsonProp:
    keys = {"first", "more", "required", "value"}
    if not isinstance(value, Mapping) or set(value) != keys:
        raise CallSpecError(f"a property has exactly the keys {sorted(keys)}; got {value!r}")
    if not isinstance(value["required"], bool):
        raise CallSpecError(f"required must be true or false, got {value['required']!r}")
    return JsonProp(
        _ids("key", value["first"]),
        _ids("key", value["more"]),
        value["required"],
        JsonSpec.from_json(value["value"], depth),
    )


@dataclass(frozen=True)
class ArgSpec:
    head: tuple[int, ...]  # ids of `argument key="K" type="T"` (between <|open|> and <|sep|>)
    required: bool
    kind: str
    options: tuple[tuple[int, ...], ...] = ()
    json: JsonSpec | None = None  # kind "json" only


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
                            **({"json": a.json.to_json()} if a.json is not None else {}),
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
    if (kind == "json") != ("json" in value):
        raise CallSpecError(f"only kind 'json' has a json value spec (and needs it), got {value!r}")
    json_spec = JsonSpec.from_json(value["json"]) if kind == "json" else None
    return ArgSpec(_ids("head", value["head"]), bool(value["required"]), kind, options, json_spec)


class CallAutomaton:
    """Builds a call spec's automaton for a vocabulary's token classes into `table`
    (state 0 is right after `call tool="`)."""

    def __init__(self, spec: CallSpec, classes: TokenClasses) -> None:
        self.spec = spec
        self.token_classes = classes
        self._max_states = call_table.LIMITS.states
        # Per state its explicit edges (id -> state): a dict of its own, or None for a
        # state of a run (`_chains`, `_numbers` hold them) and a copied node (`_copies`).
        self._edges: list[dict[int, int] | None] = []
        self._chains = Chains()
        self._numbers = NumberRuns()
        self._copies = NodeVersions()
        # The class edges (class -> state) of the states that have any.
        self._classes: dict[int, dict[int, int]] = {}
        self._build()
        arrays = table_arrays(self._edges, self._chains, self._numbers, self._classes, self._copies)
        self.table = CallTable(classes, **arrays)
        del self._edges, self._chains, self._numbers, self._copies, self._classes

    # ---- construction ---------------------------------------------------------
    def _new(self) -> int:
        if len(self._edges) >= self._max_states:
            raise too_large("states", len(self._edges) + 1, self._max_states)
        self._edges.append({})
        return len(self._edges) - 1

    def _new_states(self, n: int, own: bool = True) -> int:
        """`n` new states (as `n` calls of `_new`), with dicts of their own unless their
        edges are held elsewhere (a run, a copy); returns the first."""
        first = len(self._edges)
        if first + n > self._max_states:
            raise too_large("states", self._max_states + 1, self._max_states)
        self._edges.extend([{} for _ in range(n)] if own else itertools.repeat(None, n))
        return first

    def _chain(self, ids: Sequence[int], target: int) -> int:
        """States forcing `ids` then going to `target`; returns the first. They are final:
        `_chains` holds their edges (see `_edges_of`)."""
        if not ids:
            return target
        first, n = len(self._edges), len(ids)
        if first + n > self._max_states:
            raise too_large("states", first + n, self._max_states)
        self._edges.extend(itertools.repeat(None, n))
        self._chains.add(first, ids, target)
        return first

    def _trie(self, root: int, branches: Sequence[tuple[Sequence[int], int]]) -> None:
        """Edges from `root` spelling each sequence, its last id going to its target."""
        for ids, target in branches:
            node = root
            for i, token in enumerate(ids):
                edges = self._edges[node]
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

    def _insert(self, root: int | None, ids: Sequence[int], target: int) -> int:
        """A new trie: `root`'s (None: empty) with `ids` -> `target` added. Only the nodes
        along `ids` are new (copies where `root` had them); every other subtree is shared,
        so a run of windows that each add one sequence costs one path per window. A copy
        of a node below the root is kept as a version of it (`NodeVersions`): the copy
        costs no edges, only the edge set on it."""
        new = self._new()
        if root is not None:
            self._edges[new].update(self._edges[root])
        node = new
        for i, token in enumerate(ids):
            copied = self._copies.edges(node)
            old = (self._edges[node] if copied is None else copied).get(token)
            last = i == len(ids) - 1
            if old is not None and (last or old in self._ends):
                raise CallSpecError(
                    f"id sequence {list(ids)} and another one of the same choice "
                    "are prefixes of each other: the automaton cannot tell them apart"
                )
            if last or old is None:  # past the shared path every state is new: a chain
                self._set(node, token, target if last else self._chain(ids[i + 1 :], target))
                self._ends.add(target)
                break
            child = self._new_states(1, own=False)
            self._copies.copy(old, child, self._edges_of)
            self._set(node, token, child)
            node = child
        return new

    def _set(self, state: int, token: int, target: int) -> None:
        if not self._copies.set(state, token, target):
            self._edges[state][token] = target

    def _edges_of(self, state: int) -> dict[int, int]:
        """The edges of a state that is no copy nor in a number's run (a dict to read, not
        to set)."""
        edges = self._edges[state]
        return self._chains.edges(state) if edges is None else edges

    def _build(self) -> None:
        spec, seq = self.spec, self.spec.sequence
        open_, close, sep, end = (spec.piece(p) for p in _PIECES)
        self._ends: set[int] = set()
        self._merges: list[tuple[int, int]] = []
        # The classes a raw string's text loops on, and a JSON string's.
        classes = range(self.token_classes.num_classes)
        self._text_classes = tuple(c for c in classes if c != SPECIAL)
        self._string_classes = tuple(c for c in classes if c not in (SPECIAL, QUOTED))
        name_root = self._new()  # state 0: right after `call tool="`
        tools_close = self._chain(
            (*seq("tools_end"), sep, close, *seq("message_end"), sep, end), FINAL
        )
        after_call = self._new()
        if spec.parallel:
            self._edges[after_call][open_] = self._chain(seq("call"), name_root)
        self._edges[after_call][close] = tools_close
        call_close = self._chain((*seq("call_end"), sep), after_call)
        branches = []
        index, index_end = seq("index"), seq("index_end")
        for tool in spec.tools:
            first_arg = self._arguments(tool.args, close, open_, sep, call_close)
            # The index's first closing id is the edge out of its digits.
            after_index = self._chain((*index_end[1:], sep), first_arg)
            digits = self._number("index", after_index, explicit_end=index_end[0])
            branches.append(((*tool.name, *index), digits))
        self._trie(name_root, branches)
        self._merge()

    def _merge(self) -> None:
        """Give each merge's target state the edges and classes of its source, to a fixpoint
        (a source may take edges of its own); a clash of targets is a CallSpecError."""
        copied = self._copies.copies.intersection(itertools.chain.from_iterable(self._merges))
        if copied:  # a copy's edges live in self._copies, not in self._edges
            raise RuntimeError(f"copied trie nodes {sorted(copied)} cannot take part in a merge")
        changed = True
        while changed:
            changed = False
            for dst, src in self._merges:
                for mine, theirs in (
                    (self._edges[dst], self._edges_of(src)),
                    (self._classes.setdefault(dst, {}), self._classes.get(src, {})),
                ):
                    for key, target in theirs.items():
                        if key not in mine:
                            mine[key] = target
                            changed = True
                        elif mine[key] != target:
                            raise CallSpecError(
                                f"id or class {key} both ends a JSON value and continues it: "
                                "the automaton cannot tell them apart"
                            )

    def _arguments(
        self, args: Sequence[ArgSpec], close: int, open_: int, sep: int, call_close: int
    ) -> int:
        """State "before property i" for i = 0..n, wired; returns the one for i = 0."""
        n = len(args)
        before = range(self._new_states(n + 1), len(self._edges))
        argument_end = (*self.spec.sequence("argument"), sep)
        # Property j's value goes on to "before j + 1" whichever property came before it,
        # so each value's states are built once and shared by every key trie reaching it.
        # Before property i the keys of i up to the first required one from i may come:
        # that window is property i's key alone when it is required, else its key added
        # to window i + 1's trie (built from the end, sharing all but the new path).
        keys: int | None = None
        no_required_left = True
        for i in range(n, -1, -1):
            if i < n:
                after_value = self._chain(argument_end, before[i + 1])
                value = self._value(args[i], close, after_value)
                keys = self._insert(None if args[i].required else keys, (*args[i].head, sep), value)
                no_required_left = no_required_left and not args[i].required
                self._edges[before[i]][open_] = keys
            if no_required_left:
                self._edges[before[i]][close] = call_close
        return before[0]

    def _value(self, arg: ArgSpec, close: int, arg_close: int) -> int:
        if arg.kind == "text":
            state = self._new()
            self._edges[state][close] = arg_close
            self._classes[state] = dict.fromkeys(self._text_classes, state)
            return state
        if arg.kind == "options":
            root = self._new()
            self._trie(root, [((*o, close), arg_close) for o in arg.options])
            return root
        if arg.kind == "json":
            end = self._new()
            self._edges[end][close] = arg_close
            return self._json(arg.json, end)
        return self._number(arg.kind, arg_close, explicit_end=close)

    def _json(self, node: JsonSpec, after: int) -> int:
        """States of a JSON value that goes on to `after`; returns the first."""
        if node.kind == "string":
            body = self._new()
            self._classes[body] = dict.fromkeys(self._string_classes, body)
            self._edges[body][node.close[0]] = self._chain(node.close[1:], after)
            return self._chain(node.open, body)
        if node.kind in ("integer", "number"):
            return self._number(node.kind, after)
        if node.kind == "options":
            root = self._new()
            for option in node.options:
                state = root
                for token in option:
                    edges = self._edges[state]
                    state = edges[token] if token in edges else edges.setdefault(token, self._new())
                self._merges.append((state, after))
            return root
        if node.kind == "array":
            after_item = self._new()
            item = self._json(node.items, after_item)
            self._trie(after_item, [(node.sep, item), (node.close, after)])
            first = self._new()
            self._trie(first, [(node.close, after)])
            self._merges.append((first, item))  # `]` or the first item
            return self._chain(node.open, first)
        # before[w]: the trie before property i, w = whether a key was written (`, "K": `
        # then); built from the end as the arguments' windows are (see _arguments).
        before = [self._insert(None, node.close, after) for _ in (0, 1)]
        for prop in reversed(node.props):
            value = self._json(prop.value, before[1])
            before = [
                self._insert(None if prop.required else before[w], key, value)
                for w, key in enumerate((prop.first, prop.more))
            ]
        return self._chain(node.open, before[0])

    def _number(self, language: str, after: int, explicit_end: int | None = None) -> int:
        """States of a character DFA language. An accepting state leaves on `explicit_end`
        to `after`, or without one takes `after`'s edges (merged once built)."""
        shape = _number_shape(self.token_classes, language)
        if explicit_end is not None:  # final at once: a run (see `_numbers`)
            first = self._new_states(len(shape), own=False)
            self._numbers.add(first, shape, explicit_end, after)
            return first
        first = self._new_states(len(shape))
        for i, (moves, accepting) in enumerate(shape):
            state = first + i
            self._classes[state] = {c: first + j for c, j in moves}
            if accepting:
                self._merges.append((state, after))
        return first


@functools.lru_cache(maxsize=16)
def _number_shape(classes: TokenClasses, language: str) -> tuple[tuple[tuple, bool], ...]:
    """The language's character states reachable through the vocabulary's number classes,
    the start first: per state, its (class, state index) moves and whether it accepts."""
    numbers = list(classes.number_classes)
    reach, todo = [STARTS[language]], [STARTS[language]]
    while todo:
        q = todo.pop()
        for c in numbers:
            nxt = classes.number_step(c, q)
            if nxt != DEAD and nxt not in reach:
                reach.append(nxt)
                todo.append(nxt)
    if not any(q in ACCEPTING for q in reach):
        raise CallSpecError(
            f"the vocabulary has no tokens that write a {language} value "
            f"(its number classes: {len(numbers)})"
        )
    index = {q: i for i, q in enumerate(reach)}
    return tuple(
        (
            tuple(
                (c, index[classes.number_step(c, q)])
                for c in numbers
                if classes.number_step(c, q) != DEAD
            ),
            q in ACCEPTING,
        )
        for q in reach
    )


def compile_calls(spec: CallSpec, classes: TokenClasses) -> CallTable:
    """The call table of `spec` for `classes` (CallsTooLarge beyond `LIMITS`)."""
    return CallAutomaton(spec, classes).table
