"""A compiled call automaton as flat arrays: what the API server sends the engine.

`CallAutomaton` (call_automaton.py) builds a request's calls state by state in
Python; `CallTable` holds the result as two CSR edge lists, explicit edges (id ->
state) and class edges (class -> state), ids ascending within a state. The tool
parser compiles a tool set once (call_cache.py) and sends `to_wire()` in the
request's `extra_args`; the engine reads it back (`read_wire`, then
`CheckedCalls.bind` to its token classes) and lays out its rows with numpy
(channel_tables.py): nothing is compiled on the engine's step.

`LIMITS` bounds what one request may ask of the engine (each is checked while
building and again when a table is read): the states, the ids one state allows by
name (the kernel reads them for every masked row of that state), and the edges. The
engine's tables are as large as the automaton (channel_tables.py). A tool set beyond
them keeps vLLM's structural tag (or is refused with a 400 where vLLM gives none), as
an unsupported schema does.

The wire carries the token classes' fingerprint: the engine's classes, built
from the same tokenizer, must match it.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from atom_plugin.k3.token_classes import SPECIAL, TokenClasses

FINAL = -1
WIRE_VERSION = 1


@dataclass(frozen=True)
class CallLimits:
    """The most one request's call automaton may hold."""

    states: int = 262_144
    allowed: int = 1_024  # explicit edges of one state: the ids it allows by name
    edges: int = 2_097_152  # explicit and class edges of all states

    def describe(self) -> str:
        return (
            f"{self.states:,} states, {self.allowed:,} ids allowed by name in one state, "
            f"{self.edges:,} edges"
        )


LIMITS = CallLimits()


class CallSpecError(ValueError):
    """A call spec (or a schema turned into one) that the automaton cannot hold."""


class CallsTooLarge(CallSpecError):
    """A request's call automaton beyond `LIMITS`."""


def too_large(what: str, value: int, limit: int) -> CallsTooLarge:
    return CallsTooLarge(
        f"the tools' call automaton needs {what} {value:,}, beyond the channel's limit of "
        f"{limit:,} per request (limits: {LIMITS.describe()})"
    )


_ARRAYS = ("edge_ptr", "edge_tok", "edge_dst", "class_ptr", "class_cls", "class_dst")


@dataclass(frozen=True, eq=False)
class CallTable:
    """States 0..num_states-1 (0 right after `call tool="`); FINAL follows `<|end_of_msg|>`.

    State s's explicit edges are edge_tok/edge_dst[edge_ptr[s]:edge_ptr[s + 1]] and
    its class edges class_cls/class_dst[class_ptr[s]:class_ptr[s + 1]] (int32). A
    token takes its explicit edge if it has one, else its class's; a state with one
    explicit edge and no class edge forces that id.
    """

    token_classes: TokenClasses
    edge_ptr: np.ndarray
    edge_tok: np.ndarray
    edge_dst: np.ndarray
    class_ptr: np.ndarray
    class_cls: np.ndarray
    class_dst: np.ndarray
    # The arrays' digest when it is known already (read_wire computes it); else `digest`
    # computes it on first use (the API server, which only sends the table, never does).
    known_digest: str | None = dataclasses.field(default=None, repr=False)

    @functools.cached_property
    def digest(self) -> str:
        """Of the arrays and classes: equal tables of one vocabulary are one channel."""
        if self.known_digest is not None:
            return self.known_digest
        return _digest({n: getattr(self, n) for n in _ARRAYS}, self.token_classes.fingerprint)

    @property
    def num_states(self) -> int:
        return len(self.edge_ptr) - 1

    @functools.cached_property
    def edge_counts(self) -> np.ndarray:
        return np.diff(self.edge_ptr)

    @functools.cached_property
    def class_counts(self) -> np.ndarray:
        return np.diff(self.class_ptr)

    def edges(self, state: int) -> dict[int, int]:
        lo, hi = self.edge_ptr[state], self.edge_ptr[state + 1]
        return dict(zip(self.edge_tok[lo:hi].tolist(), self.edge_dst[lo:hi].tolist(), strict=True))

    def classes(self, state: int) -> dict[int, int]:
        lo, hi = self.class_ptr[state], self.class_ptr[state + 1]
        return dict(
            zip(self.class_cls[lo:hi].tolist(), self.class_dst[lo:hi].tolist(), strict=True)
        )

    def step(self, state: int, token: int) -> int | None:
        """The next state (FINAL after the end), or None if `token` is not allowed."""
        lo, hi = int(self.edge_ptr[state]), int(self.edge_ptr[state + 1])
        at = lo + int(np.searchsorted(self.edge_tok[lo:hi], token))
        if at < hi and int(self.edge_tok[at]) == token:
            return int(self.edge_dst[at])
        return self.step_class(state, self.token_classes.class_of(token))

    def step_class(self, state: int, cls: int) -> int | None:
        lo, hi = int(self.class_ptr[state]), int(self.class_ptr[state + 1])
        at = lo + int(np.searchsorted(self.class_cls[lo:hi], cls))
        if at < hi and int(self.class_cls[at]) == cls:
            return int(self.class_dst[at])
        return None

    def forced_token(self, state: int) -> int | None:
        if self.edge_counts[state] == 1 and self.class_counts[state] == 0:
            return int(self.edge_tok[self.edge_ptr[state]])
        return None

    def allowed_ids(self, state: int, vocab: int) -> list[int]:
        """Every allowed id below `vocab` (for tests and references)."""
        of = self.token_classes.of[:vocab]
        by_class = np.flatnonzero(np.isin(of, list(self.classes(state)))).tolist()
        return sorted(set(by_class) | {t for t in self.edges(state) if t < vocab})

    # ---- the wire ------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """A JSON-able value (the arrays zlib-compressed, base64)."""
        # Compressed array by array: no copy of the arrays joined.
        zipped = zlib.compressobj(1)
        parts = [zipped.compress(np.ascontiguousarray(getattr(self, n), "<i4")) for n in _ARRAYS]
        return {
            "v": WIRE_VERSION,
            "states": self.num_states,
            "edges": len(self.edge_tok),
            "class_edges": len(self.class_cls),
            "classes": self.token_classes.fingerprint,
            "data": base64.b64encode(b"".join([*parts, zipped.flush()])).decode("ascii"),
        }

    @classmethod
    def from_wire(cls, value: Any, classes: TokenClasses) -> CallTable:
        """The table `value` describes, for `classes` (ValueError if it is not theirs)."""
        return CheckedCalls(*read_wire(value)).bind(classes)


@dataclass(frozen=True)
class CheckedCalls:
    """A call table read from the wire and checked, not yet tied to a vocabulary."""

    arrays: dict[str, np.ndarray]
    fingerprint: str
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def bind(self, classes: TokenClasses) -> CallTable:
        """The table for `classes`; ValueError if it was compiled for other classes or
        steps on a class they do not have."""
        if self.fingerprint != classes.fingerprint:
            raise ValueError(
                f"the call table was compiled for token classes {self.fingerprint}, but this "
                f"engine's tokenizer gives {classes.fingerprint}: the API server and the "
                "engine must load the same tokenizer"
            )
        top = int(self.arrays["class_cls"].max(initial=0))
        if top >= classes.num_classes:
            raise ValueError(
                f"the call table uses token class {top}; this vocabulary has {classes.num_classes}"
            )
        return CallTable(classes, **self.arrays, known_digest=self.digest)


def _digest(arrays: Mapping[str, np.ndarray], fingerprint: str) -> str:
    h = hashlib.sha256(fingerprint.encode())
    for name in _ARRAYS:
        h.update(np.ascontiguousarray(arrays[name], "<i4").data)
    return h.hexdigest()


def check_limits(arrays: Mapping[str, np.ndarray]) -> None:
    """CallsTooLarge when the table is beyond `LIMITS`."""
    check_sizes(
        len(arrays["edge_ptr"]) - 1,
        int(np.diff(arrays["edge_ptr"]).max(initial=0)),
        len(arrays["edge_tok"]) + len(arrays["class_cls"]),
    )


def check_sizes(states: int, widest: int, edges: int) -> None:
    """CallsTooLarge for a table of `states`, `widest` ids allowed by name in one state
    and `edges` (explicit and class) beyond `LIMITS`."""
    if states > LIMITS.states:
        raise too_large("states", states, LIMITS.states)
    if widest > LIMITS.allowed:
        raise too_large("ids allowed by name in one state", widest, LIMITS.allowed)
    if edges > LIMITS.edges:
        raise too_large("edges", edges, LIMITS.edges)


_WIRE_KEYS = frozenset({"v", "states", "edges", "class_edges", "classes", "data"})


def read_wire(value: Any) -> tuple[dict[str, np.ndarray], str, str]:
    """The arrays of a wire value, its classes' fingerprint and its digest; ValueError
    (CallsTooLarge beyond `LIMITS`) naming what is wrong. Checks the shape only."""
    if not isinstance(value, Mapping) or set(value) != _WIRE_KEYS:
        raise ValueError(f"a call table has exactly the keys {', '.join(sorted(_WIRE_KEYS))}")
    if value["v"] != WIRE_VERSION:
        raise ValueError(f"call table version {value['v']!r}; this plugin reads {WIRE_VERSION}")
    sizes = {k: value[k] for k in ("states", "edges", "class_edges")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes.values()):
        raise ValueError(f"call table sizes must be non-negative ints, got {sizes}")
    if sizes["states"] > LIMITS.states:
        raise too_large("states", sizes["states"], LIMITS.states)
    if not isinstance(value["classes"], str) or not isinstance(value["data"], str):
        raise ValueError("a call table's classes and data are strings")
    states, edges, class_edges = sizes["states"], sizes["edges"], sizes["class_edges"]
    lengths = [states + 1, edges, edges, states + 1, class_edges, class_edges]
    try:
        raw = zlib.decompress(base64.b64decode(value["data"], validate=True), bufsize=1 << 20)
    except (ValueError, zlib.error) as err:
        raise ValueError(f"call table data does not decode: {err}") from err
    if len(raw) != 4 * sum(lengths):
        raise ValueError(
            f"call table data holds {len(raw)} bytes, its sizes say {4 * sum(lengths)}"
        )
    flat = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    arrays, at = {}, 0
    for name, n in zip(_ARRAYS, lengths, strict=True):
        arrays[name] = flat[at : at + n]
        at += n
    if states == 0:
        raise ValueError("a call table has at least one state")
    for ptr, n, what in (("edge_ptr", edges, "edges"), ("class_ptr", class_edges, "class edges")):
        p = arrays[ptr]
        if p[0] != 0 or p[-1] != n or (np.diff(p) < 0).any():
            raise ValueError(f"call table {what}: offsets are not 0..{n} ascending")
    for dst in ("edge_dst", "class_dst"):
        d = arrays[dst]
        if d.size and (d.min() < FINAL or d.max() >= states):
            raise ValueError(f"call table {dst} outside {FINAL}..{states - 1}")
    if edges and arrays["edge_tok"].min() < 0:
        raise ValueError("call table ids must be non-negative")
    if class_edges and (arrays["class_cls"].min() < 0 or (arrays["class_cls"] == SPECIAL).any()):
        raise ValueError(f"call table classes must be non-negative and not SPECIAL ({SPECIAL})")
    for ptr, key in (("edge_ptr", "edge_tok"), ("class_ptr", "class_cls")):
        _check_ascending(arrays[ptr], arrays[key], key)
    check_limits(arrays)
    return arrays, value["classes"], _digest(arrays, value["classes"])


def _check_ascending(ptr: np.ndarray, keys: np.ndarray, what: str) -> None:
    """Keys strictly ascending within each state (the lookups bisect them)."""
    if keys.size < 2:
        return
    same_state = np.ones(keys.size - 1, dtype=bool)
    starts = ptr[1:-1]
    starts = starts[(starts > 0) & (starts < keys.size)]
    same_state[starts - 1] = False
    if (np.diff(keys)[same_state] <= 0).any():
        raise ValueError(f"call table {what} are not strictly ascending within a state")
