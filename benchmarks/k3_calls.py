"""The K3 benchmark's schema-constrained calls: a mixed batch of 256 rows, and the token classes.

`CallsBatch(tokenizer, device)` builds, on a synthetic K3 vocabulary (benchmarks/k3_vocab.py),
one step of 256 rows through the processors' core (`ChannelCore`):
- 96 required rows inside calls of four tools with different schemas (`TOOLS`): the tool
  name, the call index, argument keys, string, integer and number values, enum and boolean
  values, JSON inside an object- and an array-typed argument (a string in a nested object,
  its next key or close, an array's first item or close, its separator or close), the
  choice of the next call or the close: all masked states of the call automaton;
- 32 named rows (one named channel per tool, `parallel_tool_calls=false`): a forced name,
  keys and values;
- 32 forced-prefix rows: the channel's forced opening and the call's forced pieces;
- 32 required rows waiting (their end ids banned), 64 rows without a channel.
Each row's state is reached by walking its ids (`ROWS`: K3 pieces, each encoded on its own as
the model's encoder does) through the channel, every id checked as allowed. `masks(...)`
gives the step's exact mask (the torch reference on zeros) as xgrammar's int32 bitmask.

`XgrammarFill` is xgrammar's CPU side for the same requests: one `GrammarMatcher` per
constrained row, compiled from vLLM's own kimi_k3 structural tag for the request's tools
(required, or the named tool as vLLM's "forced"), advanced through the same ids; `fill()`
fills every constrained row's bitmask once, as vLLM's grammar path does each step on the host.
Its masks are vLLM's (looser than ours: any key order, repeated keys).

`class_build_seconds(tokenizer, vocab)` times `classes_for_tokenizer` (decode every id, sort
into classes), the one-off cost an engine pays on its first request with calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atom_plugin.k3.call_automaton import CallAutomaton
from atom_plugin.k3.channel_for import required_channel_for
from atom_plugin.k3.grammar import CLOSE, END_OF_MSG, OPEN, SEP
from atom_plugin.k3.processor_core import ChannelCore
from atom_plugin.k3.required_channel import START, UNCONSTRAINED, RequiredChannel
from atom_plugin.k3.schema import call_spec_for
from atom_plugin.k3.token_classes import TokenClasses, classes_for_tokenizer
from benchmarks.xgrammar_mask import pack_bitmask

BATCH = 256


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    schema["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    _tool(
        "get_weather",
        {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        ["city"],
    ),
    _tool(
        "set_price",
        {
            "amount": {"type": "number"},
            "currency": {"enum": ["EUR", "USD", "JPY"]},
            "exact": {"type": "boolean"},
            "note": {"type": "string"},
        },
        ["amount", "currency"],
    ),
    _tool(
        "book",
        {
            "guest": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "nights": {"type": "array", "items": {"type": "string"}},
        },
        ["guest"],
    ),
    _tool(
        "search",
        {"query": {"type": "string"}, "limit": {"type": "integer"}, "lang": {"type": "string"}},
        ["query"],
    ),
]

PROMPT_END = ("Sure", CLOSE, "response", SEP)  # generation starts inside the response
OPENING = (OPEN, "tools", SEP, OPEN, 'call tool="')


def _call(name: str) -> tuple[str, ...]:
    return (*PROMPT_END, *OPENING, name, '" index="', "0", '"', SEP)


def _arg(key: str, k3_type: str) -> tuple[str, ...]:
    return (OPEN, f'argument key="{key}" type="{k3_type}"', SEP)


_ARG_END = (CLOSE, "argument", SEP)
_WEATHER = _call("get_weather")
_CITY = (*_WEATHER, *_arg("city", "string"), "Paris", *_ARG_END)
_PRICE = (*_call("set_price"), *_arg("amount", "number"))
_PRICE_CURRENCY = (*_PRICE, "12.5", *_ARG_END, *_arg("currency", "string"))
_SEARCH = _call("search")
_GUEST = (*_call("book"), *_arg("guest", "object"), "{", '"name": ', '"')
_NIGHTS = (*_GUEST, "Ann", '"', "}", *_ARG_END, *_arg("nights", "array"), "[")

# (what the row is, its channel: "required" or the named tool, its output pieces)
MASKED_ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tool name", "required", (*PROMPT_END, *OPENING)),
    ("call index digits", "required", (*_WEATHER[:-3], "1")),
    ("key or call close", "required", _CITY),
    ("key (days or unit)", "required", (*_CITY, OPEN, "argument", ' key="')),
    ("string value", "required", (*_WEATHER, *_arg("city", "string"), "Par")),
    ("integer value, start", "required", (*_CITY, *_arg("days", "number"))),
    ("integer value, digits", "required", (*_CITY, *_arg("days", "number"), "1")),
    ("number value, fraction", "required", (*_PRICE, "12", ".")),
    ("number value, exponent", "required", (*_PRICE, "12", "e")),
    ("enum value", "required", _PRICE_CURRENCY),
    ("boolean value", "required", (*_PRICE_CURRENCY, "EUR", *_ARG_END, *_arg("exact", "boolean"))),
    ("JSON: string in a nested object", "required", (*_GUEST, "Ann")),
    ("JSON: key or object close", "required", (*_GUEST, "Ann", '"')),
    ("JSON: array item or close", "required", _NIGHTS),
    ("JSON: item separator or close", "required", (*_NIGHTS, '"', "Mon", '"')),
    ("next call or close", "required", (*_SEARCH, *_arg("query", "string"), "x", *_ARG_END,
                                        CLOSE, "call", SEP)),
)  # fmt: skip
NAMED_ROWS = (
    ("named: key or close", "get_weather", _CITY),
    ("named: string value", "search", (*_SEARCH, *_arg("query", "string"), "how")),
    ("named: number value", "set_price", (*_PRICE, "3")),
    ("named: forced name", "set_price", (*PROMPT_END, *OPENING)),
    ("named: JSON array item or close", "book", _NIGHTS),
)
FORCED_ROWS = (
    ("forced: opening", "required", (*PROMPT_END, OPEN)),
    ("forced: call head", "required", (*PROMPT_END, *OPENING[:3], OPEN)),
    ("forced: argument close", "required", (*_WEATHER, *_arg("city", "string"), "P", CLOSE)),
    ("forced: key piece", "required", (*_CITY, OPEN, "argument")),
)
WAITING_ROWS = (("waiting", "required", ("Sure",)),)
# Rows per group and how many times each group's kinds repeat to fill them.
GROUPS = (("required in calls", MASKED_ROWS, 96), ("named", NAMED_ROWS, 32))
GROUPS += (("forced prefix", FORCED_ROWS, 32), ("waiting", WAITING_ROWS, 32))
FREE_ROWS = BATCH - sum(n for _, _, n in GROUPS)


def encode_pieces(tokenizer, pieces: Sequence[str]) -> list[int]:
    """Each piece on its own, control tokens as specials (as K3's encoder does)."""
    return [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]


@dataclass
class Row:
    what: str
    group: str
    channel: str  # "required", a tool name, or "" without a channel
    ids: list[int]
    state: int  # local state in its channel (UNCONSTRAINED without one)


class CallsBatch:
    """The mixed batch: its rows, the core holding their states, and the shared tables."""

    def __init__(self, tokenizer, device, classes: TokenClasses | None = None) -> None:
        self.tokenizer = tokenizer
        self.classes = classes or classes_for_tokenizer(tokenizer, len(tokenizer))
        required = required_channel_for(tokenizer)
        if required is None:
            raise ValueError("the tokenizer cannot carry the K3 required channel")

        def with_calls(name: str | None, parallel: bool) -> RequiredChannel:
            spec = call_spec_for(tokenizer, TOOLS, name=name, parallel=parallel)
            return required.with_calls(CallAutomaton(spec, self.classes))

        self.channels = {"required": with_calls(None, True)}
        for tool in TOOLS:
            name = tool["function"]["name"]
            self.channels[name] = with_calls(name, False)
        self.rows: list[Row] = []
        for group, kinds, count in GROUPS:
            for i in range(count):
                what, channel, pieces = kinds[i % len(kinds)]
                ids = encode_pieces(tokenizer, pieces)
                state = walk_allowed(self.channels[channel], ids, what)
                self.rows.append(Row(what, group, channel, ids, state))
        self.rows += [Row("free", "free", "", [], UNCONSTRAINED)] * FREE_ROWS
        self.core = ChannelCore(BATCH, device, impl="triton")
        for slot, row in enumerate(self.rows):
            if row.channel:
                self.core.assign(slot, self.channels[row.channel], row.state)
        self.core.flush()
        self.slots = np.arange(BATCH)

    def count(self, predicate) -> int:
        return sum(1 for r in self.rows if r.channel and predicate(self.channels[r.channel], r))

    def describe(self) -> str:
        masked = self.count(lambda c, r: c.is_masked(r.state))
        forced = self.count(lambda c, r: c.forced_token(r.state) is not None)
        waiting = self.count(lambda c, r: c.is_waiting(r.state))
        kinds = len({r.what for r in self.rows if r.channel})
        return (
            f"{masked} masked rows (names, digits, keys, typed values, JSON inside arguments: "
            f"{kinds} kinds of rows over {len(TOOLS)} schemas), {forced} forced, {waiting} "
            f"waiting, {FREE_ROWS} free; {self.core.num_channels} channels (required + "
            f"{self.core.num_channels - 1} named, all with calls)"
        )

    @property
    def forced_rows(self) -> int:
        return self.count(lambda c, r: c.forced_token(r.state) is not None)

    def apply(self, logits: torch.Tensor) -> int:
        return self.core.apply(logits, self.slots)

    def allowed(self, vocab: int) -> np.ndarray:
        """[BATCH, vocab] bool: the ids each row allows, from the state machine (host)."""
        out = np.ones((BATCH, vocab), dtype=bool)
        for r, row in enumerate(self.rows):
            if row.channel:
                out[r] = row_allowed(self.channels[row.channel], row.state, vocab)
        return out

    def bitmask(self, vocab: int, device) -> torch.Tensor:
        """xgrammar's int32 bitmask [BATCH, ceil(vocab / 32)] giving this step's mask."""
        return pack_bitmask(self.allowed(vocab), device)


def row_allowed(channel: RequiredChannel, state: int, vocab: int) -> np.ndarray:
    """[vocab] bool: the ids `channel` allows in `state` (end ids banned until the end)."""
    forced = channel.forced_token(state)
    if forced is not None:
        out = np.zeros(vocab, dtype=bool)
        out[forced] = True
        return out
    call = channel.call_state(state)
    if call is None:
        out = np.ones(vocab, dtype=bool)
    else:
        of = channel.calls.token_classes.of[:vocab]
        out = np.zeros(vocab, dtype=bool)
        out[: len(of)] = np.isin(of, list(channel.calls.classes(call)))
        out[[t for t in channel.calls.edges(call) if t < vocab]] = True
    out[[t for t in channel.end_ids if t < vocab]] = False
    return out


def walk_allowed(channel: RequiredChannel, ids: Sequence[int], what: str) -> int:
    """The channel's state after `ids`, each of which must be allowed where it is written."""
    state = START
    for token in ids:
        call = channel.call_state(state)
        if call is not None and channel.calls.step(call, token) is None:
            raise ValueError(f"row {what!r}: id {token} is not allowed in call state {call}")
        forced = channel.forced_token(state)
        if forced is not None and forced != token:
            raise ValueError(f"row {what!r}: id {token} written where {forced} is forced")
        state = channel.step(state, token)
    return state


class XgrammarFill:
    """xgrammar's host-side bitmask fill for the batch's constrained rows (vLLM's tag)."""

    def __init__(self, batch: CallsBatch) -> None:
        import xgrammar as xgr
        from vllm.tool_parsers.structural_tag_registry import get_kimi_k3_structural_tag
        from xgrammar.openai_tool_call_schema import FunctionToolParam

        tokenizer = batch.tokenizer
        info = xgr.TokenizerInfo(
            list(tokenizer.pieces),
            vocab_size=len(tokenizer),
            stop_token_ids=[tokenizer.token_id(END_OF_MSG)],
        )
        compiler = xgr.GrammarCompiler(info)
        tools = {t["function"]["name"]: FunctionToolParam.model_validate(t) for t in TOOLS}
        t0 = time.perf_counter()
        grammars = {
            "required": get_kimi_k3_structural_tag(list(tools.values()), [], "required", False)
        }
        for name, tool in tools.items():
            grammars[name] = get_kimi_k3_structural_tag([tool], [], "forced", False)
        compiled = {k: compiler.compile_structural_tag(v) for k, v in grammars.items()}
        self.compile_seconds = time.perf_counter() - t0
        self.matchers = []
        for row in batch.rows:
            if not row.channel:
                continue
            matcher = xgr.GrammarMatcher(compiled[row.channel])
            for token in row.ids:
                if not matcher.accept_token(token):
                    raise ValueError(f"xgrammar refuses id {token} of row {row.what!r}")
            self.matchers.append(matcher)
        self.bitmask = xgr.allocate_token_bitmask(len(self.matchers), len(tokenizer))

    @property
    def rows(self) -> int:
        return len(self.matchers)

    def fill(self) -> None:
        for index, matcher in enumerate(self.matchers):
            matcher.fill_next_token_bitmask(self.bitmask, index)


def class_build_seconds(tokenizer, vocab: int) -> tuple[float, int]:
    """Seconds to build the token classes of `tokenizer` at logits width `vocab` (uncached),
    and how many classes it has."""
    from atom_plugin.k3 import token_classes

    token_classes._cached.cache_clear()  # an engine builds them once: time that build
    t0 = time.perf_counter()
    classes = classes_for_tokenizer(tokenizer, vocab)
    return time.perf_counter() - t0, classes.num_classes
