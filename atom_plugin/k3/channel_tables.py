"""Required channels laid out as device tensors, so states advance on the GPU.

Several channels (the required one, named ones, each with the engine's stop ids
of its requests, each with its request's calls) share one state space: channel
c's local state s is the global state `bases[c] + s`, and UNCONSTRAINED (-1) is
common to all. So one kernel launch serves a batch whose rows hold any mix of
channels, and a row needs nothing but its global state.

Each state keeps its transitions as the call table does (call_table.py): a list
of explicit edges (id -> state, ids ascending), a list of class edges (token
class -> state), and `other`, where any other id goes (START from a waiting
state, the next position from a forced one, the state itself from a call state:
there such an id can only be a rejected draft). A token takes its explicit edge
if it has one, else its class's, else `other`. The tables are as large as the
automata (states plus edges), and adding a channel appends its states and edges
and touches nothing else: `SharedTables` copies only the new channel's bytes.

A masked call state allows its explicit edges' ids and every id of a class set
in its `class_bits`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atom_plugin.k3.call_table import FINAL
from atom_plugin.k3.required_channel import START, UNCONSTRAINED, RequiredChannel
from atom_plugin.k3.token_classes import SPECIAL


@dataclass(frozen=True)
class ChannelTables:
    """Device tensors of a set of channels (int32 unless said otherwise).

    channels, bases: channel c's states are `bases[c] .. bases[c] + num_states - 1`.
    max_id: the largest id any channel uses (a host int, checked against the logits width).
    max_edges, max_class_edges: the most explicit / class edges of one state (host ints).

    Per state s: forced[s] (the id s forces, -1 when none); waiting[s] (bool: s bans its
    end ids and forces nothing; an optional channel's waiting states ban nothing);
    masked[s] (bool: s allows its explicit edges' ids and the classes in class_bits[s],
    int64, and bans its end ids); end_ids[s, e] (the ids s bans unless forced, padded
    with -1); other[s] (the state after an id with neither kind of edge); edge_off[s]
    (int64) and edge_len[s], class_off[s] (int64) and class_len[s]: where s's edges are.
    edge_tok, edge_dst, class_cls, class_dst: every state's edges, flat (global states).
    token_class[t]: id t's class (ids past its end are SPECIAL); one 0 without calls.
    """

    channels: tuple[RequiredChannel, ...]
    bases: tuple[int, ...]
    max_id: int
    max_edges: int
    max_class_edges: int
    forced: torch.Tensor
    waiting: torch.Tensor
    masked: torch.Tensor
    class_bits: torch.Tensor
    end_ids: torch.Tensor
    other: torch.Tensor
    edge_off: torch.Tensor
    edge_len: torch.Tensor
    class_off: torch.Tensor
    class_len: torch.Tensor
    edge_tok: torch.Tensor
    edge_dst: torch.Tensor
    class_cls: torch.Tensor
    class_dst: torch.Tensor
    token_class: torch.Tensor

    @functools.cached_property
    def has_masked(self) -> bool:
        """Whether any state is masked (only call automata make such states); read on each
        step, so found once per tables."""
        return any(c.calls is not None for c in self.channels)

    @property
    def num_end_ids(self) -> int:
        """Columns of `end_ids` (the most end ids of any channel, at least 1)."""
        return self.end_ids.shape[1]

    def check_vocab(self, vocab: int) -> None:
        """Refuse logits too narrow for the channels' ids (the kernel would write past a row)."""
        if self.max_id >= vocab:
            what = repr(self.channels[0]) if len(self.channels) == 1 else "its channels"
            raise ValueError(
                f"logits have {vocab} columns but the channel uses ids up to {self.max_id} ({what})"
            )


_PER_STATE = ("forced", "waiting", "masked", "class_bits", "other", "edge_len", "class_len")
_EDGES = ("edge_tok", "edge_dst", "class_cls", "class_dst")
# Columns that are not int32.
_DTYPES = {
    "waiting": np.bool_,
    "masked": np.bool_,
    "class_bits": np.int64,
    "edge_off": np.int64,
    "class_off": np.int64,
}


@dataclass(frozen=True)
class ChannelBlock:
    """One channel's states and edges on the host, in its local state numbers."""

    forced: np.ndarray  # [S]
    waiting: np.ndarray  # [S] bool
    masked: np.ndarray  # [S] bool
    class_bits: np.ndarray  # [S] int64
    other: np.ndarray  # [S] local state or UNCONSTRAINED
    edge_len: np.ndarray  # [S]
    class_len: np.ndarray  # [S]
    end_ids: np.ndarray  # [S, E]
    edge_tok: np.ndarray
    edge_dst: np.ndarray  # local states or UNCONSTRAINED
    class_cls: np.ndarray
    class_dst: np.ndarray
    max_id: int

    @property
    def num_states(self) -> int:
        return len(self.forced)


def channel_block(channel: RequiredChannel) -> ChannelBlock:
    """`channel`'s states and edges. The waiting and forced states (a few) step through
    the state machine; the call states are the call table's arrays, renumbered."""
    n = channel.num_states
    head = channel.calls_base if channel.calls is not None else n
    pattern_ids = sorted(set(channel.after) | set(channel.opening[: channel.opens_at]))
    parts: dict[str, list] = {name: [] for name in (*_PER_STATE, *_EDGES)}
    for s in range(head):
        waiting = channel.is_waiting(s)
        # Any other id sends a waiting state back to START and a forced one on by position.
        other = START if waiting else channel.step(s, channel.opening[s - channel.num_waiting])
        edges = {t: channel.step(s, t) for t in pattern_ids} if waiting else {}
        edges = {t: d for t, d in edges.items() if d != other}
        forced = channel.forced_token(s)
        values = {
            "forced": -1 if forced is None else forced,
            "waiting": channel.bans_while_waiting(s),
            "masked": False,
            "class_bits": 0,
            "other": other,
            "edge_len": len(edges),
            "class_len": 0,
        }
        for name, value in values.items():
            parts[name].append(np.array([value]))
        parts["edge_tok"].append(np.array(list(edges), np.int32))
        parts["edge_dst"].append(np.array(list(edges.values()), np.int32))
    if channel.calls is not None:
        for name, values in _call_states(channel).items():
            parts[name].append(values)
    arrays = {
        name: np.concatenate(values).astype(_DTYPES.get(name, np.int32))
        if values
        else np.zeros(0, np.int32)
        for name, values in parts.items()
    }
    ends = np.array(sorted(channel.end_ids), np.int32)
    end_ids = np.tile(ends, (n, 1))
    if channel.optional:
        end_ids[: channel.num_waiting] = -1  # an optional channel bans nothing while waiting
    calls_top = 0 if channel.calls is None else int(channel.calls.edge_tok.max(initial=0))
    return ChannelBlock(
        **arrays,
        end_ids=end_ids,
        max_id=max(*channel.after, *channel.opening, *channel.end_ids, calls_top),
    )


def _call_states(channel: RequiredChannel) -> dict[str, np.ndarray]:
    """The call states' columns and edges, in the channel's local numbers."""
    calls = channel.calls
    base = channel.calls_base
    count = calls.num_states

    def local(dst: np.ndarray) -> np.ndarray:
        return np.where(dst == FINAL, UNCONSTRAINED, dst + base).astype(np.int32)

    one = (calls.edge_counts == 1) & (calls.class_counts == 0)
    first = calls.edge_tok[np.minimum(calls.edge_ptr[:-1], max(len(calls.edge_tok) - 1, 0))]
    class_src = np.repeat(np.arange(count), calls.class_counts)
    bits = np.zeros(count, np.int64)
    np.add.at(bits, class_src, np.left_shift(np.int64(1), calls.class_cls.astype(np.int64)))
    return {
        "forced": np.where(one, first, -1),
        "waiting": np.zeros(count, np.bool_),
        "masked": ~one,
        "class_bits": bits,
        "other": base + np.arange(count),  # a token the state does not allow: a rejected draft
        "edge_len": calls.edge_counts,
        "class_len": calls.class_counts,
        "edge_tok": calls.edge_tok,
        "edge_dst": local(calls.edge_dst),
        "class_cls": calls.class_cls,
        "class_dst": local(calls.class_dst),
    }


class _Grown:
    """A device tensor that grows by appending rows (its capacity doubles).

    On a GPU only the new rows cross to the device, and a larger capacity copies the rows
    held so far on the device. On the CPU the tensor is a view of a numpy buffer, written
    in place (torch's CPU copies wait on its intra-op threads).
    """

    def __init__(self, device: torch.device, dtype: np.dtype, width: int | None = None) -> None:
        self.device, self.width = device, width
        self.size = 0
        self.host = np.zeros(self._shape(16), dtype) if device.type == "cpu" else None
        self.dev = (
            torch.from_numpy(self.host)
            if self.host is not None
            else torch.from_numpy(np.zeros(self._shape(16), dtype)).to(device)
        )

    def _shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)

    def append(self, values: np.ndarray) -> int:
        """Append `values` (rows); returns where they start."""
        at, n = self.size, len(values)
        if at + n > len(self.dev):
            capacity = max(2 * len(self.dev), at + n)
            if self.host is not None:
                host = np.empty(self._shape(capacity), self.host.dtype)
                host[:at] = self.host[:at]
                self.host, self.dev = host, torch.from_numpy(host)
            else:
                grown = self.dev.new_empty(self._shape(capacity))
                grown[:at].copy_(self.dev[:at])
                self.dev = grown
        if n and self.host is not None:
            self.host[at : at + n] = values
        elif n:
            self.dev[at : at + n].copy_(torch.from_numpy(np.ascontiguousarray(values)))
        self.size = at + n
        return at

    def widen(self, width: int, fill: int) -> None:
        """More columns (padded with `fill`)."""
        if self.host is not None:
            host = np.full((len(self.host), width), fill, self.host.dtype)
            host[:, : self.width] = self.host
            self.host, self.dev = host, torch.from_numpy(host)
        else:
            wide = self.dev.new_full((len(self.dev), width), fill)
            wide[:, : self.width].copy_(self.dev)
            self.dev = wide
        self.width = width

    def view(self) -> torch.Tensor:
        return self.dev[: self.size]


class SharedTables:
    """The shared tables of a growing set of channels on `device`.

    `add(channel)` builds the new channel's block (numpy) and copies only it to the
    device: the other channels' states and edges are not touched. `tables()` is the
    current `ChannelTables`.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.channels: list[RequiredChannel] = []
        self.blocks: list[ChannelBlock] = []
        self.bases: list[int] = []
        self._columns = {
            name: _Grown(self.device, _DTYPES.get(name, np.int32))
            for name in (*_PER_STATE, "edge_off", "class_off", *_EDGES)
        }
        self._end_ids = _Grown(self.device, np.int32, width=1)
        self._token_class: torch.Tensor | None = None
        self._classes = None
        self._max_id = 0
        self._max_edges = self._max_class_edges = 1
        self.laid_out = 0  # channels whose block add built (each once)

    @property
    def num_states(self) -> int:
        return self._columns["forced"].size

    def add(self, channel: RequiredChannel, block: ChannelBlock | None = None) -> int:
        """Append `channel` (its block when given); returns its index."""
        if channel.calls is not None:
            classes = channel.calls.token_classes
            if self._classes is not None and classes is not self._classes:
                raise ValueError(
                    "channels with calls must share one vocabulary's token classes, got two"
                )
            if self._classes is None:
                self._classes = classes
                self._token_class = torch.from_numpy(classes.of).to(self.device, torch.int32)
        if block is None:
            block = channel_block(channel)
            self.laid_out += 1
        index, base = len(self.channels), self.num_states

        def shifted(states: np.ndarray) -> np.ndarray:
            return np.where(states >= 0, states + base, UNCONSTRAINED).astype(np.int32)

        cols = self._columns
        edge_start = cols["edge_tok"].append(block.edge_tok)
        cols["edge_dst"].append(shifted(block.edge_dst))
        class_start = cols["class_cls"].append(block.class_cls)
        cols["class_dst"].append(shifted(block.class_dst))
        for name in _PER_STATE:
            values = getattr(block, name)
            cols[name].append(shifted(values) if name == "other" else values)
        for name, start, lengths in (
            ("edge_off", edge_start, block.edge_len),
            ("class_off", class_start, block.class_len),
        ):
            cols[name].append(start + np.concatenate([[0], np.cumsum(lengths[:-1])]))
        ends = block.end_ids
        if ends.shape[1] > self._end_ids.width:
            self._end_ids.widen(ends.shape[1], -1)
        padded = np.full((block.num_states, self._end_ids.width), -1, np.int32)
        padded[:, : ends.shape[1]] = ends
        self._end_ids.append(padded)
        self._max_id = max(self._max_id, block.max_id)
        self._max_edges = max(self._max_edges, int(block.edge_len.max(initial=0)))
        self._max_class_edges = max(self._max_class_edges, int(block.class_len.max(initial=0)))
        self.channels.append(channel)
        self.blocks.append(block)
        self.bases.append(base)
        return index

    def tables(self) -> ChannelTables:
        if not self.channels:
            raise ValueError("no channel has been added")
        columns = {}
        for name, grown in self._columns.items():
            # Kernels read through masks, so an empty edge list still needs a valid pointer.
            columns[name] = grown.view() if grown.size else grown.dev[:1]
        return ChannelTables(
            channels=tuple(self.channels),
            bases=tuple(self.bases),
            max_id=self._max_id,
            max_edges=self._max_edges,
            max_class_edges=self._max_class_edges,
            **columns,
            end_ids=self._end_ids.view(),
            token_class=self._token_class
            if self._token_class is not None
            else torch.zeros(1, dtype=torch.int32, device=self.device),
        )

    def subset(self, indices: Sequence[int]) -> SharedTables:
        """New tables holding only the channels at `indices`, in that order (their blocks
        are reused: nothing is laid out again)."""
        out = SharedTables(self.device)
        for i in indices:
            out.add(self.channels[i], self.blocks[i])
        out.laid_out = self.laid_out
        return out


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


def edge_window(
    off: torch.Tensor, length: torch.Tensor, keys: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the indices of keys[off:off + length] padded to `width` columns (clamped
    inside `keys`), and which columns are inside the row's edges."""
    a = torch.arange(max(width, 1), device=off.device)
    at = (off.unsqueeze(-1) + a).clamp(max=max(keys.numel() - 1, 0))
    return at, a < length.unsqueeze(-1)


def _lookup(off, length, keys, values, found_for, width):
    """Per row, the value of the key equal to `found_for` among keys[off:off + length]
    (at most `width`), and whether there was one."""
    at, inside = edge_window(off, length, keys, width)
    hit = inside & (keys[at] == found_for.unsqueeze(-1))
    picked = values[at.gather(-1, hit.int().argmax(-1, keepdim=True))].squeeze(-1)
    return picked, hit.any(-1)


def next_states(tables: ChannelTables, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every state stepped by its token, elementwise, as torch ops without a host sync."""
    safe = states.clamp(min=0).long()
    token = tokens.long()
    classes = tables.token_class
    cls = classes[token.clamp(0, classes.numel() - 1)].long()
    cls = torch.where(token < classes.numel(), cls, SPECIAL)
    by_id, has_id = _lookup(
        tables.edge_off[safe],
        tables.edge_len[safe],
        tables.edge_tok,
        tables.edge_dst,
        token,
        tables.max_edges,
    )
    by_class, has_class = _lookup(
        tables.class_off[safe],
        tables.class_len[safe],
        tables.class_cls,
        tables.class_dst,
        cls,
        tables.max_class_edges,
    )
    stepped = torch.where(has_id, by_id, torch.where(has_class, by_class, tables.other[safe]))
    return torch.where(states == UNCONSTRAINED, states, stepped.to(states.dtype))
