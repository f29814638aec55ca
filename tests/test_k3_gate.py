"""Who gets the required channel: requests made the way vLLM's chat server makes them
(`k3_requests`), for every tool-call format, and what the K3 parser attaches in each
case. The V1 logits processor's side: test_k3_gate_v1.py."""

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models.scripted_gpt2 import build_tokenizer, ids

from atom_plugin.k3.channel_for import (
    EXTRA_ARGS_KEY,
    K3_FORMATS,
    ToolChoiceError,
    channel_extra_args,
    channel_for_choice,
    channel_from_extra_args,
    named_tool,
    required_channel_for,
    tool_names,
    wants_channel,
)
from atom_plugin.k3.required_channel import UNCONSTRAINED
from atom_plugin.k3.token_classes import classes_for_tokenizer

vllm = pytest.importorskip("vllm")

from k3_requests import (  # noqa: E402
    NAMED,
    TOOLS,
    build_requests_by_format,
    calls_channel,
    registered_formats,
    sampling_params_through,
)
from openai.types.responses import ToolChoiceFunction  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
)
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.parser.parser_manager import ParserManager  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

# The parser serves the channel only where the platform recorded it live for the engine.
pytestmark = pytest.mark.usefixtures("k3_channel_live")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("k3tok"))


@pytest.fixture(scope="module")
def formats():
    return registered_formats()


@pytest.fixture(scope="module")
def requests_by_format(formats, tokenizer):
    """(format, tool_choice) -> SamplingParams, for every format that builds here."""
    return build_requests_by_format(formats, tokenizer)


def test_channel_ids_for_the_scripted_tokenizer(tokenizer):
    channel = required_channel_for(tokenizer)
    assert channel.after == tuple(ids(tokenizer, "<|close|>", "response", "<|sep|>"))
    assert channel.opening == tuple(
        ids(tokenizer, "<|open|>", "tools", "<|sep|>", "<|open|>", "call", ' tool="')
    )
    assert channel.opens_at == 3
    assert channel.end_ids == {tokenizer.eos_token_id}


class PieceTokenizer:
    """A greedy longest-match tokenizer over a given vocabulary (not vLLM's)."""

    def __init__(self, vocab, eos=None):
        self.vocab = {piece: i for i, piece in enumerate(vocab)}
        self.eos_token_id = eos

    def encode(self, text, add_special_tokens=False):
        out = []
        while text:
            piece = max((p for p in self.vocab if text.startswith(p)), key=len)
            out.append(self.vocab[piece])
            text = text[len(piece) :]
        return out


BASE = [
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "response",
    "tools",
    "call",
    ' tool="',
]


def test_control_token_split_warns_once_and_disables(caplog):
    split = PieceTokenizer([p for p in BASE if p != "<|sep|>"] + ["<|", "sep", "|>"])
    with caplog.at_level(logging.WARNING, logger="atom_plugin.k3"):
        assert required_channel_for(split) is None
        assert required_channel_for(split) is None
    warnings = [r for r in caplog.records if "'<|sep|>' encodes to 3 ids" in r.getMessage()]
    assert len(warnings) == 1


def test_head_that_encodes_differently_in_context_disables(caplog):
    merged = PieceTokenizer(BASE + ["<|open|>tools"])
    with caplog.at_level(logging.WARNING, logger="atom_plugin.k3"):
        assert required_channel_for(merged) is None
    assert any("opening's head" in r.getMessage() for r in caplog.records)
    assert required_channel_for(PieceTokenizer(BASE, eos=3)) is not None


def test_extra_args_round_trip_and_bad_values(tokenizer):
    channel = required_channel_for(tokenizer)
    assert channel_from_extra_args(channel_extra_args(channel)) == channel
    assert channel_from_extra_args(None) is None
    assert channel_from_extra_args({"other": 1}) is None
    with pytest.raises(ValueError, match="atom_required_channel.*expected exactly the keys"):
        channel_from_extra_args({EXTRA_ARGS_KEY: '{"after": [1]}'})
    with pytest.raises(ValueError, match="atom_required_channel.*'not json'"):
        channel_from_extra_args({EXTRA_ARGS_KEY: "not json"})
    with pytest.raises(ValueError, match="end ids"):
        bad = '{"after":[1,2],"opening":[3,4],"opens_at":1,"end_ids":[2]}'
        channel_from_extra_args({EXTRA_ARGS_KEY: bad})


NAMED_SHAPES = {
    "chat dict": NAMED,
    "responses dict": {"type": "function", "name": "get_weather"},
    "chat object": ChatCompletionNamedToolChoiceParam(function={"name": "get_weather"}),
    "responses object": ToolChoiceFunction(type="function", name="get_weather"),
}
NOT_NAMED = {
    "custom tool": {"type": "custom", "name": "get_weather"},
    "allowed tools": {"type": "allowed_tools", "mode": "required", "tools": []},
    "no name": {"type": "function", "function": {}},
}


@settings(max_examples=300, deadline=None)
@given(
    choice=st.sampled_from(["required", "auto", "none", None, *NAMED_SHAPES, *NOT_NAMED]),
    has_tools=st.sampled_from([None, [], TOOLS]),
    data=st.data(),
)
def test_gate_only_required_or_named_with_tools_in_k3_format(formats, choice, has_tools, data):
    fmt = data.draw(st.sampled_from(formats))
    tool_choice = NAMED_SHAPES.get(choice, NOT_NAMED.get(choice, choice))
    forces = choice == "required" or choice in NAMED_SHAPES
    expected = forces and bool(has_tools) and fmt in ("kimi_k3", "atom_kimi_k3")
    assert wants_channel(tool_choice, has_tools, fmt) == expected
    assert fmt in K3_FORMATS or not wants_channel("required", TOOLS, fmt)
    if choice in NAMED_SHAPES:
        assert named_tool(tool_choice) == "get_weather"
    elif choice in NOT_NAMED:
        assert named_tool(tool_choice) is None


# Names from the scripted vocabulary: one id or several, sharing prefixes, and ids that
# are the channel's own (`tools`, `response`, `call`, the quote).
NAME_PIECES = ["get_weather", "city", "Paris", "tools", "response", "call", "0", "1"]


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(NAME_PIECES), min_size=1, max_size=5), extra=st.data())
def test_named_channel_forces_the_name_as_the_encoder_writes_it(tokenizer, pieces, extra):
    channel = required_channel_for(tokenizer)
    name = "".join(pieces)
    longer = name + "".join(extra.draw(st.lists(st.sampled_from(NAME_PIECES), min_size=1)))
    tools = [{"type": "function", "function": {"name": n}} for n in ("other", name, longer)]
    choice = {"type": "function", "function": {"name": name}}
    named = channel_for_choice(channel, tokenizer, choice, tools)
    # The name is escaped as an attribute value and encoded as its own piece, then the quote.
    escaped = name.replace("&", "&amp;").replace('"', "&quot;")
    tail = tokenizer.encode(escaped, add_special_tokens=False) + ids(tokenizer, '"')
    assert named == channel.extended(tail)
    assert named.opening[: len(channel.opening)] == channel.opening
    # Forced from the trigger to the closing quote; then the model writes the rest.
    state = named.walk(ids(tokenizer, "Sure", "<|close|>", "response", "<|sep|>"))
    forced = []
    while state != UNCONSTRAINED:
        forced.append(named.forced_token(state))
        state = named.step(state, forced[-1])
    assert tokenizer.decode(forced) == '<|open|>tools<|sep|><|open|>call tool="' + escaped + '"'
    other = channel_for_choice(channel, tokenizer, {**choice, "function": {"name": longer}}, tools)
    assert other != named and other.opening[: len(named.opening) - 1] == named.opening[:-1]
    assert channel_for_choice(channel, tokenizer, "required", tools) == channel
    assert channel_from_extra_args(channel_extra_args(named)) == named


def test_named_attribute_is_escaped_as_k3_writes_it():
    pieces = PieceTokenizer([*BASE, "a", "&quot;", "&amp;", '"'], eos=3)
    channel = required_channel_for(pieces)
    name = 'a"&a'
    tools = [{"type": "function", "function": {"name": name}}]
    named = channel_for_choice(
        channel, pieces, {"type": "function", "function": tools[0]["function"]}, tools
    )
    assert named.opening[len(channel.opening) :] == tuple(pieces.encode("a&quot;&amp;a") + [11])


def test_unknown_or_unforceable_names_are_refused_with_the_name_and_the_tools(tokenizer):
    channel = required_channel_for(tokenizer)
    two = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    with pytest.raises(
        ToolChoiceError,
        match=r"'get_city', which is not one of the request's tools: 'get_weather', 'get_time'",
    ):
        channel_for_choice(channel, tokenizer, {**NAMED, "function": {"name": "get_city"}}, two)
    bad = {"type": "function", "function": {"name": "a<|sep|>b"}}
    with pytest.raises(ToolChoiceError, match=r"'a<\|sep\|>b'.*control token.*<\|sep\|>"):
        channel_for_choice(
            channel, tokenizer, bad, [{"type": "function", "function": bad["function"]}]
        )


def test_only_atom_kimi_k3_attaches_the_channel(requests_by_format, tokenizer):
    with_channel = {
        key
        for key, params in requests_by_format.items()
        if EXTRA_ARGS_KEY in (params.extra_args or {})
    }
    want_keys = {("atom_kimi_k3", "required"), ("atom_kimi_k3", "named"), ("atom_kimi_k3", "auto")}
    assert with_channel == want_keys
    classes = classes_for_tokenizer(tokenizer)
    for choice, want in (
        ("required", calls_channel(tokenizer)),
        ("named", calls_channel(tokenizer, name="get_weather")),
        ("auto", calls_channel(tokenizer).as_optional()),  # constrained once the model opens it
    ):
        params = requests_by_format["atom_kimi_k3", choice]
        assert params.structured_outputs is None  # the channel replaces vLLM's structural tag
        assert channel_from_extra_args(params.extra_args, classes) == want
        assert params.skip_special_tokens is False
        assert params.spaces_between_special_tokens is False
    # vLLM's own kimi_k3 forces a named call with its structural tag.
    assert requests_by_format["kimi_k3", "named"].structured_outputs.structural_tag is not None


def test_unknown_name_is_vllms_400_naming_it_and_the_tools(tokenizer, formats):
    parser_cls = ParserManager.get_parser(tool_parser_name="atom_kimi_k3", enable_auto_tools=True)
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], model="m", tools=TOOLS, tool_choice=NAMED
    )
    # vLLM's request validator refuses such a name already; a request built another way
    # (or a future API) must meet the same refusal, never pass unconstrained.
    request.tool_choice = ChatCompletionNamedToolChoiceParam(function={"name": "get_time"})
    with pytest.raises(
        VLLMValidationError, match=r"'get_time', which is not one of .*'get_weather'"
    ) as err:
        parser_cls(tokenizer, TOOLS).adjust_request(request)
    assert err.value.parameter == "tool_choice" and err.value.value == "get_time"


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_structural_tag_setting_keeps_vllms_tag(tokenizer, monkeypatch, formats, choice):
    monkeypatch.setenv("ATOM_K3_STRUCTURAL_TAG", "1")
    params = sampling_params_through("atom_kimi_k3", tokenizer, choice)
    assert EXTRA_ARGS_KEY not in (params.extra_args or {})
    assert params.structured_outputs.structural_tag is not None
    monkeypatch.setenv("ATOM_K3_STRUCTURAL_TAG", "maybe")
    with pytest.raises(ValueError, match="ATOM_K3_STRUCTURAL_TAG='maybe'"):
        sampling_params_through("atom_kimi_k3", tokenizer, "required")


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_channel_off_in_the_engine_keeps_vllms_tag(tokenizer, formats, k3_channel_off, choice):
    params = sampling_params_through("atom_kimi_k3", tokenizer, choice)
    assert EXTRA_ARGS_KEY not in (params.extra_args or {})
    # The same tag vLLM's own kimi_k3 attaches.
    assert params.structured_outputs.structural_tag is not None
    assert (
        params.structured_outputs.structural_tag
        == sampling_params_through("kimi_k3", tokenizer, choice).structured_outputs.structural_tag
    )


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_channel_off_and_no_tag_is_a_400_naming_reason_and_fix(
    tokenizer, formats, k3_channel_off, monkeypatch, choice
):
    monkeypatch.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    with pytest.raises(VLLMValidationError) as err:
        sampling_params_through("atom_kimi_k3", tokenizer, choice)
    message = str(err.value)
    assert "cannot be enforced in this engine" in message
    assert "refuses custom logits processors with speculative decoding" in message
    assert "drop --speculative-config" in message
    assert "VLLM_ENFORCE_STRICT_TOOL_CALLING=1" in message
    assert err.value.parameter == "tool_choice"
    # auto is not a forced call: it is served as before.
    assert sampling_params_through("atom_kimi_k3", tokenizer, "auto").structured_outputs is None


def test_no_engine_config_in_the_process_means_the_channel_is_off(tokenizer, formats):
    from atom_plugin.vllm.k3 import enforcement as k3_enforcement

    before = k3_enforcement.record(k3_enforcement.NO_ENGINE)
    try:
        params = sampling_params_through("atom_kimi_k3", tokenizer, "required")
    finally:
        k3_enforcement.record(before)
    assert EXTRA_ARGS_KEY not in (params.extra_args or {})
    assert params.structured_outputs.structural_tag is not None


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": NAMED, "response_format": {"type": "json_object"}},
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
    ],
)
def test_own_structured_outputs_keep_the_tag(tokenizer, formats, extra):
    parser_cls = ParserManager.get_parser(tool_parser_name="atom_kimi_k3", enable_auto_tools=True)
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], model="m", tools=TOOLS, **extra
    )
    params = parser_cls(tokenizer, TOOLS).adjust_request(request).to_sampling_params(16, {})
    assert EXTRA_ARGS_KEY not in (params.extra_args or {})
    assert params.structured_outputs.structural_tag is not None


def test_tool_names_in_every_request_shape():
    tools = [
        *TOOLS,
        {"type": "function", "name": "flat"},  # Responses
        {"type": "custom", "name": "not_a_function"},
        {"type": "namespace", "name": "crm", "tools": [{"type": "function", "name": "find"}]},
    ]
    assert tool_names(tools) == ["get_weather", "flat", "crm__find"]
    assert tool_names(None) == []


def test_responses_named_choice_gets_the_named_channel(tokenizer, formats):
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    request = ResponsesRequest(
        input="hi", model="m", tools=tools, tool_choice={"type": "function", "name": "get_weather"}
    )
    parser_cls = ParserManager.get_parser(tool_parser_name="atom_kimi_k3", enable_auto_tools=True)
    params = parser_cls(tokenizer, request.tools).adjust_request(request).to_sampling_params(16, {})
    want = calls_channel(tokenizer, tools, name="get_weather")
    assert channel_from_extra_args(params.extra_args, classes_for_tokenizer(tokenizer)) == want
    assert params.structured_outputs is None and params.skip_special_tokens is False


UNSUPPORTED = [  # a type union: the call automaton cannot hold it
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"where": {"type": ["string", "null"]}},
            },
        },
    }
]


def through(tokenizer, tools, tool_choice, **fields):
    parser_cls = ParserManager.get_parser(tool_parser_name="atom_kimi_k3", enable_auto_tools=True)
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        model="m",
        tools=tools,
        tool_choice=tool_choice,
        **fields,
    )
    return parser_cls(tokenizer, tools).adjust_request(request).to_sampling_params(16, {})


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_parallel_tool_calls_false_sends_one_call(tokenizer, formats, choice):
    name = named_tool(choice)
    params = through(tokenizer, TOOLS, choice, parallel_tool_calls=False)
    want = calls_channel(tokenizer, name=name, parallel=False)
    assert channel_from_extra_args(params.extra_args, classes_for_tokenizer(tokenizer)) == want
    assert want != calls_channel(tokenizer, name=name, parallel=True)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_unsupported_schema_keeps_vllms_tag_and_logs_the_reason_once(
    tokenizer, formats, caplog, monkeypatch, choice
):
    from atom_plugin.vllm.k3 import tool_parser as kimi_k3_parser

    monkeypatch.setattr(kimi_k3_parser, "_logged", set())  # as in a fresh server
    with caplog.at_level(logging.WARNING, logger="atom_plugin.k3"):
        for _ in range(2):
            params = through(tokenizer, UNSUPPORTED, choice)
            assert EXTRA_ARGS_KEY not in (params.extra_args or {})
            assert params.structured_outputs.structural_tag is not None
    lines = [r.getMessage() for r in caplog.records if "cannot be enforced by" in r.getMessage()]
    assert len(lines) == 1 and "property 'where'" in lines[0], lines
    assert "keep vLLM's kimi_k3 structural tag" in lines[0]


def test_unsupported_schema_without_vllms_tag_is_a_400(tokenizer, formats, monkeypatch):
    monkeypatch.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    with pytest.raises(VLLMValidationError) as err:
        through(tokenizer, UNSUPPORTED, "required")
    message = str(err.value)
    assert "cannot enforce this request's tool schemas" in message
    assert "property 'where'" in message and "VLLM_ENFORCE_STRICT_TOOL_CALLING=1" in message
    assert err.value.parameter == "tool_choice"


def test_each_tool_set_is_compiled_once_in_the_api_server(tokenizer, formats):
    from atom_plugin.vllm.k3.tool_parser import call_cache_of

    cache = call_cache_of(tokenizer)
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "get_time"}}]
    before = cache.compiles
    first = through(tokenizer, tools, "required")
    for choice in ("required", "auto"):  # auto's optional channel carries the same calls
        again = through(tokenizer, tools, choice)
        assert (
            json.loads(again.extra_args[EXTRA_ARGS_KEY])["calls"]
            == json.loads(first.extra_args[EXTRA_ARGS_KEY])["calls"]
        )
    assert cache.compiles == before + 1


@pytest.mark.parametrize("strict", ["1", "0"])
def test_a_tool_set_beyond_the_limits_keeps_vllms_tag_or_is_a_400(
    tokenizer, formats, monkeypatch, caplog, strict
):
    from atom_plugin.k3 import call_table
    from atom_plugin.vllm.k3 import tool_parser as kimi_k3_parser

    monkeypatch.setattr(call_table, "LIMITS", call_table.CallLimits(states=8))
    monkeypatch.setattr(kimi_k3_parser, "_logged", set())
    monkeypatch.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", strict)
    properties = {"days": {"type": "integer"}, "city": {"type": "integer"}}
    parameters = {"type": "object", "properties": properties}  # no other test's tool set
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": parameters}}]
    if strict == "0":
        with pytest.raises(VLLMValidationError) as err:
            through(tokenizer, tools, "required")
        assert "beyond the channel's limit of 8 per request" in str(err.value)
        return
    with caplog.at_level(logging.WARNING, logger="atom_plugin.k3"):
        params = through(tokenizer, tools, "required")
    assert EXTRA_ARGS_KEY not in (params.extra_args or {})
    assert params.structured_outputs.structural_tag is not None
    assert any("beyond the channel's limit of 8" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


def test_request_channel_builds_token_classes_only_for_calls(tokenizer):
    from atom_plugin.k3.channel_for import request_channel

    channel = required_channel_for(tokenizer)
    asked = []

    def classes():
        asked.append(1)
        return classes_for_tokenizer(tokenizer)

    plain = SamplingParams(extra_args=channel_extra_args(channel))
    assert request_channel(plain, classes) == channel and not asked
    with_calls = SamplingParams(
        extra_args=channel_extra_args(channel, calls_channel(tokenizer).calls)
    )
    assert request_channel(with_calls, classes) == calls_channel(tokenizer)
    assert asked == [1]
    with pytest.raises(ValueError, match="carries calls, which need the vocabulary's token"):
        request_channel(with_calls)


def test_auto_gets_the_optional_channel_in_place_of_vllms_tag(tokenizer, formats):
    classes = classes_for_tokenizer(tokenizer)
    for parallel in (True, False):
        # parallel_tool_calls=false makes vLLM give auto its call-envelope tag: replaced too.
        params = through(tokenizer, TOOLS, "auto", parallel_tool_calls=parallel)
        assert params.structured_outputs is None
        want = calls_channel(tokenizer, parallel=parallel).as_optional()
        assert channel_from_extra_args(params.extra_args, classes) == want
        assert params.skip_special_tokens is False
    # Schemas the channel cannot hold: vLLM's own handling (its envelope tag here).
    params = through(tokenizer, UNSUPPORTED, "auto", parallel_tool_calls=False)
    assert EXTRA_ARGS_KEY not in (params.extra_args or {})
    assert params.structured_outputs.structural_tag is not None
    params = through(tokenizer, UNSUPPORTED, "auto")
    assert EXTRA_ARGS_KEY not in (params.extra_args or {}) and params.structured_outputs is None
