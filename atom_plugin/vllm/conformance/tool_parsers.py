"""What the tool-parser checks ask of vLLM: its `ToolParser` base class, and a chat
request and tool list as vLLM's OpenAI server hands them to a parser."""

from __future__ import annotations

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
)
from vllm.tool_parsers.abstract_tool_parser import ToolParser


def is_tool_parser(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, ToolParser)


def chat_request(tools: list[dict]) -> ChatCompletionRequest:
    """One user turn offering `tools` (OpenAI function dicts), tool choice auto."""
    return ChatCompletionRequest(
        model="conformance",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        tool_choice="auto",
    )


def make_parser(cls, tokenizer, tools: list[dict]):
    """`cls` built as vLLM builds a tool parser: `cls(tokenizer, tools)`."""
    return cls(tokenizer, [ChatCompletionToolsParam(**t) for t in tools])
