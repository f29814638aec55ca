"""The call table's layout keeps the language: the build with copied trie nodes and runs of
states laid out with numpy gives the arrays the plain build gave, and a request's texts
encoded in batches give the ids each text encoded alone gives.

`OldAutomaton` and `old_arrays` are the build and layout as they were (every state a dict,
each window's copy of a node a full dict copy, the dicts flattened and sorted), kept here
as the oracle: `OldAutomaton` takes the package's build and puts back only the old way of
keeping edges. Generated schemas must compile to equal arrays both ways.
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
from atom_plugin.k3.call_automaton import CallSpec, CallSpecError, _number_shape
from atom_plugin.k3.call_table import CallsTooLarge, check_limits, too_large
from atom_plugin.k3.schema import UnsupportedSchema, call_spec_for
from atom_plugin.k3.token_classes import TokenClasses, classes_for_tokenizer

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


class OldAutomaton(call_automaton.CallAutomaton):
    """The call automaton's build as it was before copied nodes and runs of states were
    kept apart: every state a dict, every copy a full dict copy (`old_arrays` flattens it).

    It overrides only where states keep their edges (runs of forced ids, copies of trie
    nodes, a number's states, the layout); which states and edges a spec makes is the
    package's build.
    """

    def __init__(self, spec: CallSpec, classes: TokenClasses) -> None:
        self.spec = spec
        self.token_classes = classes
        self._max_states = call_table.LIMITS.states
        self._edges: list[dict[int, int]] = []
        self._classes: dict[int, dict[int, int]] = {}
        self._copies = node_versions.NodeVersions()  # stays empty: `_insert` copies dicts
        self._build()
        class_edges = [self._classes.get(s, {}) for s in range(len(self._edges))]
        self.arrays = old_arrays(self._edges, class_edges)

    def _new_states(self, n: int, own: bool = True) -> int:
        return super()._new_states(n)  # every state a dict of its own

    def _chain(self, ids: Sequence[int], target: int) -> int:
        """States forcing `ids` then going to `target`; returns the first."""
        if not ids:
            return target
        first, n = len(self._edges), len(ids)
        if first + n > self._max_states:
            raise too_large("states", first + n, self._max_states)
        self._edges.extend([{token: first + k + 1} for k, token in enumerate(ids)])
        self._edges[-1][ids[-1]] = target
        return first

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

    def _number(self, language: str, after: int, explicit_end: int | None = None) -> int:
        """States of a character DFA language. An accepting state leaves on `explicit_end`
        to `after`, or without one takes `after`'s edges (merged once built)."""
        shape = _number_shape(self.token_classes, language)
        first = len(self._edges)
        for _ in shape:
            self._new()
        for i, (moves, accepting) in enumerate(shape):
            state = first + i
            self._classes[state] = {c: first + j for c, j in moves}
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
