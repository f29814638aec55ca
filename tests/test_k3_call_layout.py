"""The call table's layout keeps the language: the build with copied trie nodes and runs of
states laid out with numpy gives the arrays the plain build gave, and a request's texts
encoded in batches give the ids each text encoded alone gives.

`OldAutomaton` and `old_arrays` are the build and layout as they were (every state a dict,
each window's copy of a node a full dict copy, the dicts flattened and sorted), kept here
as the oracle; generated schemas must compile to equal arrays both ways.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k3_words import Words

from atom_plugin.k3 import call_automaton, call_table, node_versions, schema, table_layout
from atom_plugin.k3.call_automaton import (
    _PIECES,
    ArgSpec,
    CallSpec,
    CallSpecError,
    JsonSpec,
    _number_shape,
)
from atom_plugin.k3.call_table import FINAL, CallsTooLarge, check_limits, too_large
from atom_plugin.k3.schema import UnsupportedSchema, call_spec_for
from atom_plugin.k3.token_classes import QUOTED, SPECIAL, TokenClasses, classes_for_tokenizer

WORDS = Words()
CLASSES = classes_for_tokenizer(WORDS)
DIGITS = ["0", "1", "2", "5", "7", "9"]
# Keys the test vocabulary spells, sharing prefixes as they are tokenized ("x1" is a piece).
KEYS = ["a", "b", "c", "city", "count", *("x" + "".join(d) for n in (1, 2) for d in
        itertools.product(DIGITS, repeat=n))]  # fmt: skip


def old_arrays(edges: Sequence[dict], class_edges: Sequence[dict]) -> dict[str, np.ndarray]:
    """The CSR arrays of per-state dicts, as the table was laid out before."""
    arrays: dict[str, np.ndarray] = {}
    for prefix, maps in (("edge", edges), ("class", class_edges)):
        counts = np.fromiter(map(len, maps), dtype=np.int64, count=len(maps))
        keys = np.fromiter(itertools.chain.from_iterable(maps), dtype=np.int64)
        dsts = np.fromiter(itertools.chain.from_iterable(m.values() for m in maps), dtype=np.int64)
        src = np.repeat(np.arange(len(maps)), counts)
        order = np.lexsort((keys, src))  # by state, then ascending within it
        key = "tok" if prefix == "edge" else "cls"
        arrays[f"{prefix}_ptr"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        arrays[f"{prefix}_{key}"] = keys[order].astype(np.int32)
        arrays[f"{prefix}_dst"] = dsts[order].astype(np.int32)
    check_limits(arrays)
    return arrays


class OldAutomaton:
    """The call automaton's build as it was before copied nodes and runs of states were
    kept apart: every state a dict, every copy a full dict copy (`old_arrays` flattens it)."""

    def __init__(self, spec: CallSpec, classes: TokenClasses) -> None:
        self.spec = spec
        self.token_classes = classes
        self._max_states = call_table.LIMITS.states
        # Per state: its explicit edges (id -> state) and class edges (class -> state).
        self._edges: list[dict[int, int]] = []
        self._classes: list[dict[int, int]] = []
        self._build()
        self.arrays = old_arrays(self._edges, self._classes)

    # ---- construction ---------------------------------------------------------
    def _new(self) -> int:
        if len(self._edges) >= self._max_states:
            raise too_large("states", len(self._edges) + 1, self._max_states)
        self._edges.append({})
        self._classes.append({})
        return len(self._edges) - 1

    def _chain(self, ids: Sequence[int], target: int) -> int:
        """States forcing `ids` then going to `target`; returns the first."""
        if not ids:
            return target
        first, n = len(self._edges), len(ids)
        if first + n > self._max_states:
            raise too_large("states", first + n, self._max_states)
        self._edges.extend([{token: first + k + 1} for k, token in enumerate(ids)])
        self._classes.extend([{} for _ in range(n)])
        self._edges[-1][ids[-1]] = target
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
        so a run of windows that each add one sequence costs one path per window."""
        new = self._new()
        if root is not None:
            self._edges[new].update(self._edges[root])
        node = new
        for i, token in enumerate(ids):
            edges = self._edges[node]
            old = edges.get(token)
            last = i == len(ids) - 1
            if old is not None and (last or old in self._ends):
                raise CallSpecError(
                    f"id sequence {list(ids)} and another one of the same choice "
                    "are prefixes of each other: the automaton cannot tell them apart"
                )
            if last or old is None:  # past the shared path every state is new: a chain
                edges[token] = target if last else self._chain(ids[i + 1 :], target)
                self._ends.add(target)
                break
            child = self._new()
            self._edges[child].update(self._edges[old])
            edges[token] = node = child
        return new

    def _build(self) -> None:
        spec, seq = self.spec, self.spec.sequence
        open_, close, sep, end = (spec.piece(p) for p in _PIECES)
        self._ends: set[int] = set()
        self._merges: list[tuple[int, int]] = []
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
        for tool in spec.tools:
            first_arg = self._arguments(tool.args, close, open_, sep, call_close)
            # The index's first closing id is the edge out of its digits.
            index_end = self._chain((*seq("index_end")[1:], sep), first_arg)
            digits = self._number("index", index_end, explicit_end=seq("index_end")[0])
            branches.append(((*tool.name, *seq("index")), digits))
        self._trie(name_root, branches)
        self._merge()

    def _merge(self) -> None:
        """Give each merge's target state the edges and classes of its source, to a fixpoint
        (a source may take edges of its own); a clash of targets is a CallSpecError."""
        changed = True
        while changed:
            changed = False
            for dst, src in self._merges:
                for mine, theirs in (
                    (self._edges[dst], self._edges[src]),
                    (self._classes[dst], self._classes[src]),
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
        before = [self._new() for _ in range(n + 1)]
        # Property j's value goes on to "before j + 1" whichever property came before it,
        # so each value's states are built once and shared by every key trie reaching it.
        # Before property i the keys of i up to the first required one from i may come:
        # that window is property i's key alone when it is required, else its key added
        # to window i + 1's trie (built from the end, sharing all but the new path).
        keys: int | None = None
        no_required_left = True
        for i in range(n, -1, -1):
            if i < n:
                after_value = self._chain((*self.spec.sequence("argument"), sep), before[i + 1])
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
            loops = self._classes[state]
            for cls in range(self.token_classes.num_classes):
                if cls != SPECIAL:
                    loops[cls] = state
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
            loops = self._classes[body]
            for cls in range(self.token_classes.num_classes):
                if cls not in (SPECIAL, QUOTED):
                    loops[cls] = body
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
        first = len(self._edges)
        for _ in shape:
            self._new()
        for i, (moves, accepting) in enumerate(shape):
            state = first + i
            self._classes[state].update((c, first + j) for c, j in moves)
            if accepting:
                if explicit_end is None:
                    self._merges.append((state, after))
                else:
                    self._edges[state][explicit_end] = after
        return first


# ---- schemas -----------------------------------------------------------------------------

scalar = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
    st.lists(st.sampled_from(["x", "y", "xy", "Paris", 'x"y', "a&b"]), min_size=1, max_size=3).map(
        lambda v: {"type": "string", "enum": v}
    ),
    st.lists(st.sampled_from([0, 1, -1, 12, 7]), min_size=1, max_size=3).map(
        lambda v: {"type": "integer", "enum": v}
    ),
)


@st.composite
def objects(draw, values, max_keys):
    keys = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=max_keys))
    schema = {"type": "object", "properties": {k: draw(values) for k in keys}}
    if keys:
        schema["required"] = draw(st.lists(st.sampled_from(keys), unique=True, max_size=3))
    return schema


values = st.recursive(
    scalar,
    lambda inner: st.one_of(
        inner.map(lambda items: {"type": "array", "items": items}), objects(inner, max_keys=8)
    ),
    max_leaves=6,
)


@st.composite
def tools(draw):
    """Up to three tools of up to 24 properties: long runs of optional keys sharing
    prefixes (copied trie nodes), nested objects with optional keys, arrays, enums."""
    names = draw(st.lists(st.sampled_from(["f", "g", "get_weather", "x1"]), min_size=1,
                          max_size=3, unique=True))  # fmt: skip
    return [
        {"type": "function", "function": {"name": n, "parameters": draw(objects(values, 24))}}
        for n in names
    ]


def one_tool(properties: dict, required: Sequence[str] = ()) -> CallSpec:
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return call_spec_for(
        WORDS, [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    )


def both(spec: CallSpec) -> tuple[dict | Exception, dict | Exception]:
    """The arrays (or the error) of the oracle and of the package's build."""
    results = []
    for build in (lambda: OldAutomaton(spec, CLASSES).arrays, lambda: _arrays(spec)):
        try:
            results.append(build())
        except CallSpecError as err:
            results.append(err)
    return results[0], results[1]


def _arrays(spec: CallSpec) -> dict[str, np.ndarray]:
    table = call_automaton.compile_calls(spec, CLASSES)
    return {name: getattr(table, name) for name in call_table._ARRAYS}


def assert_same(old, new) -> None:
    if isinstance(old, Exception) or isinstance(new, Exception):
        assert type(old) is type(new) and str(old) == str(new), (old, new)
        return
    for name in call_table._ARRAYS:
        assert np.array_equal(old[name], new[name]), name


@pytest.fixture
def spies(monkeypatch):
    """Counts of copied nodes (NodeVersions.copy) and runs of states (Chains.add,
    NumberRuns.add)."""
    counts = {"copies": 0, "runs": 0, "numbers": 0}
    for owner, method, key in (
        (node_versions.NodeVersions, "copy", "copies"),
        (table_layout.Chains, "add", "runs"),
        (table_layout.NumberRuns, "add", "numbers"),
    ):
        original = getattr(owner, method)

        def counting(self, *args, _original=original, _key=key):
            counts[_key] += 1
            return _original(self, *args)

        monkeypatch.setattr(owner, method, counting)
    return counts


# ---- the call table's layout ---------------------------------------------------------------


@pytest.fixture(params=["the module's blocks", "blocks of 3 rows"])
def block(request, monkeypatch):
    """The copies' rows laid out in blocks as large as the module's, or of 3 rows (each
    block then ends with the next id: many blocks)."""
    if request.param == "blocks of 3 rows":
        monkeypatch.setattr(node_versions, "_BLOCK", 3)
    return node_versions._BLOCK


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(tools(), st.booleans())
def test_generated_schemas_lay_out_as_the_plain_build(block, request_tools, parallel):
    try:
        spec = call_spec_for(WORDS, request_tools, None, parallel)
    except UnsupportedSchema:
        return
    assert_same(*both(spec))


def test_many_optional_keys_take_the_copied_nodes_path(block, spies):
    """2,000-property shape at test size: every window copies the nodes on its key's path,
    kept as versions; the table equals the plain build's."""
    old, new = both(one_tool({k: {"type": "integer"} for k in KEYS}))
    assert spies["copies"] >= len(KEYS) and spies["runs"] > 0
    assert spies["numbers"] == len(KEYS) + 1  # each property's value, and the call index
    assert_same(old, new)


def test_nested_optional_keys_and_merges_lay_out_as_the_plain_build(block, spies):
    inner = {"type": "object", "properties": {k: {"type": "integer"} for k in KEYS[:20]}}
    array = {"type": "array", "items": {"type": "number"}}
    old, new = both(one_tool({"a": inner, "b": array}, required=["b"]))
    assert spies["copies"] > 0
    assert_same(old, new)


@pytest.mark.parametrize(
    "limit", [dict(states=60), dict(allowed=2), dict(allowed=5), dict(edges=100), dict(edges=400)]
)
def test_limits_fail_alike(monkeypatch, limit):
    """Beyond a limit both builds refuse the same way (a copy past `allowed` is not laid out)."""
    monkeypatch.setattr(call_table, "LIMITS", call_table.CallLimits(**limit))
    old, new = both(one_tool({k: {"type": "integer"} for k in KEYS}))
    assert isinstance(new, CallsTooLarge)
    assert_same(old, new)


# ---- a request's texts encoded in batches --------------------------------------------------


class OneAtATime:
    """A tokenizer's `encode` alone: each text encoded on its own, as before batches."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.unk_token_id = tokenizer.unk_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def fast_tokenizer(tmp_path_factory):
    """The synthetic K3 tokenizer of `vllm serve`'s benchmarks (a Hugging Face fast one)."""
    from benchmarks.k3_serving_model import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("k3_tokenizer"), vocab=4096)


text = st.text(alphabet='abxyz019 _-."&<|é{}', min_size=1, max_size=8)
json_value = st.recursive(
    st.one_of(
        st.sampled_from([{"type": "integer"}, {"type": "string"}, {"type": "boolean"}]),
        st.lists(text, min_size=1, max_size=12).map(lambda v: {"type": "string", "enum": v}),
    ),
    lambda inner: st.one_of(
        inner.map(lambda items: {"type": "array", "items": items}),
        st.dictionaries(text, inner, max_size=4).map(lambda p: {"type": "object", "properties": p}),
    ),
    max_leaves=5,
)


@st.composite
def texts_tools(draw):
    names = draw(st.lists(text, min_size=1, max_size=12, unique=True))
    return [
        {"type": "function", "function": {"name": n, "parameters": {
            "type": "object", "properties": draw(st.dictionaries(text, json_value, max_size=12))}}}
        for n in names
    ]  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(request_tools=texts_tools())
def test_batched_texts_encode_as_each_text_alone(fast_tokenizer, request_tools, monkeypatch):
    batched = []
    prime = schema._Encoder.prime

    def counting(self, texts):
        texts = list(texts)
        if self._batch is not None:
            batched.append(len(texts))
        return prime(self, texts)

    monkeypatch.setattr(schema._Encoder, "prime", counting)
    results = []
    for tokenizer in (fast_tokenizer, OneAtATime(fast_tokenizer)):
        try:
            results.append(call_spec_for(tokenizer, request_tools))
        except UnsupportedSchema as err:
            results.append(str(err))
    assert results[0] == results[1]
    assert batched  # the fast tokenizer took the batch path
