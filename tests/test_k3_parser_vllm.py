"""`atom_kimi_k3` inside vLLM's own parser composition (no engine).

It must agree with vLLM's `kimi_k3` on well-formed turns, and, streamed through
vLLM's `Parser.parse_delta` in any chunks, give what `Parser.parse` gives.
"""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from models.scripted_gpt2 import build_tokenizer

from atom_plugin.k3.grammar import CLOSE, OPEN, SEP, escape_attr

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.parser.parser_manager import ParserManager  # noqa: E402
from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser  # noqa: E402

from atom_plugin.vllm.k3.tool_parser import AtomKimiK3ToolParser  # noqa: E402
from atom_plugin.vllm.registration import register_tool_parsers  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    register_tool_parsers()
    return build_tokenizer(tmp_path_factory.mktemp("k3tok"))


def request(tool_choice="auto"):
    return ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        model="m",
        tools=TOOLS,
        tool_choice=tool_choice,
    )


SAFE_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<|"), max_size=20
)
NAMES = st.text(alphabet="abc_&\"' xyz", min_size=1, max_size=10)
VALUES = st.one_of(
    st.tuples(st.just("string"), SAFE_TEXT),
    st.tuples(st.just("number"), st.integers(-1000, 1000).map(str)),
    st.tuples(st.just("boolean"), st.sampled_from(["true", "false"])),
    st.tuples(st.just("null"), st.just("null")),
    st.tuples(
        st.just("object"),
        st.dictionaries(st.text("ab", max_size=3), st.integers(), max_size=3).map(json.dumps),
    ),
    st.tuples(st.just("array"), st.lists(st.integers(), max_size=3).map(json.dumps)),
)
CALLS = st.lists(
    st.tuples(NAMES, st.dictionaries(st.text("kqz_", min_size=1, max_size=4), VALUES, max_size=3)),
    min_size=0,
    max_size=3,
)


def k3_turn(content, calls):
    text = content + f"{CLOSE}response{SEP}"
    if calls:
        text += f"{OPEN}tools{SEP}"
        for index, (name, args) in enumerate(calls):
            text += f'{OPEN}call tool="{escape_attr(name)}" index="{index}"{SEP}'
            for key, (type_, value) in args.items():
                text += f'{OPEN}argument key="{escape_attr(key)}" type="{type_}"{SEP}'
                text += f"{value}{CLOSE}argument{SEP}"
            text += f"{CLOSE}call{SEP}"
        text += f"{CLOSE}tools{SEP}"
    return text + f"{CLOSE}message{SEP}"


def summary(info):
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    return info.tools_called, calls, info.content


@settings(max_examples=150, deadline=None)
@given(content=SAFE_TEXT, calls=CALLS)
def test_agrees_with_vllms_kimi_k3_on_well_formed_turns(tokenizer, content, calls):
    text = k3_turn(content, calls)
    ours = AtomKimiK3ToolParser(tokenizer, TOOLS).extract_tool_calls(text, request())
    theirs = KimiK3ToolParser(tokenizer, TOOLS).extract_tool_calls(text, request())
    assert summary(ours) == summary(theirs)
    assert [c.function.name for c in ours.tool_calls] == [name for name, _ in calls]


def parse_streamed(tokenizer, text, cuts, tool_choice):
    parser = ParserManager.get_parser(tool_parser_name="atom_kimi_k3", enable_auto_tools=True)(
        tokenizer, TOOLS
    )
    req = request(tool_choice)
    content, calls, pos = "", [], 0
    pieces = []
    for size in cuts:
        pieces.append(text[pos : pos + size])
        pos += size
    pieces.append(text[pos:])
    for i, piece in enumerate(pieces):
        delta = parser.parse_delta(piece, [], req, [1], finished=i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.append((call.function.name, json.loads(call.function.arguments)))
    # vLLM's non-streaming Parser.parse drops whitespace-only content beside tool calls,
    # and under a required or named tool choice when no call came; a streaming client
    # has received the same deltas, so compare what is left of them.
    required_or_named = tool_choice not in ("auto", "none")
    if (calls or required_or_named) and not content.strip():
        content = ""
    return content or None, calls


def parse_whole(tokenizer, text, tool_choice):
    parser = ParserManager.get_parser(tool_parser_name="atom_kimi_k3", enable_auto_tools=True)(
        tokenizer, TOOLS
    )
    _, content, calls = parser.parse(text, request(tool_choice), enable_auto_tools=True)
    calls = [(c.name, json.loads(c.arguments)) for c in calls or []]
    return content, calls


@settings(max_examples=60, deadline=None)
@given(
    content=SAFE_TEXT,
    calls=CALLS,
    cut=st.integers(0, 400),
    cuts=st.lists(st.integers(1, 9), max_size=40),
    choice=st.sampled_from(["auto", "required", "none"]),
)
# whitespace alone under a required tool choice: vLLM's whole parse answers no content
@example(content="\r", calls=[], cut=1, cuts=[], choice="required")
def test_streaming_through_vllm_equals_whole(tokenizer, content, calls, cut, cuts, choice):
    text = k3_turn(content, calls)[: cut or None]  # whole or truncated
    streamed = parse_streamed(tokenizer, text, cuts, choice)
    whole = parse_whole(tokenizer, text, choice)
    if choice == "none":
        assert streamed[1] == [] and whole[1] == []
    assert streamed == whole


def test_truncated_call_comes_back_as_content_at_the_end(tokenizer):
    cut = f'ok{CLOSE}response{SEP}{OPEN}tools{SEP}{OPEN}call tool="f" index="0"{SEP}{OPEN}arg'
    content, calls = parse_streamed(tokenizer, cut, [3] * 30, "required")
    assert calls == []
    assert content == f'ok{OPEN}call tool="f" index="0"{SEP}{OPEN}arg'
