"""A synthetic K3-sized vocabulary and tokenizer for the K3 benchmark (the real one cannot be
downloaded here).

`SyntheticK3Tokenizer(size)` has `size - 256` BPE-like text pieces and 256 special tokens at
the top, the four K3 control tokens among them, as K3's tiktoken vocabulary has (163,584
ranks + 256 specials = 163,840). The text pieces are what a byte-level BPE of that size holds:
every printable ASCII character, the numbers 0-999 (tiktoken-style models split digits into
runs of up to three), number fragments (".5", "e-", "-1", ...), JSON and K3 punctuation
(`{"`, `":`, `", "`, ...), the K3 tag words, and generated words with and without a leading
space and capitalised, until the size is reached. It is deterministic for a size.

`encode` is a greedy longest match (control and special tokens first), `decode` concatenates:
the fixed K3 texts encode as a BPE with these pieces would, and so do the values a
benchmark writes. This is not the K3 tokenizer: figures from it are labelled synthetic.
"""

from __future__ import annotations

import random

from atom_plugin.k3.grammar import CLOSE, END_OF_MSG, OPEN, SEP

NUM_SPECIAL = 256
CONTROL = (OPEN, CLOSE, SEP, END_OF_MSG)
_FIXED = [
    "call", ' tool="', '" index="', '"', "argument", ' key="', '" type="', "tools", "message",
    "response", "string", "number", "boolean", "null", "object", "array", "true", "false",
    "think", '"<', '">', '":', '": ', '", "', '{"', '"}', '["', '"]', "},", "}, ", "],", "{}",
    "[]", ", ", ": ", "\n", "\n\n", "  ", "    ", "\t", "\\n", '\\"', "\\\\", "&quot;", "&amp;",
    ".", ".5", ".0", "e-", "e+", "E-", "-1", "-0", "1.", "1e", "0.", "+", "-", "e", "E",
]  # fmt: skip
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
_ONSETS += ["br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sp", "st", "str", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "rt", "ck", "ts", "ed", "er"]


def _pieces(num_text: int) -> list[str]:
    pieces: list[str] = []
    seen: set[str] = set()

    def add(piece: str) -> None:
        if piece and piece not in seen and len(pieces) < num_text:
            seen.add(piece)
            pieces.append(piece)

    for code in range(32, 127):
        add(chr(code))
    for piece in _FIXED:
        add(piece)
    for n in range(1000):
        add(str(n))
    for n in range(100):
        add(f"{n:02d}")
    rng = random.Random(num_text)
    affixes = ("", " ", " ", "_", ".")
    while len(pieces) < num_text:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
            for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )
        if rng.random() < 0.2:
            word = word.capitalize()
        add(rng.choice(affixes) + word)
    return pieces


class SyntheticK3Tokenizer:
    """Greedy longest-match tokenizer over `size` ids; the top 256 are special tokens."""

    def __init__(self, size: int) -> None:
        if size < 4096:
            raise ValueError(f"a synthetic K3 vocabulary needs at least 4096 ids, got {size}")
        text = _pieces(size - NUM_SPECIAL)
        specials = [f"<|reserved_{i}|>" for i in range(NUM_SPECIAL)]
        specials[:4] = CONTROL
        self.pieces: list[str] = text + specials
        self._id = {p: i for i, p in enumerate(self.pieces)}
        self._longest = max(len(p) for p in text)
        self.all_special_ids = list(range(len(text), size))
        self.eos_token_id = self._id[END_OF_MSG]

    def __len__(self) -> int:
        return len(self.pieces)

    def token_id(self, piece: str) -> int:
        return self._id[piece]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            if text.startswith("<|", pos):
                end = text.find("|>", pos)
                special = self._id.get(text[pos : end + 2]) if end >= 0 else None
                if special is not None and special in self.all_special_ids:
                    ids.append(special)
                    pos = end + 2
                    continue
            for length in range(min(self._longest, len(text) - pos), 0, -1):
                piece = self._id.get(text[pos : pos + length])
                if piece is not None and piece < self.all_special_ids[0]:
                    ids.append(piece)
                    pos += length
                    break
            else:
                raise ValueError(f"{text[pos]!r} is not in the synthetic vocabulary")
        return ids

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)
