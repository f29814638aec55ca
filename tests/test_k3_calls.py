"""The call automaton: generated schemas and adversarial logits give schema-valid calls.

A channel `with_calls` is walked from `Sure<|close|>response<|sep|>` by sampling the
argmax of adversarial logits (end ids, control tokens and free text boosted) among the
ids the state machine allows. Every finished turn must parse into calls of the
request's tools whose arguments validate against their schemas (jsonschema), one call
when parallel calls are off. The torch reference and the interpreted Triton kernel
must mask exactly the ids the state machine forbids, and step states as it does.
"""

from __future__ import annotations

import functools

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from k3_words import PIECES, Words, ids

from atom_plugin.k3.call_automaton import (
    CallAutomaton,
    CallSpec,
    CallSpecError,
    JsonSpec,
)
from atom_plugin.k3.channel_for import (
    channel_extra_args,
    channel_from_extra_args,
    required_channel_for,
)
from atom_plugin.k3.channel_kernel import (
    advance_states,
    apply_channel_torch,
    apply_channel_triton,
)
from atom_plugin.k3.channel_tables import compile_channels, next_states
from atom_plugin.k3.required_channel import START, UNCONSTRAINED
from atom_plugin.k3.schema import UnsupportedSchema, call_spec_for
from atom_plugin.k3.token_classes import classes_for_tokenizer
from atom_plugin.k3.tool_parser import parse_k3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORDS = Words()
CLASSES = classes_for_tokenizer(WORDS)
REQUIRED = required_channel_for(WORDS)
VOCAB = len(PIECES) + 3  # logits wider than the tokenizer: the extra ids are never allowed
PROMPT_END = ids("Sure", "<|close|>", "response", "<|sep|>")
AUTO_PREFIX = PROMPT_END + ids("<|open|>", "tools", "<|sep|>")  # the model opens the channel
KEYS = ["a", "b", "c", "city", "count"]

scalar = st.one_of(
    st.just({"type": "string"}),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["x", "y", "xy", "Paris", 'x"y', "a&b"]), min_size=1, max_size=3).map(
        lambda v: {"type": "string", "enum": v}
    ),
    st.lists(st.sampled_from([0, 1, -1, 12, 7]), min_size=1, max_size=3).map(
        lambda v: {"type": "integer", "enum": v}
    ),
    st.sampled_from([{"const": "x"}, {"enum": [True]}, {"type": "number", "enum": [1.5, 2]}]),
)


@st.composite
def objects(draw, values, max_keys=3):
    keys = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=max_keys))
    schema = {"type": "object", "properties": {k: draw(values) for k in keys}}
    required = draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
    if required:
        schema["required"] = required
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


# Property values: scalars, and objects and arrays of them (nested, written as JSON).
values = st.recursive(
    scalar,
    lambda inner: st.one_of(
        inner.map(lambda items: {"type": "array", "items": items}), objects(inner)
    ),
    max_leaves=4,
)


def schemas():
    """A tool's parameters: an object of up to four properties of any kind of value."""
    return objects(values, max_keys=4)


@st.composite
def requests(draw):
    names = draw(
        st.lists(
            st.sampled_from(["f", "g", "get_weather", "x1"]), min_size=1, max_size=3, unique=True
        )
    )
    tools = [
        {"type": "function", "function": {"name": n, "parameters": draw(schemas())}} for n in names
    ]
    return tools, draw(st.booleans())


def walk(channel, seed: int, max_steps: int = 200, prefix=PROMPT_END):
    """Sample the argmax of adversarial logits among the allowed ids after `prefix`; the ids
    and the states from the end of `prefix` on."""
    rng = np.random.default_rng(seed)
    out, state, states = list(prefix), channel.walk(prefix), []
    boost = ids("<|end_of_msg|>", "<|close|>", "<|open|>", "<|sep|>", '"', "Paris", "Pa\nris")
    boost += ids('"}', "\\", "]", "}", ", ")
    for _ in range(max_steps):
        if state == UNCONSTRAINED:
            break
        states.append(state)
        logits = rng.normal(size=VOCAB)
        logits[rng.choice(boost)] += 3.0
        allowed = allowed_ids(channel, state)
        token = max(allowed, key=lambda t: logits[t])
        out.append(token)
        state = channel.step(state, token)
    return out, state, states


def allowed_ids(channel, state):
    """The state machine's allowed ids below VOCAB (the reference for the kernel)."""
    forced = channel.forced_token(state)
    if forced is not None:
        return [forced]
    call = channel.call_state(state)
    if call is None:
        return [t for t in range(VOCAB) if t not in channel.banned_tokens(state)]
    return [t for t in channel.calls.allowed_ids(call, VOCAB) if t not in channel.end_ids]


def channel_for(tools, parallel, name=None):
    spec = call_spec_for(WORDS, tools, name=name, parallel=parallel)
    assert CallSpec.from_json(spec.to_json()) == spec
    return REQUIRED.with_calls(CallAutomaton(spec, CLASSES))


def check_turn(tools, parallel, out):
    parsed = parse_k3(WORDS.decode(out))
    assert parsed.content == "Sure", WORDS.decode(out)
    assert parsed.tool_calls, WORDS.decode(out)
    if not parallel:
        assert len(parsed.tool_calls) == 1
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in parsed.tool_calls:
        assert call.name in by_name
        jsonschema.validate(call.arguments, by_name[call.name])


@settings(max_examples=60, deadline=None)
@given(requests(), st.integers(0, 2**32 - 1))
def test_every_finished_call_validates_against_its_schema(request, seed):
    tools, parallel = request
    channel = channel_for(tools, parallel)
    out, state, _ = walk(channel, seed, max_steps=400)
    if state == UNCONSTRAINED:  # finished: <|end_of_msg|> written
        check_turn(tools, parallel, out)


@settings(max_examples=40, deadline=None)
@given(requests(), st.integers(0, 2**32 - 1))
def test_auto_constrains_the_calls_once_the_model_opens_the_tools_channel(request, seed):
    tools, parallel = request
    required = channel_for(tools, parallel)
    channel = required.as_optional()
    assert channel_from_extra_args(channel_extra_args(channel, required.calls), CLASSES) == (
        channel
    )
    # No trigger and nothing banned: the model may answer and end without a call.
    answer = [*PROMPT_END, *ids("<|close|>", "message", "<|sep|>", "<|end_of_msg|>")]
    state = START
    for token in answer:
        assert allowed_ids(channel, state) == list(range(VOCAB))
        state = channel.step(state, token)
    assert (
        channel.is_waiting(state)
        and required.forced_token(required.walk(PROMPT_END)) == ids("<|open|>")[0]
    )
    # Once the model writes <|open|>tools<|sep|>, the call opening is forced and every call
    # is held to the schemas, as with required.
    state = channel.walk(AUTO_PREFIX)
    assert channel.forced_token(state) == ids("<|open|>")[0]
    out, state, _ = walk(channel, seed, max_steps=400, prefix=AUTO_PREFIX)
    if state == UNCONSTRAINED:
        check_turn(tools, parallel, out)


def test_a_disallowed_key_a_wrong_type_and_a_missing_key_cannot_be_written():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "count": {"type": "integer"}},
                    "required": ["city", "count"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    channel = channel_for(tools, parallel=False)
    state = channel.walk([*PROMPT_END, *ids("<|open|>", "tools", "<|sep|>", "<|open|>", "call")])
    state = channel.walk(ids(' tool="', "get_weather", '" index="', "0", '"', "<|sep|>"), state)
    # The call cannot close before its required keys, nor name another key.
    assert ids("<|close|>")[0] not in allowed_ids(channel, state)
    state = channel.step(state, ids("<|open|>")[0])
    assert allowed_ids(channel, state) == ids("argument")
    state = channel.walk(ids("argument", ' key="'), state)
    assert allowed_ids(channel, state) == ids("city")  # "count" comes after "city"
    state = channel.walk(ids("city", '" type="', "string", '"', "<|sep|>", "Paris"), state)
    state = channel.walk(ids("<|close|>", "argument", "<|sep|>", "<|open|>", "argument"), state)
    state = channel.walk(ids(' key="', "count", '" type="', "number", '"', "<|sep|>"), state)
    # An integer: no text, no fraction, no closing before a digit.
    allowed = allowed_ids(channel, state)
    assert ids("Paris")[0] not in allowed and ids("<|close|>")[0] not in allowed
    assert ids("12")[0] in allowed and ids("-")[0] in allowed and ids("1.")[0] not in allowed
    state = channel.walk(ids("12", "<|close|>", "argument", "<|sep|>"), state)
    state = channel.walk(ids("<|close|>", "call", "<|sep|>"), state)
    # parallel_tool_calls=false: the tools channel closes after one call.
    assert channel.forced_token(state) == ids("<|close|>")[0]


def test_nested_objects_and_arrays_are_written_as_their_schema_says():
    inner = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "b": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": inner}, "required": ["a"]},
            },
        }
    ]
    channel = channel_for(tools, parallel=False)

    def write(state, *texts):
        """Each text encoded on its own (the automaton's pieces), every id allowed."""
        for text in texts:
            for token in WORDS.encode(text):
                assert token in allowed_ids(channel, state), (text, WORDS.decode([token]))
                state = channel.step(state, token)
                out.append(token)
        return state

    out = [*PROMPT_END, *ids("<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="')]
    state = write(channel.walk(out), "f", '" index="', "0", '"', "<|sep|>", "<|open|>")
    state = write(state, 'argument key="a" type="object"', "<|sep|>")
    assert channel.forced_token(state) == ids("{")[0]
    state = write(state, "{")
    assert ids("}")[0] not in allowed_ids(channel, state)  # "city" is required
    state = write(state, '"city": ', '"')
    # A JSON string: text and digits, no quote inside a token, no backslash, no newline.
    allowed = allowed_ids(channel, state)
    assert {*ids("Paris", "12", " ", '"')} <= set(allowed)
    assert not {*ids("Pa\nris", "\\", '"}', '", "', "<|close|>")} & set(allowed)
    state = write(state, "Paris", '"')
    assert set(allowed_ids(channel, state)) == {*ids(", ", "}")}
    state = write(state, ', "b": ', "[")
    allowed = allowed_ids(channel, state)
    assert {*ids("]", "12", "-")} <= set(allowed) and not {*ids("1.", "Paris")} & set(allowed)
    state = write(state, "12")
    assert {*ids(", ", "]", "0")} <= set(allowed_ids(channel, state))
    assert ids("}")[0] not in allowed_ids(channel, state)
    state = write(state, ", ", "-", "7", "]")
    assert allowed_ids(channel, state) == ids("}")  # no key after "b", none outside properties
    state = write(state, "}")
    assert channel.forced_token(state) == ids("<|close|>")[0]
    state = write(state, "<|close|>", "argument", "<|sep|>", "<|close|>", "call", "<|sep|>")
    state = write(state, "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>")
    assert write(state, "<|end_of_msg|>") == UNCONSTRAINED
    check_turn(tools, False, out)
    assert parse_k3(WORDS.decode(out)).tool_calls[0].arguments == {
        "a": {"city": "Paris", "b": [12, -7]}
    }


def test_unsupported_schemas_are_refused_with_the_construct():
    def prop(schema):
        return {"type": "object", "properties": {"a": schema}}

    cases = [
        (prop({"type": "array"}), "property 'a': an array without an items schema"),
        (prop({"type": "array", "items": {"type": "string"}, "minItems": 1}), "minItems"),
        (prop(prop({"type": "integer", "minimum": 0})), "property 'a' key 'a': .*minimum"),
        (prop({"type": "array", "items": {"type": ["string", "null"]}}), "items: type"),
        (prop(prop({"anyOf": []})), "anyOf"),
        (prop({"type": "object", "properties": {"<|open|>": {"type": "null"}}}), "K3 marker"),
        (
            prop(
                functools.reduce(
                    lambda inner, _: {"type": "array", "items": inner}, range(17), {"type": "null"}
                )
            ),
            "nested deeper than 16",
        ),  # fmt: skip
        ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, "maxLength"),
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf"),
        ({"type": "object", "required": ["a"]}, "not properties"),
        ({"type": "object", "patternProperties": {}}, "patternProperties"),
    ]
    for schema, what in cases:
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        with pytest.raises(UnsupportedSchema, match=what):
            call_spec_for(WORDS, tools)
    # A spec that arrives in extra_args nested without end is refused, not recursed into.
    deep = {"kind": "integer"}
    for _ in range(40):
        deep = {"kind": "array", "open": [1], "close": [2], "sep": [3], "items": deep}
    with pytest.raises(CallSpecError, match="nests deeper than 16"):
        JsonSpec.from_json(deep)


@settings(max_examples=8, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=2), st.integers(0, 2**32 - 1))
def test_kernel_and_reference_agree_with_the_state_machine(batch, seed):
    # Channels with calls beside the plain required channel, in one table.
    # Optional (auto) channels too, walked from the head the model wrote itself.
    channels = [channel_for(tools, parallel) for tools, parallel in batch]
    channels += [c.as_optional() for c in channels]
    channels = list(dict.fromkeys([REQUIRED, *channels]))
    tables = compile_channels(channels, DEVICE)
    rows, want, tokens, after = [], [], [], []
    for index, channel in enumerate(channels):
        base = tables.bases[index]
        prefix = AUTO_PREFIX if channel.optional else PROMPT_END
        out, _, states = walk(channel, seed + index, max_steps=60, prefix=prefix)
        steps = list(zip(states, out[len(prefix) :], strict=False))
        if channel.optional:  # waiting rows (banning nothing) while the model writes the head
            written, start = prefix[len(PROMPT_END) :], channel.walk(PROMPT_END)
            steps[:0] = [(channel.walk(written[:k], start), t) for k, t in enumerate(written)]
        for state, token in steps[:12]:
            rows.append(base + state)
            want.append(allowed_ids(channel, state))
            tokens.append(token)
            nxt = channel.step(state, token)
            after.append(UNCONSTRAINED if nxt == UNCONSTRAINED else base + nxt)
    states = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    logits = torch.randn(len(rows), VOCAB, device=DEVICE)
    torch_out, triton_out = logits.clone(), logits.clone()
    apply_channel_torch(torch_out, tables, states)
    apply_channel_triton(triton_out, tables, states, block=32, programs=4)
    assert torch.equal(torch_out, triton_out)
    for r, allowed in enumerate(want):
        finite = torch.isfinite(torch_out[r]).nonzero().flatten().tolist()
        assert finite == allowed, (r, rows[r])
    token_t = torch.tensor(tokens, dtype=torch.int32, device=DEVICE)
    assert next_states(tables, states, token_t).tolist() == after
    # The device advance (interpreted Triton) steps the same way.
    scanned = torch.zeros_like(states)
    advanced = states.clone()
    advance_states(
        tables, advanced, scanned, token_t.view(-1, 1), torch.ones_like(states),
        torch.arange(len(rows), dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    assert advanced.tolist() == after
