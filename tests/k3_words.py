"""A small pure-Python K3 vocabulary for the call automaton's tests (no tokenizer library).

Ids 0-3 are the control tokens; every other id is a text piece. `encode` is a greedy
longest match over the pieces (control tokens are pieces too), so the fixed K3
texts encode the way a BPE with these merges would, and `decode` concatenates.
"""

from __future__ import annotations

from atom_plugin.k3.grammar import CLOSE, END_OF_MSG, OPEN, SEP

CONTROL = [OPEN, CLOSE, SEP, END_OF_MSG]
TEXT = [
    "call", ' tool="', '" index="', '"', "argument", ' key="', '" type="', "tools", "message",
    "response", "string", "number", "boolean", "null", "true", "false",
    "a", "b", "c", "city", "count", "f", "g", "get_weather", "Sure", "Paris", "x", "y", " ",
    "0", "1", "2", "7", "9", "12", "00", "10", "-", ".", "e", "E", "+", "1.", ".5", "e-", "-1",
    "1e", "x1", "&quot;", "&amp;", "<", "5", "&",
    "{", "}", "[", "]", ",", ":", ", ", ": ", '": ', '{"', '"}', '", "', "\\", "\n", "object",
    "array", "tags", "Pa\nris",
]  # fmt: skip
PIECES = CONTROL + TEXT


class Words:
    """Greedy longest-match tokenizer over PIECES; EOS is `<|end_of_msg|>`."""

    eos_token_id = PIECES.index(END_OF_MSG)
    all_special_ids = [0, 1, 2, 3]

    def __len__(self) -> int:
        return len(PIECES)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            best = max(
                (i for i, p in enumerate(PIECES) if text.startswith(p, pos)),
                key=lambda i: len(PIECES[i]),
                default=None,
            )
            if best is None:
                raise ValueError(f"{text[pos:]!r} has no piece of the test vocabulary")
            ids.append(best)
            pos += len(PIECES[best])
        return ids

    def decode(self, ids) -> str:
        return "".join(PIECES[i] for i in ids)


def ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]
