"""Required channels laid out as device tensors, so states advance on the GPU.

Several channels (the required one, named ones, each with the engine's stop ids
of its requests, each with its request's calls) share one state space: channel
c's local state s is the global state `bases[c] + s`, and UNCONSTRAINED (-1) is
common to all. So one kernel launch serves a batch whose rows hold any mix of
channels, and a row needs nothing but its global state.

Each channel keeps its own transition rows: a row has one column per id of the
channel's own (`channel_ids`: its `after`, its opening's head and its calls'
explicit ids) and one per token class (one class for a channel without calls), so
a state's row is `next_state[row_off[s] : row_off[s] + K_c + C_c]`. The kernel
finds a token's column among the ids of the state's channel (`channel_ids[c]`,
padded with -1), else its class's. Rows of different channels never share
columns, so adding a channel appends its rows and touches no other channel's:
`SharedTables` grows the device tensors by the new channel's bytes only.

Call states that allow several ids are masked: an id is allowed when it is one
of the state's allowed ids (`allow_ids[allow_off[s] : + allow_len[s]]`) or its
class is set in the state's `class_bits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atom_plugin.k3.call_table import FINAL
from atom_plugin.k3.required_channel import UNCONSTRAINED, RequiredChannel
from atom_plugin.k3.token_classes import SPECIAL


@dataclass(frozen=True)
class ChannelTables:
    """Device tensors of a set of channels (int32 unless said otherwise).

    channels, bases: channel c's states are `bases[c] .. bases[c] + num_states - 1`.
    max_id: the largest id any channel uses (a host int, checked against the logits width).

    Per state s: forced[s] (the id s forces, -1 when none); waiting[s] (bool: s bans
    its end ids and forces nothing; an optional channel's waiting states ban nothing);
    masked[s] (bool: s allows the ids below and nothing else, and bans its end ids);
    class_bits[s] (int64, bit c set when s allows every id of class c); end_ids[s, e]
    (the ids s bans unless forced, padded with -1); state_channel[s]; row_off[s]
    (int64, where s's row starts in next_state); allow_off[s] (int64) and
    allow_len[s] (s's allowed ids in allow_ids).
    Per channel c: channel_ids[c, k] (its own ids, padded with -1), channel_k[c] (how
    many) and channel_classes[c] (its class columns: 1 without calls).
    next_state: the rows, flat; a row's column K_c + class is every other id of that
    class. token_class[t]: id t's class (ids past its end are SPECIAL); one 0 without calls.
    """

    channels: tuple[RequiredChannel, ...]
    bases: tuple[int, ...]
    max_id: int
    max_allowed: int  # the most ids one state allows by name (at least 1)
    forced: torch.Tensor
    waiting: torch.Tensor
    masked: torch.Tensor
    class_bits: torch.Tensor
    end_ids: torch.Tensor
    state_channel: torch.Tensor
    row_off: torch.Tensor
    allow_off: torch.Tensor
    allow_len: torch.Tensor
    channel_ids: torch.Tensor
    channel_k: torch.Tensor
    channel_classes: torch.Tensor
    next_state: torch.Tensor
    allow_ids: torch.Tensor
    token_class: torch.Tensor

    @property
    def has_masked(self) -> bool:
        """Whether any state is masked (only call automata make such states)."""
        return any(c.calls is not None for c in self.channels)

    @property
    def num_channel_ids(self) -> int:
        """Columns of `channel_ids`: the most ids of any one channel."""
        return self.channel_ids.shape[1]

    @property
    def num_end_ids(self) -> int:
        """Columns of `end_ids` (the most end ids of any channel, at least 1)."""
        return self.end_ids.shape[1]

    @property
    def num_states(self) -> int:
        return sum(c.num_states for c in self.channels)

    def check_vocab(self, vocab: int) -> None:
        """Refuse logits too narrow for the channels' ids (the kernel would write past a row)."""
        if self.max_id >= vocab:
            what = repr(self.channels[0]) if len(self.channels) == 1 else "its channels"
            raise ValueError(
                f"logits have {vocab} columns but the channel uses ids up to {self.max_id} ({what})"
            )


@dataclass(frozen=True)
class ChannelBlock:
    """One channel's rows on the host, in its local state numbers (built with numpy)."""

    ids: np.ndarray  # [K] the channel's own ids, ascending
    num_classes: int  # its class columns
    forced: np.ndarray  # [S]
    waiting: np.ndarray  # [S] bool
    masked: np.ndarray  # [S] bool
    class_bits: np.ndarray  # [S] int64
    end_ids: np.ndarray  # [S, E]
    next_state: np.ndarray  # [S, K + C], local states or UNCONSTRAINED
    allow_len: np.ndarray  # [S]
    allow_ids: np.ndarray  # the masked states' allowed ids, in state order
    max_id: int

    @property
    def num_states(self) -> int:
        return len(self.forced)

    @property
    def nbytes(self) -> int:
        return (
            sum(
                getattr(self, f).nbytes
                for f in ("forced", "waiting", "masked", "class_bits", "end_ids", "next_state")
            )
            + self.allow_ids.nbytes
        )


def channel_block(channel: RequiredChannel) -> ChannelBlock:
    """`channel`'s rows. The waiting and forced states (a few) step through the state
    machine; the call states come from the call table's edge arrays in numpy."""
    ids = np.asarray(channel.channel_ids, dtype=np.int32)
    num_classes = channel.num_classes
    n = channel.num_states
    head = channel.calls_base if channel.calls is not None else n
    next_state = np.empty((n, len(ids) + num_classes), np.int32)
    forced = np.full(n, -1, np.int32)
    waiting = np.zeros(n, bool)
    for s in range(head):
        next_state[s, : len(ids)] = [channel.step(s, int(t)) for t in ids]
        next_state[s, len(ids) :] = [channel.step_class(s, c) for c in range(num_classes)]
        forced[s] = -1 if channel.forced_token(s) is None else channel.forced_token(s)
        waiting[s] = channel.bans_while_waiting(s)
    masked = np.zeros(n, bool)
    class_bits = np.zeros(n, np.int64)
    allow_len = np.zeros(n, np.int32)
    allow_ids = np.zeros(0, np.int32)
    if channel.calls is not None:
        table = _call_rows(channel, ids, head)
        next_state[head:], forced[head:], masked[head:], class_bits[head:] = table[:4]
        allow_len[head:], allow_ids = table[4:]
    ends = np.array(sorted(channel.end_ids), np.int32)
    end_ids = np.tile(ends, (n, 1))
    if channel.optional:
        end_ids[: channel.num_waiting] = -1  # an optional channel bans nothing while waiting
    return ChannelBlock(
        ids=ids,
        num_classes=num_classes,
        forced=forced,
        waiting=waiting,
        masked=masked,
        class_bits=class_bits,
        end_ids=end_ids,
        next_state=next_state,
        allow_len=allow_len,
        allow_ids=allow_ids,
        max_id=max((*channel.channel_ids, *channel.opening, *channel.end_ids)),
    )


def _call_rows(channel: RequiredChannel, ids: np.ndarray, base: int):
    """(next_state, forced, masked, class_bits, allow_len, allow_ids) of the call states."""
    calls = channel.calls
    classes = calls.token_classes
    count = calls.num_states
    stay = base + np.arange(count, dtype=np.int32)  # a disallowed token is a rejected draft

    def target(dst: np.ndarray) -> np.ndarray:
        return np.where(dst == FINAL, UNCONSTRAINED, dst + base).astype(np.int32)

    by_class = np.repeat(stay[:, None], classes.num_classes, axis=1)
    class_src = np.repeat(np.arange(count), calls.class_counts)
    by_class[class_src, calls.class_cls] = target(calls.class_dst)
    id_class = np.where(
        ids < classes.vocab, classes.of[np.minimum(ids, classes.vocab - 1)], SPECIAL
    )
    by_id = by_class[:, id_class]  # an id without an edge of its own takes its class's
    edge_src = np.repeat(np.arange(count), calls.edge_counts)
    by_id[edge_src, np.searchsorted(ids, calls.edge_tok)] = target(calls.edge_dst)
    first = calls.edge_tok[np.minimum(calls.edge_ptr[:-1], max(len(calls.edge_tok) - 1, 0))]
    one = (calls.edge_counts == 1) & (calls.class_counts == 0)
    forced = np.where(one, first, -1).astype(np.int32)
    masked = ~one
    bits = np.zeros(count, np.int64)
    np.add.at(bits, class_src, np.left_shift(np.int64(1), calls.class_cls.astype(np.int64)))
    allow_len = np.where(masked, calls.edge_counts, 0).astype(np.int32)
    allow_ids = calls.edge_tok[masked[edge_src]].astype(np.int32)
    return np.concatenate([by_id, by_class], axis=1), forced, masked, bits, allow_len, allow_ids


class _Grown:
    """A device tensor that grows by appending rows (its capacity doubles)."""

    def __init__(self, device: torch.device, dtype: np.dtype, width: int | None = None) -> None:
        self.width = width
        self.size = 0
        self.dev = torch.from_numpy(np.zeros(self._shape(16), dtype)).to(device)

    def _shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)

    def append(self, values: np.ndarray) -> int:
        """Append `values` (rows); returns where they start. Only they cross to the device;
        a larger capacity copies the rows held so far on the device."""
        at, n = self.size, len(values)
        if at + n > len(self.dev):
            grown = self.dev.new_empty(self._shape(max(2 * len(self.dev), at + n)))
            grown[:at].copy_(self.dev[:at])
            self.dev = grown
        if n:
            self.dev[at : at + n].copy_(torch.from_numpy(np.ascontiguousarray(values)))
        self.size = at + n
        return at

    def widen(self, width: int, fill: int) -> None:
        """More columns (padded with `fill`), copied on the device."""
        wide = self.dev.new_full((len(self.dev), width), fill)
        wide[:, : self.width].copy_(self.dev)
        self.dev, self.width = wide, width

    def view(self) -> torch.Tensor:
        return self.dev[: self.size]


class SharedTables:
    """The shared tables of a growing set of channels on `device`.

    `add(channel)` lays out the new channel's rows (numpy, from its block) and copies
    only them to the device; the other channels' rows are not touched. A channel's
    state count, ids or end ids wider than any before widen the small per-channel id
    table or the end-id table. `tables()` is the current `ChannelTables`.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.channels: list[RequiredChannel] = []
        self.blocks: list[ChannelBlock] = []
        self.bases: list[int] = []
        self._per_state = {
            "forced": _Grown(self.device, np.int32),
            "waiting": _Grown(self.device, np.bool_),
            "masked": _Grown(self.device, np.bool_),
            "class_bits": _Grown(self.device, np.int64),
            "state_channel": _Grown(self.device, np.int32),
            "row_off": _Grown(self.device, np.int64),
            "allow_off": _Grown(self.device, np.int64),
            "allow_len": _Grown(self.device, np.int32),
        }
        self._end_ids = _Grown(self.device, np.int32, width=1)
        self._next = _Grown(self.device, np.int32)
        self._allow = _Grown(self.device, np.int32)
        self._channel_ids = np.full((0, 1), -1, np.int32)
        self._token_class: torch.Tensor | None = None
        self._classes = None
        self._max_id = 0
        self._max_allowed = 1
        self.laid_out = 0  # channels laid out (each once, by add)

    @property
    def num_states(self) -> int:
        return self._per_state["forced"].size

    def add(self, channel: RequiredChannel, block: ChannelBlock | None = None) -> int:
        """Append `channel` (its rows from `block` when given); returns its index."""
        if channel.calls is not None:
            classes = channel.calls.token_classes
            if self._classes is not None and classes is not self._classes:
                raise ValueError(
                    "channels with calls must share one vocabulary's token classes, got two"
                )
            if self._classes is None:
                self._classes = classes
                self._token_class = torch.from_numpy(classes.of).to(self.device, torch.int32)
        block = channel_block(channel) if block is None else block
        index, base = len(self.channels), self.num_states
        n = block.num_states
        width = block.next_state.shape[1]
        rows = np.where(block.next_state >= 0, block.next_state + base, UNCONSTRAINED)
        row_start = self._next.append(rows.astype(np.int32).reshape(-1))
        allow_start = self._allow.append(block.allow_ids)
        allow_off = allow_start + np.concatenate([[0], np.cumsum(block.allow_len[:-1])])
        columns = {
            "forced": block.forced,
            "waiting": block.waiting,
            "masked": block.masked,
            "class_bits": block.class_bits,
            "state_channel": np.full(n, index, np.int32),
            "row_off": row_start + width * np.arange(n, dtype=np.int64),
            "allow_off": allow_off.astype(np.int64),
            "allow_len": block.allow_len,
        }
        for name, values in columns.items():
            self._per_state[name].append(values)
        ends = block.end_ids
        if ends.shape[1] > self._end_ids.width:
            self._end_ids.widen(ends.shape[1], -1)
        padded = np.full((n, self._end_ids.width), -1, np.int32)
        padded[:, : ends.shape[1]] = ends
        self._end_ids.append(padded)
        k = max(self._channel_ids.shape[1], len(block.ids), 1)
        ids = np.full((index + 1, k), -1, np.int32)
        ids[:index, : self._channel_ids.shape[1]] = self._channel_ids
        ids[index, : len(block.ids)] = block.ids
        self._channel_ids = ids
        self._max_id = max(self._max_id, block.max_id)
        self._max_allowed = max(self._max_allowed, int(block.allow_len.max(initial=0)))
        self.channels.append(channel)
        self.blocks.append(block)
        self.bases.append(base)
        self.laid_out += 1
        return index

    def tables(self) -> ChannelTables:
        if not self.channels:
            raise ValueError("no channel has been added")
        per_channel = [(len(b.ids), b.num_classes) for b in self.blocks]
        device = self.device
        return ChannelTables(
            channels=tuple(self.channels),
            bases=tuple(self.bases),
            max_id=self._max_id,
            max_allowed=self._max_allowed,
            **{name: grown.view() for name, grown in self._per_state.items()},
            end_ids=self._end_ids.view(),
            channel_ids=torch.from_numpy(self._channel_ids).to(device),
            channel_k=torch.tensor([k for k, _ in per_channel], dtype=torch.int32, device=device),
            channel_classes=torch.tensor(
                [c for _, c in per_channel], dtype=torch.int32, device=device
            ),
            next_state=self._next.view(),
            allow_ids=self._allow.view() if self._allow.size else self._allow.dev[:1],
            token_class=self._token_class
            if self._token_class is not None
            else torch.zeros(1, dtype=torch.int32, device=device),
        )

    def subset(self, indices: Sequence[int]) -> SharedTables:
        """New tables holding only the channels at `indices`, in that order (their blocks
        are reused: nothing is laid out again)."""
        out = SharedTables(self.device)
        for i in indices:
            out.add(self.channels[i], self.blocks[i])
        out.laid_out = self.laid_out
        return out


def state_bases(channels: Sequence[RequiredChannel]) -> list[int]:
    """Each channel's base when `channels` share one state space, in this order."""
    sizes = [c.num_states for c in channels]
    return [int(b) for b in np.cumsum([0, *sizes[:-1]])] if sizes else []


def compile_channels(
    channels: Sequence[RequiredChannel], device: torch.device | str
) -> ChannelTables:
    """The shared tables of `channels` on `device`."""
    channels = tuple(channels)
    if not channels:
        raise ValueError("compile_channels needs at least one channel, got none")
    if len(set(channels)) != len(channels):
        raise ValueError(f"channels must be distinct, got {list(channels)}")
    shared = SharedTables(device)
    for channel in channels:
        shared.add(channel)
    return shared.tables()


def compile_channel(channel: RequiredChannel, device: torch.device | str) -> ChannelTables:
    """One channel's tables (its states are its local ones: base 0)."""
    return compile_channels((channel,), device)


def token_columns(tables: ChannelTables, states: torch.Tensor, tokens: torch.Tensor):
    """(safe states, each token's column in its state's row) as torch ops."""
    safe = states.clamp(min=0).long()
    channel = tables.state_channel[safe].long()
    hits = tokens.long().unsqueeze(-1) == tables.channel_ids[channel]
    classes = tables.token_class
    cls = classes[tokens.long().clamp(0, classes.numel() - 1)].long()
    cls = torch.where(tokens.long() < classes.numel(), cls, SPECIAL)
    cls = torch.where(tables.channel_classes[channel] > 1, cls, 0)
    other = tables.channel_k[channel].long() + cls
    return safe, torch.where(hits.any(-1), hits.int().argmax(-1), other)


def next_states(tables: ChannelTables, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every state stepped by its token, elementwise, as torch ops without a host sync."""
    safe, column = token_columns(tables, states, tokens)
    stepped = tables.next_state[tables.row_off[safe] + column]
    return torch.where(states == UNCONSTRAINED, states, stepped)
