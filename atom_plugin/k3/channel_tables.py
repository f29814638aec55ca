"""Required channels compiled into small device tensors, so states advance on the GPU.

Several channels (the required one, one per tool name of named choices, each
with the engine's stop ids of its requests) share one state space: channel c's
local state s is the global state `bases[c] + s`, and UNCONSTRAINED (-1) is
common to all. So one kernel launch serves a batch whose rows hold any mix of
channels, and a row needs nothing but its global state.

Only the channels' own ids (those of `after`, of the opening's head and the call
automata's explicit ids) change a state in a way of their own, so the transition
table has one column per such id (over all channels) plus one column per token
class (token_classes.py) for every other token: channels without calls have a
single class, and their class columns all say the same. Forced states advance
by position whatever the token; UNCONSTRAINED is absorbing and has no row.

Call states that allow several ids are masked: an id is allowed when it is one
of the state's `allow_ids` or its class is set in the state's `class_bits`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atom_plugin.k3.required_channel import UNCONSTRAINED, RequiredChannel
from atom_plugin.k3.token_classes import SPECIAL


@dataclass(frozen=True)
class ChannelTables:
    """Device tensors of a set of channels (int32 unless said otherwise).

    channels, bases: channel c's states are `bases[c] .. bases[c] + num_states - 1`.
    max_id: the largest id any channel uses (a host int, checked against the logits width).

    forced[s]: the id state s forces, -1 when it forces nothing.
    waiting[s]: bool, s bans its end ids and forces nothing (an optional channel's
      waiting states are not: they ban nothing, and their end_ids rows are -1).
    channel_ids[k]: the ids with their own column, ascending.
    next_state[s, k]: the state after channel_ids[k]; column K + c is every other
      id of class c.
    end_ids[s, e]: the ids state s bans unless it is forced, padded with -1.
    token_class[t]: id t's class (ids past its end are SPECIAL); one 0 without calls.
    masked[s]: bool, s allows the ids below and nothing else (and bans its end ids).
    class_bits[s]: int64, bit c set when s allows every id of class c.
    allow_ids[s, a]: the ids s allows by name, padded with -1.
    """

    channels: tuple[RequiredChannel, ...]
    bases: tuple[int, ...]
    max_id: int
    forced: torch.Tensor
    waiting: torch.Tensor
    channel_ids: torch.Tensor
    next_state: torch.Tensor
    end_ids: torch.Tensor
    token_class: torch.Tensor
    masked: torch.Tensor
    class_bits: torch.Tensor
    allow_ids: torch.Tensor

    @property
    def num_classes(self) -> int:
        return self.next_state.shape[1] - self.num_channel_ids

    @property
    def num_allow_ids(self) -> int:
        return self.allow_ids.shape[1]

    @property
    def has_masked(self) -> bool:
        """Whether any state is masked (only call automata make such states)."""
        return any(c.calls is not None for c in self.channels)

    @property
    def num_channel_ids(self) -> int:
        return self.channel_ids.numel()

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


@dataclass(frozen=True)
class _Local:
    """One channel's tables on the host, in its local state numbers."""

    forced: np.ndarray  # [S]
    waiting: np.ndarray  # [S] bool
    next_state: np.ndarray  # [S, K + C], local states or UNCONSTRAINED
    masked: np.ndarray  # [S] bool
    class_bits: np.ndarray  # [S] int64
    allow_ids: list[list[int]]  # per state


@functools.lru_cache(maxsize=1024)
def _local(channel: RequiredChannel) -> _Local:
    states = range(channel.num_states)
    classes = range(channel.num_classes)
    masked = np.array([channel.is_masked(s) for s in states], bool)
    bits = np.zeros(channel.num_states, np.int64)
    allow: list[list[int]] = [[] for _ in states]
    for s in np.flatnonzero(masked):
        node = channel.calls.states[channel.call_state(int(s))]
        bits[s] = sum(1 << c for c in node.classes)
        allow[s] = sorted(node.edges)
    return _Local(
        forced=np.array([_or_minus_one(channel.forced_token(s)) for s in states], np.int32),
        waiting=np.array([channel.bans_while_waiting(s) for s in states], bool),
        next_state=np.array(
            [
                [*(channel.step(s, t) for t in channel.channel_ids)]
                + [channel.step_class(s, c) for c in classes]
                for s in states
            ],
            np.int32,
        ).reshape(channel.num_states, len(channel.channel_ids) + channel.num_classes),
        masked=masked,
        class_bits=bits,
        allow_ids=allow,
    )


def _token_classes(channels: Sequence[RequiredChannel]):
    """The one vocabulary's classes the channels' calls use, None without calls."""
    found = {id(c.calls.token_classes): c.calls.token_classes for c in channels if c.calls}
    if len(found) > 1:
        raise ValueError(
            f"channels with calls must share one vocabulary's token classes, got {len(found)}"
        )
    return next(iter(found.values()), None)


def state_bases(channels: Sequence[RequiredChannel]) -> list[int]:
    """Each channel's base when `channels` share one state space, in this order."""
    sizes = [c.num_states for c in channels]
    return [int(b) for b in np.cumsum([0, *sizes[:-1]])] if sizes else []


def compile_channels(
    channels: Sequence[RequiredChannel], device: torch.device | str
) -> ChannelTables:
    """The shared tables of `channels` on `device` (built per new channel, not per step)."""
    channels = tuple(channels)
    if not channels:
        raise ValueError("compile_channels needs at least one channel, got none")
    if len(set(channels)) != len(channels):
        raise ValueError(f"channels must be distinct, got {list(channels)}")
    union = sorted(set().union(*(c.channel_ids for c in channels)))
    width = max(1, *(len(c.end_ids) for c in channels))
    classes = _token_classes(channels)
    num_classes = 1 if classes is None else classes.num_classes
    allow_width = max([1, *(len(a) for c in channels for a in _local(c).allow_ids)])
    bases = state_bases(channels)
    forced, waiting, next_state, end_ids = [], [], [], []
    masked, class_bits, allow_ids = [], [], []
    for channel, base in zip(channels, bases, strict=True):
        local = _local(channel)
        own = {t: k for k, t in enumerate(channel.channel_ids)}
        other = len(own)
        many = channel.num_classes > 1  # else its one class column serves every class

        def column(cls: int, many=many, other=other) -> int:
            return other + (cls if many else 0)

        of = (lambda t: 0) if classes is None else classes.class_of
        columns = [own.get(t, column(of(t))) for t in union]
        columns += [column(c) for c in range(num_classes)]
        stepped = local.next_state[:, columns]
        next_state.append(np.where(stepped >= 0, stepped + base, UNCONSTRAINED))
        forced.append(local.forced)
        waiting.append(local.waiting)
        masked.append(local.masked)
        class_bits.append(local.class_bits)
        allow_ids.append(
            np.array([a + [-1] * (allow_width - len(a)) for a in local.allow_ids], np.int32)
        )
        ends = sorted(channel.end_ids) + [-1] * (width - len(channel.end_ids))
        rows = np.tile(np.array(ends, np.int32), (channel.num_states, 1))
        if channel.optional:
            rows[: channel.num_waiting] = -1  # an optional channel bans nothing while waiting
        end_ids.append(rows)

    def tensor(parts, dtype=torch.int32):
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts))).to(
            device=device, dtype=dtype
        )

    return ChannelTables(
        channels=channels,
        bases=tuple(bases),
        max_id=max(max((*c.channel_ids, *c.opening, *c.end_ids)) for c in channels),
        forced=tensor(forced),
        waiting=tensor(waiting, torch.bool),
        channel_ids=torch.tensor(union, dtype=torch.int32, device=device),
        next_state=tensor(next_state),
        end_ids=tensor(end_ids),
        token_class=torch.zeros(1, dtype=torch.int32, device=device)
        if classes is None
        else torch.from_numpy(classes.of).to(device=device, dtype=torch.int32),
        masked=tensor(masked, torch.bool),
        class_bits=tensor(class_bits, torch.int64),
        allow_ids=tensor(allow_ids),
    )


def compile_channel(channel: RequiredChannel, device: torch.device | str) -> ChannelTables:
    """One channel's tables (its states are its local ones: base 0)."""
    return compile_channels((channel,), device)


def _or_minus_one(token: int | None) -> int:
    return -1 if token is None else token


def next_states(tables: ChannelTables, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every state stepped by its token, elementwise, as torch ops without a host sync."""
    hits = (tokens.unsqueeze(-1) == tables.channel_ids).to(torch.int32)
    classes = tables.token_class
    cls = classes[tokens.long().clamp(0, classes.numel() - 1)]
    if classes.numel() > 1:
        cls = torch.where(tokens.long() < classes.numel(), cls, SPECIAL)
    column = torch.where(hits.any(-1), hits.argmax(-1), tables.num_channel_ids + cls)
    stepped = tables.next_state[states.clamp(min=0).long(), column]
    return torch.where(states == UNCONSTRAINED, states, stepped)
