"""Kimi-K3 output text, cut into control tags and plain text.

The four control tokens reach a tool parser as literal strings. A tag is
`<|open|>HEAD<|sep|>` or `<|close|>HEAD<|sep|>` (HEAD holds no control token),
or `<|end_of_msg|>` alone. Anything else, including a lone `<|sep|>` or an
`<|open|>` that another control token interrupts, is text.

`TagLexer` is incremental: it emits a piece only once no later input can change
it, so feeding a text in any chunks yields the same tags and the same text
between them as feeding it whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
CONTROL_TOKENS: tuple[str, ...] = (OPEN, CLOSE, SEP, END_OF_MSG)

_ATTR = re.compile(r'\s*([A-Za-z_][\w-]*)="([^"]*)"')
_ENTITY = re.compile(r"&(amp|quot);")


def unescape_attr(value: str) -> str:
    """Reverse the template's attribute escaping (`&amp;`, `&quot;`) in one pass."""
    return _ENTITY.sub(lambda m: "&" if m[1] == "amp" else '"', value)


def escape_attr(value: str) -> str:
    """The template's attribute escaping: `&` first, then `"`."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Tag:
    """`kind` is "open", "close" or "end"; `raw` is the exact text it came from."""

    kind: str
    head: str
    raw: str

    @property
    def name(self) -> str:
        parts = self.head.split(maxsplit=1)
        return parts[0] if parts else ""

    def attrs(self) -> dict[str, str] | None:
        """The `k="v"` attributes after the name (unescaped); None if they do not parse."""
        parts = self.head.strip().split(maxsplit=1)
        rest = parts[1] if len(parts) > 1 else ""
        out: dict[str, str] = {}
        pos = 0
        while pos < len(rest):
            m = _ATTR.match(rest, pos)
            if m is None:
                return None if rest[pos:].strip() else out
            out[m[1]] = unescape_attr(m[2])
            pos = m.end()
        return out

    def is_(self, kind: str, name: str) -> bool:
        return self.kind == kind and self.head.strip() == name


Piece = Text | Tag


def _first_control(text: str, start: int = 0) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for token in CONTROL_TOKENS:
        i = text.find(token, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, token)
    return best


def _could_start_control(text: str) -> bool:
    """True if `text` is a proper prefix of a control token."""
    return any(token.startswith(text) and token != text for token in CONTROL_TOKENS)


class TagLexer:
    def __init__(self) -> None:
        self._buf = ""

    def feed(self, chunk: str) -> list[Piece]:
        self._buf += chunk
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        buf = self._buf
        while buf:
            i = buf.find("<|")
            if i < 0:
                keep = 1 if buf.endswith("<") and not final else 0
                if len(buf) > keep:
                    out.append(Text(buf[: len(buf) - keep]))
                buf = buf[len(buf) - keep :]
                break
            if i > 0:
                out.append(Text(buf[:i]))
                buf = buf[i:]
            token = next((t for t in CONTROL_TOKENS if buf.startswith(t)), None)
            if token is None:
                if _could_start_control(buf) and not final:
                    break
                out.append(Text(buf[:2]))
                buf = buf[2:]
                continue
            if token == SEP:
                out.append(Text(SEP))
                buf = buf[len(SEP) :]
                continue
            if token == END_OF_MSG:
                out.append(Tag("end", "", END_OF_MSG))
                buf = buf[len(END_OF_MSG) :]
                continue
            found = _first_control(buf, len(token))
            if found is None:
                if not final:
                    break
                out.append(Text(buf))
                buf = ""
                break
            j, nxt = found
            if nxt == SEP:
                end = j + len(SEP)
                kind = "open" if token == OPEN else "close"
                out.append(Tag(kind, buf[len(token) : j], buf[:end]))
                buf = buf[end:]
            else:
                out.append(Text(buf[:j]))
                buf = buf[j:]
        self._buf = buf
        return out
