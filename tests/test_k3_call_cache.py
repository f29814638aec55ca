"""Tool sets compiled once where requests come in, bounded, and laid out by the engine.

The API server's `CallCache` compiles each distinct tool set once into a `CallTable`
and keeps results and refusals in an LRU bounded in entries and bytes; a call
automaton beyond `LIMITS` is refused naming the limit; the wire form round-trips and a
damaged one is refused; the engine's path (`request_channel`, `ChannelCore`) compiles
nothing and lays out each new channel's rows once, appending them without touching the
rows already on the device.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from k3_words import Words

from atom_plugin.k3 import call_automaton, call_table, channel_tables
from atom_plugin.k3.call_cache import CallCache
from atom_plugin.k3.call_table import CallLimits, CallsTooLarge, CallTable
from atom_plugin.k3.channel_for import channel_extra_args, request_channel, required_channel_for
from atom_plugin.k3.channel_tables import SharedTables, compile_channels, next_states
from atom_plugin.k3.processor_core import MAX_IDLE_CHANNELS, ChannelCore
from atom_plugin.k3.required_channel import START
from atom_plugin.k3.schema import UnsupportedSchema, call_spec_for
from atom_plugin.k3.token_classes import classes_for_tokenizer

WORDS = Words()
CLASSES = classes_for_tokenizer(WORDS)
REQUIRED = required_channel_for(WORDS)
DIGITS = ["0", "1", "2", "5", "7", "9"]


def keys(n: int) -> list[str]:
    """n distinct keys the test vocabulary spells (x, then digits)."""
    out = []
    for width in itertools.count(1):
        for digits in itertools.product(DIGITS, repeat=width):
            out.append("x" + "".join(digits))
            if len(out) == n:
                return out


def tool(name="f", n=3, required=(), kind="integer"):
    properties = {k: {"type": kind} for k in keys(n)}
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


class Params:
    def __init__(self, extra_args, stop=()):
        self.extra_args, self.all_stop_token_ids = extra_args, set(stop)


@pytest.fixture
def limits(monkeypatch):
    """Set the call tables' limits for one test."""

    def set_limits(**values):
        monkeypatch.setattr(call_table, "LIMITS", CallLimits(**values))

    return set_limits


# ---- the API server's cache ---------------------------------------------------------------


def test_each_distinct_tool_set_compiles_once():
    cache = CallCache(WORDS, CLASSES)
    first, compiled = cache.calls_for([tool()], None, True)
    assert compiled and first.num_states > 0
    again, compiled = cache.calls_for(copy.deepcopy([tool()]), None, True)
    assert not compiled and again is first
    # Another name, parallel setting or property order is another tool set.
    _, by_name = cache.calls_for([tool()], "f", True)
    _, by_parallel = cache.calls_for([tool()], None, False)
    reordered = tool()
    props = reordered["function"]["parameters"]["properties"]
    reordered["function"]["parameters"]["properties"] = dict(reversed(list(props.items())))
    _, by_order = cache.calls_for([reordered], None, True)
    assert by_name and by_parallel and by_order
    assert cache.compiles == 4 and cache.stats()["hits"] == 1


def test_refusals_are_cached_too():
    cache = CallCache(WORDS, CLASSES)
    union = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": ["string", "null"]}}}}}  # fmt: skip
    for _ in range(3):
        result, _ = cache.calls_for([union], None, True)
        assert isinstance(result, UnsupportedSchema) and "property 'a'" in str(result)
    assert cache.compiles == 1


def test_a_stream_of_distinct_tool_sets_cannot_grow_the_cache():
    cache = CallCache(WORDS, CLASSES, max_entries=8, max_bytes=1 << 20)
    for n in range(1, 41):
        cache.calls_for([tool(n=n)], None, True)
        assert len(cache._cache) <= 8 and cache._cache.nbytes <= 1 << 20
    assert cache.compiles == 40 and cache.stats()["evictions"] == 32
    small = CallCache(WORDS, CLASSES, max_entries=8, max_bytes=4096)
    for n in range(1, 41):
        small.calls_for([tool(n=n)], None, True)
        assert small._cache.nbytes <= 4096
    assert len(small._cache) < 8


# ---- the bound on one request's automaton --------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "what"),
    [
        (dict(states=60), "states"),
        (dict(allowed=2), "ids allowed by name in one state"),
        (dict(edges=100), "edges"),
    ],
)
def test_an_automaton_beyond_a_limit_is_refused_naming_it(limits, limit, what):
    limits(**limit)
    spec = call_spec_for(WORDS, [tool(n=6)])
    with pytest.raises(CallsTooLarge) as err:
        call_automaton.compile_calls(spec, CLASSES)
    value = next(iter(limit.values()))
    assert f"needs {what}" in str(err.value) and f"limit of {value:,} per request" in str(err.value)
    result, _ = CallCache(WORDS, CLASSES).calls_for([tool(n=6)], None, True)
    assert isinstance(result, CallsTooLarge)


def test_the_state_bound_stops_the_build_early(limits, monkeypatch):
    limits(states=100)
    made = []
    new = call_automaton.CallAutomaton._new

    def counting(self):
        made.append(1)
        return new(self)

    monkeypatch.setattr(call_automaton.CallAutomaton, "_new", counting)
    with pytest.raises(CallsTooLarge):
        call_automaton.compile_calls(call_spec_for(WORDS, [tool(n=400)]), CLASSES)
    assert len(made) <= 100


@pytest.mark.parametrize("required", [False, True])
def test_optional_keys_cost_states_linear_in_the_properties(required):
    """Each position's window of keys shares the next one's trie: no quadratic growth."""
    sizes = {}
    for n in (50, 100, 200):
        names = keys(n) if required else ()
        spec = call_spec_for(WORDS, [tool(n=n, required=names)])
        sizes[n] = call_automaton.compile_calls(spec, CLASSES).num_states
    assert sizes[200] - sizes[100] <= 1.1 * 2 * (sizes[100] - sizes[50]), sizes


def test_nested_objects_with_optional_keys_stay_linear():
    def nested(n):
        inner = {"type": "object", "properties": {k: {"type": "integer"} for k in keys(n)}}
        return {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": inner}}}}  # fmt: skip

    sizes = [call_automaton.compile_calls(call_spec_for(WORDS, [nested(n)]), CLASSES).num_states
             for n in (50, 100, 200)]  # fmt: skip
    assert sizes[2] - sizes[1] <= 1.1 * 2 * (sizes[1] - sizes[0]), sizes


# ---- the wire ------------------------------------------------------------------------------


def test_the_wire_round_trips_and_ties_to_its_vocabulary():
    table = call_automaton.compile_calls(
        call_spec_for(WORDS, [tool(n=4, required=["x0"])]), CLASSES
    )
    back = CallTable.from_wire(table.to_wire(), CLASSES)
    assert back.digest == table.digest and back.num_states == table.num_states
    for state in range(table.num_states):
        assert back.edges(state) == table.edges(state)
        assert back.classes(state) == table.classes(state)
    other = classes_for_tokenizer(WORDS, len(WORDS) + 5)  # the same tokenizer, wider logits
    assert other.fingerprint == CLASSES.fingerprint
    CallTable.from_wire(table.to_wire(), other)
    changed = copy.copy(CLASSES)
    object.__setattr__(changed, "fingerprint", "0" * 32)
    with pytest.raises(ValueError, match="must load the same tokenizer"):
        CallTable.from_wire(table.to_wire(), changed)


def _rewire(wire, **arrays):
    """The wire with some arrays replaced (re-encoded as the wire encodes them)."""
    import base64
    import zlib

    raw = zlib.decompress(base64.b64decode(wire["data"]))
    flat = np.frombuffer(raw, dtype="<i4").copy()
    sizes = [wire["states"] + 1, wire["edges"], wire["edges"], wire["states"] + 1]
    sizes += [wire["class_edges"], wire["class_edges"]]
    parts = dict(zip(call_table._ARRAYS, np.split(flat, np.cumsum(sizes)[:-1]), strict=True))
    for name, change in arrays.items():
        parts[name] = change(parts[name].copy())
    data = b"".join(parts[n].astype("<i4").tobytes() for n in call_table._ARRAYS)
    return {**wire, "data": base64.b64encode(zlib.compress(data)).decode()}


def _set(index, value):
    def change(a):
        a[index] = value
        return a

    return change


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda w: {**w, "v": 2}, "version 2"),
        (lambda w: {**w, "data": "not base64!"}, "does not decode"),
        (lambda w: {**w, "edges": w["edges"] + 1}, "holds"),
        (lambda w: _rewire(w, edge_dst=_set(0, 10**6)), "edge_dst outside"),
        (lambda w: _rewire(w, edge_tok=_set(0, -3)), "non-negative"),
        (lambda w: _rewire(w, edge_ptr=_set(1, 10**6)), "offsets"),
        (lambda w: _rewire(w, class_cls=_set(0, 1)), "not SPECIAL"),
        (lambda w: _rewire(w, class_cls=_set(-1, CLASSES.num_classes)), "uses token class"),
        (lambda w: {k: v for k, v in w.items() if k != "classes"}, "exactly the keys"),
    ],
)
def test_a_damaged_wire_is_refused(damage, message):
    table = call_automaton.compile_calls(call_spec_for(WORDS, [tool(n=3)]), CLASSES)
    with pytest.raises(ValueError, match=message):
        CallTable.from_wire(damage(table.to_wire()), CLASSES)


def test_the_engine_path_refuses_a_forged_class():
    """A client's `vllm_xargs` reaches `request_channel` without `from_wire`."""
    table = call_automaton.compile_calls(call_spec_for(WORDS, [tool(n=3)]), CLASSES)
    forged = _rewire(table.to_wire(), class_cls=_set(-1, CLASSES.num_classes + 7))
    extra = channel_extra_args(REQUIRED, forged)
    with pytest.raises(ValueError, match=f"class {CLASSES.num_classes + 7}; this vocabulary"):
        request_channel(Params(extra), lambda: CLASSES)


def test_a_wire_beyond_the_limits_is_refused_before_it_reaches_the_engine(limits):
    table = call_automaton.compile_calls(call_spec_for(WORDS, [tool(n=6)]), CLASSES)
    limits(states=table.num_states - 1)
    extra = channel_extra_args(REQUIRED, table.to_wire())
    with pytest.raises(ValueError, match="beyond the channel's limit"):
        request_channel(Params(extra), lambda: CLASSES)


# ---- the engine: no compile, each channel laid out once, appended -------------------------


def test_the_engine_path_compiles_nothing(monkeypatch):
    table = call_automaton.compile_calls(call_spec_for(WORDS, [tool(n=5)]), CLASSES)
    extra = channel_extra_args(REQUIRED, table.to_wire())

    def refuse(*args, **kwargs):
        raise AssertionError("the engine compiled a call automaton")

    monkeypatch.setattr(call_automaton.CallAutomaton, "__init__", refuse)
    channel = request_channel(Params(extra, stop=[7]), lambda: CLASSES)
    assert channel.calls.digest == table.digest and 7 in channel.end_ids
    core = ChannelCore(4, "cpu")
    core.assign(0, channel, START, 0)
    core.flush()
    assert core.laid_out == 1


def channels(count):
    out = []
    for n in range(1, count + 1):
        table = call_automaton.compile_calls(call_spec_for(WORDS, [tool(n=n)]), CLASSES)
        out.append(
            REQUIRED.with_calls(table) if n % 2 else REQUIRED.with_calls(table).as_optional()
        )
    return out


def test_a_new_channel_appends_its_rows_and_leaves_the_others(monkeypatch):
    built = []
    block = channel_tables.channel_block
    monkeypatch.setattr(channel_tables, "channel_block", lambda c: built.append(c) or block(c))
    chans = [REQUIRED, *channels(5), REQUIRED.extended([4, 5])]
    shared = SharedTables("cpu")
    for i, channel in enumerate(chans):
        before = shared.tables() if i else None
        shared.add(channel)
        after = shared.tables()
        if before is not None:  # what was there is still there, unchanged
            for name in ("forced", "other", "edge_off", "edge_len", "class_off", "class_bits"):
                old = getattr(before, name)
                assert torch.equal(getattr(after, name)[: len(old)], old), name
            for name in ("edge_tok", "edge_dst", "class_cls", "class_dst"):
                old = getattr(before, name)
                if len(old) > 1:
                    assert torch.equal(getattr(after, name)[: len(old)], old), name
    assert built == chans and shared.laid_out == len(chans)
    # The same tables as laying them all out at once, and each state steps as its machine.
    whole = compile_channels(chans, "cpu")
    tables = shared.tables()
    for name in ("forced", "other", "edge_tok", "edge_dst", "class_cls", "class_dst"):
        assert torch.equal(getattr(tables, name), getattr(whole, name)), name
    tokens = torch.arange(len(WORDS) + 2, dtype=torch.int32)
    for c, channel in enumerate(chans):
        for s in range(channel.num_states):
            states = torch.full_like(tokens, tables.bases[c] + s)
            want = [channel.step(s, t) for t in tokens.tolist()]
            got = next_states(tables, states, tokens).tolist()
            assert got == [w if w < 0 else tables.bases[c] + w for w in want]


def test_the_core_lays_out_each_channel_once_through_flushes_and_drops(monkeypatch):
    built = []
    block = channel_tables.channel_block
    monkeypatch.setattr(channel_tables, "channel_block", lambda c: built.append(c) or block(c))
    chans = channels(MAX_IDLE_CHANNELS + 4)
    core = ChannelCore(2, "cpu")
    for step, channel in enumerate(chans + chans[-3:]):
        core.assign(step % 2, channel, START, 0)
        core.flush()  # idle channels beyond the limit are dropped here, their blocks reused
    assert len(built) == len(chans)
    assert core.num_channels <= MAX_IDLE_CHANNELS + 2
