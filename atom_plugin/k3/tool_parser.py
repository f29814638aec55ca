"""A Kimi-K3 tool-call parser in pure Python, streaming and not.

It reads an assistant turn (see docs/kimi-k3.md) and splits it into the content
(the response channel and any text outside the channels), the reasoning (the
think channel) and the tool calls. Output never makes it raise: a call that is
malformed or cut short is handed back as content, verbatim.

`K3StreamParser` is a left-to-right transducer; `parse_k3` feeds it the whole
text. So streaming a text in any chunks gives, concatenated, the same result
as parsing it at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from atom_plugin.k3.grammar import Piece, Tag, TagLexer, Text

STARTS: tuple[str, ...] = ("response", "think", "top")
STRING_TYPE = "string"


@dataclass(frozen=True)
class K3ToolCall:
    name: str
    index: int | None
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class K3Delta:
    """What one `feed` (or `finish`) produced."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[K3ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: K3Delta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


@dataclass(frozen=True)
class K3Parse:
    content: str
    reasoning: str
    tool_calls: tuple[K3ToolCall, ...]


def decode_argument(value: str, type_: str) -> Any:
    """String values are raw; other types are JSON, kept raw if the JSON is bad."""
    if type_ == STRING_TYPE:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class _Call:
    """A call being read: its raw text (for the malformed case) and its parts."""

    def __init__(self, tag: Tag) -> None:
        self.raw = tag.raw
        attrs = tag.attrs()
        self.ok = attrs is not None and bool(attrs.get("tool"))
        self.name = (attrs or {}).get("tool", "")
        index = (attrs or {}).get("index", "")
        self.index = int(index) if index.isdigit() else None
        self.arguments: dict[str, Any] = {}
        self.arg_key = ""
        self.arg_type = STRING_TYPE
        self.arg_value = ""

    def open_argument(self, tag: Tag) -> None:
        self.raw += tag.raw
        attrs = tag.attrs()
        if attrs is None or "key" not in attrs:
            self.ok = False
            attrs = attrs or {}
        self.arg_key = attrs.get("key", "")
        self.arg_type = attrs.get("type", STRING_TYPE)
        self.arg_value = ""

    def close_argument(self, tag: Tag) -> None:
        self.raw += tag.raw
        self.arguments[self.arg_key] = decode_argument(self.arg_value, self.arg_type)

    def result(self) -> K3ToolCall:
        return K3ToolCall(self.name, self.index, self.arguments)


class K3StreamParser:
    """Feed text chunks; each call returns only what became certain."""

    def __init__(self, start: str = "response") -> None:
        if start not in STARTS:
            raise ValueError(f"K3 parser start {start!r} is not one of {', '.join(STARTS)}")
        self._lexer = TagLexer()
        self._state = start
        self._call: _Call | None = None
        self._gap = ""  # text between calls, kept only if it is not all whitespace

    def feed(self, chunk: str) -> K3Delta:
        return self._run(self._lexer.feed(chunk))

    def finish(self) -> K3Delta:
        delta = self._run(self._lexer.finish())
        self._flush_gap(delta)
        if self._call is not None:
            delta.content += self._call.raw
            self._call = None
            self._state = "top"
        return delta

    def _run(self, pieces: list[Piece]) -> K3Delta:
        delta = K3Delta()
        for piece in pieces:
            getattr(self, "_in_" + self._state)(piece, delta)
        return delta

    @staticmethod
    def _raw(piece: Piece) -> str:
        return piece.text if isinstance(piece, Text) else piece.raw

    @staticmethod
    def _ends_message(piece: Piece) -> bool:
        return isinstance(piece, Tag) and (piece.kind == "end" or piece.is_("close", "message"))

    def _in_think(self, piece: Piece, delta: K3Delta) -> None:
        if isinstance(piece, Tag) and piece.is_("close", "think"):
            self._state = "top"
        else:
            delta.reasoning += self._raw(piece)

    def _in_response(self, piece: Piece, delta: K3Delta) -> None:
        if isinstance(piece, Tag) and piece.is_("close", "response"):
            self._state = "top"
        elif isinstance(piece, Tag) and piece.is_("open", "tools"):
            self._state = "tools"
        elif self._ends_message(piece):
            self._state = "top"
        else:
            delta.content += self._raw(piece)

    def _in_top(self, piece: Piece, delta: K3Delta) -> None:
        if (
            isinstance(piece, Tag)
            and piece.kind == "open"
            and piece.head.strip()
            in (
                "think",
                "response",
                "tools",
            )
        ):
            self._state = piece.head.strip()
        elif not self._ends_message(piece):
            delta.content += self._raw(piece)

    def _flush_gap(self, delta: K3Delta) -> None:
        if self._gap.strip():
            delta.content += self._gap
        self._gap = ""

    def _in_tools(self, piece: Piece, delta: K3Delta) -> None:
        if isinstance(piece, Text):
            self._gap += piece.text
            return
        self._flush_gap(delta)
        if piece.kind == "open" and piece.name == "call":
            self._call = _Call(piece)
            self._state = "call"
        elif piece.is_("close", "tools") or self._ends_message(piece):
            self._state = "top"
        else:
            delta.content += piece.raw

    def _in_call(self, piece: Piece, delta: K3Delta) -> None:
        call = self._call
        assert call is not None
        if isinstance(piece, Tag) and piece.kind == "open" and piece.name == "argument":
            call.open_argument(piece)
            self._state = "argument"
        elif isinstance(piece, Tag) and piece.is_("close", "call"):
            call.raw += piece.raw
            if call.ok:
                delta.tool_calls.append(call.result())
            else:
                delta.content += call.raw
            self._call = None
            self._state = "tools"
        else:
            call.raw += self._raw(piece)
            if not (isinstance(piece, Text) and not piece.text.strip()):
                call.ok = False

    def _in_argument(self, piece: Piece, delta: K3Delta) -> None:
        call = self._call
        assert call is not None
        if isinstance(piece, Tag) and piece.is_("close", "argument"):
            call.close_argument(piece)
            self._state = "call"
        else:
            text = self._raw(piece)
            call.raw += text
            call.arg_value += text


def parse_k3(text: str, start: str = "response") -> K3Parse:
    """Parse a whole assistant turn; `start` is the channel the prompt left open."""
    parser = K3StreamParser(start)
    delta = parser.feed(text)
    delta.extend(parser.finish())
    return K3Parse(delta.content, delta.reasoning, tuple(delta.tool_calls))
