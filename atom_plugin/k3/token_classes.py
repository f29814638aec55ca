"""A vocabulary's token ids sorted into classes that a call automaton steps on.

Argument values are free text (strings) or JSON numbers written in whatever
tokens the model likes ("12", "3", ".5", "e-", ...). The call automaton
(call_automaton.py) cannot list those ids one by one, so every id gets a class:

- `TEXT` (0): ordinary text, allowed inside a string value, raw or JSON;
- `SPECIAL` (1): control and other special tokens, and text holding `<|` (it
  could spell a K3 marker): never allowed by a class, only as an explicit id;
- `QUOTED` (2): text holding `"`, `\\` or a control character (below U+0020):
  allowed in a raw string value, not inside a JSON string (where it would end
  the string or start an escape; the closing quote is an explicit id);
- one class per distinct effect on the number automata below, for tokens made
  only of the characters `0-9 + - . e E` (they are text too).

The number automata are one character DFA with three disjoint languages: a call
index (`[0-9]+`), a JSON integer (`-?(0|[1-9][0-9]*)`) and a JSON number (the
integer, then an optional fraction and exponent). A number class is the tuple of
the states a token's characters lead each character state to (`DEAD` where
they break the number), so the automaton's class transitions are lookups.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

TEXT = 0
SPECIAL = 1
QUOTED = 2
FIXED_CLASSES = 3  # number classes follow
# Class ids are bits of an int64 mask on the device; the two fixed ones included.
MAX_CLASSES = 63
DEAD = -1
NUMBER_CHARS = frozenset("0123456789+-.eE")
_QUOTED = re.compile(r'["\\\x00-\x1f]')

# Character states. INDEX_*: [0-9]+. INT_*: JSON integer. NUM_*: JSON number.
INDEX_START, INDEX_DIGITS = 0, 1
INT_START, INT_MINUS, INT_ZERO, INT_DIGITS = 2, 3, 4, 5
NUM_START, NUM_MINUS, NUM_ZERO, NUM_DIGITS = 6, 7, 8, 9
NUM_DOT, NUM_FRACTION, NUM_E, NUM_E_SIGN, NUM_EXPONENT = 10, 11, 12, 13, 14
NUM_CHAR_STATES = 15
ACCEPTING: frozenset[int] = frozenset(
    {INDEX_DIGITS, INT_ZERO, INT_DIGITS, NUM_ZERO, NUM_DIGITS, NUM_FRACTION, NUM_EXPONENT}
)
STARTS = {"index": INDEX_START, "integer": INT_START, "number": NUM_START}


def _char_step(state: int, char: str) -> int:
    digit, nonzero = char.isdigit(), char in "123456789"
    if state in (INDEX_START, INDEX_DIGITS):
        return INDEX_DIGITS if digit else DEAD
    if state in (INT_START, NUM_START) and char == "-":
        return state + 1
    if state in (INT_START, INT_MINUS, NUM_START, NUM_MINUS):
        first = INT_START if state < NUM_START else NUM_START
        if char == "0":
            return first + 2
        return first + 3 if nonzero else DEAD
    if state == INT_DIGITS:
        return INT_DIGITS if digit else DEAD
    if state == INT_ZERO:
        return DEAD
    if state in (NUM_ZERO, NUM_DIGITS):
        if char == ".":
            return NUM_DOT
        if char in "eE":
            return NUM_E
        return NUM_DIGITS if digit and state == NUM_DIGITS else DEAD
    if state in (NUM_DOT, NUM_FRACTION):
        if digit:
            return NUM_FRACTION
        return NUM_E if char in "eE" and state == NUM_FRACTION else DEAD
    if state == NUM_E:
        if char in "+-":
            return NUM_E_SIGN
        return NUM_EXPONENT if digit else DEAD
    if state in (NUM_E_SIGN, NUM_EXPONENT):
        return NUM_EXPONENT if digit else DEAD
    raise ValueError(f"character state {state} is not one of 0..{NUM_CHAR_STATES - 1}")


def run_chars(state: int, text: str) -> int:
    """The character state after `text` from `state` (DEAD once it breaks)."""
    for char in text:
        if state == DEAD:
            break
        state = _char_step(state, char)
    return state


@dataclass(frozen=True, eq=False)
class TokenClasses:
    """`of[id]` is id's class; `effects[c]` is number class c's tuple of next char states.

    `fingerprint` identifies the classes of the tokenizer's own ids (ids past it, up to
    a wider logits width, are SPECIAL and do not count): a call table compiled in the
    API server carries it, and the engine's classes of the same tokenizer match it.
    """

    of: np.ndarray  # [vocab] int32
    effects: tuple[tuple[int, ...], ...]  # indexed by class; () for the fixed classes
    fingerprint: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.effects)

    @property
    def number_classes(self) -> range:
        return range(FIXED_CLASSES, self.num_classes)

    @property
    def vocab(self) -> int:
        return int(self.of.shape[0])

    def class_of(self, token: int) -> int:
        return int(self.of[token]) if 0 <= token < self.vocab else SPECIAL

    def number_step(self, cls: int, char_state: int) -> int:
        """The char state after a token of class `cls` (DEAD if it breaks the number)."""
        effect = self.effects[cls]
        return effect[char_state] if effect else DEAD


def classes_from_texts(
    texts: Sequence[str | None], special_ids: Iterable[int] = (), size: int | None = None
) -> TokenClasses:
    """Classes for a vocabulary whose id i decodes to `texts[i]` (None: not a text token);
    the fingerprint covers the first `size` ids (all of them by default).

    Number effects beyond `MAX_CLASSES` classes fall back to SPECIAL (those
    tokens then cannot start or continue a number: stricter, never wrong).
    """
    specials = set(special_ids)
    effects: list[tuple[int, ...]] = [()] * FIXED_CLASSES
    index: dict[tuple[int, ...], int] = {}
    of = np.full(len(texts), TEXT, dtype=np.int32)
    for token, text in enumerate(texts):
        if text is None or token in specials or "<|" in text:
            of[token] = SPECIAL
        elif text and set(text) <= NUMBER_CHARS:
            effect = tuple(run_chars(q, text) for q in range(NUM_CHAR_STATES))
            if all(q == DEAD for q in effect):
                continue  # "+-" and the like: text that no number contains
            cls = index.get(effect)
            if cls is None and len(effects) < MAX_CLASSES:
                cls = index[effect] = len(effects)
                effects.append(effect)
            of[token] = SPECIAL if cls is None else cls
        elif _QUOTED.search(text):
            of[token] = QUOTED
    effects_t = tuple(effects)
    digest = hashlib.sha256(repr(effects_t).encode())
    digest.update(of[: len(texts) if size is None else size].astype("<i4").tobytes())
    return TokenClasses(of=of, effects=effects_t, fingerprint=digest.hexdigest()[:32])


@functools.lru_cache(maxsize=4)
def _cached(texts: tuple[str | None, ...], specials: tuple[int, ...], size: int) -> TokenClasses:
    return classes_from_texts(texts, specials, size)


def classes_for_tokenizer(tokenizer, vocab: int | None = None) -> TokenClasses:
    """The classes of a Hugging Face style tokenizer, each id decoded on its own.

    `vocab` (the model's logits width) may exceed the tokenizer's ids: the rest are SPECIAL.
    """
    size = len(tokenizer)
    width = max(size, vocab or 0)
    specials = tuple(sorted(getattr(tokenizer, "all_special_ids", ()) or ()))
    texts = tuple(tokenizer.decode([i]) if i < size else None for i in range(width))
    return _cached(texts, specials, size)
