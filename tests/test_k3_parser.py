"""The pure-Python Kimi-K3 tool parser: whole texts, streams, and bad input."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_plugin.k3.grammar import (
    CLOSE,
    END_OF_MSG,
    OPEN,
    SEP,
    TagLexer,
    Text,
    escape_attr,
    unescape_attr,
)
from atom_plugin.k3.samples import END, call, tools
from atom_plugin.k3.samples import argument as arg
from atom_plugin.k3.tool_parser import K3StreamParser, K3ToolCall, parse_k3

TURN = (
    "Let me check."
    + f"{CLOSE}response{SEP}"
    + tools(
        call(
            "get_weather",
            0,
            arg("city", "string", 'Paris "centre" & <b>'),
            arg("days", "number", "3"),
            arg("metric", "boolean", "true"),
            arg("opts", "object", '{"a": [1, 2]}'),
            arg("none", "null", "null"),
            arg("list", "array", '["x"]'),
        ),
        call('a"b&c', 1),
    )
    + END
)


def stream(text, chunks):
    parser = K3StreamParser()
    content, reasoning, calls = "", "", []
    pos = 0
    for size in chunks:
        delta = parser.feed(text[pos : pos + size])
        pos += size
        content, reasoning = content + delta.content, reasoning + delta.reasoning
        calls += delta.tool_calls
    delta = parser.feed(text[pos:])
    last = parser.finish()
    return (
        content + delta.content + last.content,
        reasoning + delta.reasoning + last.reasoning,
        tuple(calls + delta.tool_calls + last.tool_calls),
    )


def whole(text):
    parsed = parse_k3(text)
    return parsed.content, parsed.reasoning, parsed.tool_calls


def test_full_turn_types_and_escapes():
    parsed = parse_k3(TURN)
    assert parsed.content == "Let me check."
    assert parsed.reasoning == ""
    assert parsed.tool_calls == (
        K3ToolCall(
            "get_weather",
            0,
            {
                "city": 'Paris "centre" & <b>',
                "days": 3,
                "metric": True,
                "opts": {"a": [1, 2]},
                "none": None,
                "list": ["x"],
            },
        ),
        K3ToolCall('a"b&c', 1, {}),
    )
    assert json.loads(parsed.tool_calls[0].arguments_json)["days"] == 3


def test_think_then_response_from_think_start():
    text = f"plan{CLOSE}think{SEP}{OPEN}response{SEP}Hi!{CLOSE}response{SEP}{END}"
    parsed = parse_k3(text, start="think")
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("plan", "Hi!", ())


def test_full_channels_from_top():
    text = f"{OPEN}think{SEP}r{CLOSE}think{SEP}{OPEN}response{SEP}c{CLOSE}response{SEP}" + tools(
        call("f", 0)
    )
    parsed = parse_k3(text, start="top")
    assert (parsed.reasoning, parsed.content) == ("r", "c")
    assert parsed.tool_calls == (K3ToolCall("f", 0, {}),)


def test_bad_start_names_choices():
    with pytest.raises(ValueError, match="'middle'.*response, think, top"):
        parse_k3("x", start="middle")


def test_bad_json_value_stays_raw_string():
    parsed = parse_k3(tools(call("f", 0, arg("n", "number", "three"))))
    assert parsed.tool_calls[0].arguments == {"n": "three"}


def test_string_value_keeps_markers_except_its_close():
    value = f"a {OPEN}x{SEP} b &amp;"
    parsed = parse_k3(tools(call("f", 0, arg("s", "string", value))))
    assert parsed.tool_calls[0].arguments == {"s": value}


@pytest.mark.parametrize(
    "broken",
    [
        f'{OPEN}call index="0"{SEP}{CLOSE}call{SEP}',  # no tool name
        f'{OPEN}call tool="f" junk{SEP}{CLOSE}call{SEP}',  # attributes do not parse
        f'{OPEN}call tool="f"{SEP}stray text{CLOSE}call{SEP}',  # text between arguments
        f'{OPEN}call tool="f"{SEP}{OPEN}argument type="string"{SEP}v{CLOSE}argument{SEP}'
        f"{CLOSE}call{SEP}",  # argument without a key
    ],
)
def test_malformed_call_is_content_verbatim(broken):
    parsed = parse_k3(f"{CLOSE}response{SEP}{OPEN}tools{SEP}{broken}{CLOSE}tools{SEP}")
    assert parsed.tool_calls == ()
    assert parsed.content == broken


def test_truncated_call_is_content_and_earlier_calls_survive():
    good = call("f", 0, arg("a", "number", "1"))
    cut = f'{OPEN}call tool="g" index="1"{SEP}{OPEN}argument key="x" type="string"{SEP}par'
    parsed = parse_k3(f"ok{CLOSE}response{SEP}{OPEN}tools{SEP}{good}{cut}")
    assert parsed.tool_calls == (K3ToolCall("f", 0, {"a": 1}),)
    assert parsed.content == "ok" + cut


def test_no_tools_is_all_content():
    assert whole(f"hello <|x{CLOSE}response{SEP}{END}") == ("hello <|x", "", ())


def test_text_outside_channels_is_content_whitespace_between_calls_is_not():
    text = f"{CLOSE}response{SEP}after" + tools(call("f", 0), "\n ", call("g", 1), "zz")
    parsed = parse_k3(text)
    assert parsed.content == "afterzz"
    assert [c.name for c in parsed.tool_calls] == ["f", "g"]


def test_attr_escaping_round_trip():
    for value in ['a"b', "a&b", "&quot;", "&amp;quot;", "plain"]:
        assert unescape_attr(escape_attr(value)) == value


def test_lexer_partial_control_token_is_held_back():
    lexer = TagLexer()
    assert lexer.feed("ab<|clo") == [Text("ab")]
    assert lexer.feed("se|>x") == []  # a close tag head is still open
    pieces = lexer.feed("y<|sep|>z")
    assert [getattr(p, "raw", None) for p in pieces] == [f"{CLOSE}xy{SEP}", None]
    assert lexer.finish() == []


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streaming_fixed_chunks_equals_whole(size):
    assert stream(TURN, [size] * (len(TURN) // size)) == whole(TURN)


def test_streaming_emits_response_text_before_the_turn_ends():
    parser = K3StreamParser()
    assert parser.feed("Let me").content == "Let me"
    assert parser.feed(f" check{CLOSE}resp").content == " check"
    delta = parser.feed(f"onse{SEP}" + tools(call("f", 0)))
    assert delta.content == "" and delta.tool_calls == [K3ToolCall("f", 0, {})]


PIECES = [
    OPEN,
    CLOSE,
    SEP,
    END_OF_MSG,
    "<|",
    "|>",
    "<",
    "tools",
    "call",
    "argument",
    "response",
    "think",
    "message",
    ' tool="f"',
    ' index="0"',
    ' key="k"',
    ' type="string"',
    ' type="number"',
    ' type="object"',
    "12",
    '{"a":',
    "}",
    " ",
    "\n",
    "text",
    '"',
    "&amp;",
]
K3_LIKE = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
ANY_TEXT = st.one_of(K3_LIKE, st.text(max_size=80))


@settings(max_examples=300, deadline=None)
@given(text=ANY_TEXT, start=st.sampled_from(["response", "think", "top"]))
def test_never_raises_and_loses_nothing_visible(text, start):
    parsed = parse_k3(text, start=start)
    assert isinstance(parsed.content, str) and isinstance(parsed.reasoning, str)
    for tool_call in parsed.tool_calls:
        assert tool_call.name
        json.loads(tool_call.arguments_json)


@settings(max_examples=300, deadline=None)
@given(
    text=ANY_TEXT,
    cuts=st.lists(st.integers(min_value=0, max_value=12), max_size=30),
)
def test_streaming_any_chunks_equals_whole(text, cuts):
    assert stream(text, cuts) == whole(text)


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(TURN)))
def test_truncated_turn_never_raises_and_keeps_complete_calls(cut):
    parsed = parse_k3(TURN[:cut])
    full = parse_k3(TURN)
    assert parsed.tool_calls == full.tool_calls[: len(parsed.tool_calls)]
