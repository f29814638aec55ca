"""Required channels compiled into small device tensors, so states advance on the GPU.

Several channels (the required one, one per tool name of named choices, each
with the engine's stop ids of its requests) share one state space: channel c's
local state s is the global state `bases[c] + s`, and UNCONSTRAINED (-1) is
common to all. So one kernel launch serves a batch whose rows hold any mix of
channels, and a row needs nothing but its global state.

Only the channels' own ids (those of `after` and of the opening's head) change a
waiting state in a way other than going back to its channel's START, so the
transition table has one column per such id (over all channels) plus one
default column for every other token. Forced states advance by position
whatever the token; UNCONSTRAINED is absorbing and has no row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atom_plugin.parsers.required_channel import UNCONSTRAINED, RequiredChannel

# A token id no vocabulary uses: it takes the default column.
_OTHER_TOKEN = 2**31 - 1


@dataclass(frozen=True)
class ChannelTables:
    """Device tensors of a set of channels (int32 unless said otherwise).

    channels, bases: channel c's states are `bases[c] .. bases[c] + num_states - 1`.
    max_id: the largest id any channel uses (a host int, checked against the logits width).

    forced[s]: the id state s forces, -1 when it forces nothing.
    waiting[s]: bool, s bans its end ids and forces nothing.
    channel_ids[k]: the ids with their own column, ascending.
    next_state[s, k]: the state after channel_ids[k]; column K is every other id.
    end_ids[s, e]: the ids state s bans while waiting, padded with -1.
    """

    channels: tuple[RequiredChannel, ...]
    bases: tuple[int, ...]
    max_id: int
    forced: torch.Tensor
    waiting: torch.Tensor
    channel_ids: torch.Tensor
    next_state: torch.Tensor
    end_ids: torch.Tensor

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
    next_state: np.ndarray  # [S, K + 1], local states or UNCONSTRAINED


@functools.lru_cache(maxsize=1024)
def _local(channel: RequiredChannel) -> _Local:
    states = range(channel.num_states)
    columns = [*channel.channel_ids, _OTHER_TOKEN]
    return _Local(
        forced=np.array([_or_minus_one(channel.forced_token(s)) for s in states], np.int32),
        waiting=np.array([channel.is_waiting(s) for s in states], bool),
        next_state=np.array([[channel.step(s, t) for t in columns] for s in states], np.int32),
    )


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
    bases = state_bases(channels)
    forced, waiting, next_state, end_ids = [], [], [], []
    for channel, base in zip(channels, bases, strict=True):
        local = _local(channel)
        own = {t: k for k, t in enumerate(channel.channel_ids)}
        other = len(own)
        columns = [own.get(t, other) for t in union] + [other]
        stepped = local.next_state[:, columns]
        next_state.append(np.where(stepped >= 0, stepped + base, UNCONSTRAINED))
        forced.append(local.forced)
        waiting.append(local.waiting)
        ends = sorted(channel.end_ids) + [-1] * (width - len(channel.end_ids))
        end_ids.append(np.tile(np.array(ends, np.int32), (channel.num_states, 1)))

    def tensor(parts, dtype=torch.int32):
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts))).to(
            device=device, dtype=dtype
        )

    return ChannelTables(
        channels=channels,
        bases=tuple(bases),
        max_id=max(max((*c.after, *c.opening, *c.end_ids)) for c in channels),
        forced=tensor(forced),
        waiting=tensor(waiting, torch.bool),
        channel_ids=torch.tensor(union, dtype=torch.int32, device=device),
        next_state=tensor(next_state),
        end_ids=tensor(end_ids),
    )


def compile_channel(channel: RequiredChannel, device: torch.device | str) -> ChannelTables:
    """One channel's tables (its states are its local ones: base 0)."""
    return compile_channels((channel,), device)


def _or_minus_one(token: int | None) -> int:
    return -1 if token is None else token


def next_states(tables: ChannelTables, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every state stepped by its token, elementwise, as torch ops without a host sync."""
    hits = (tokens.unsqueeze(-1) == tables.channel_ids).to(torch.int32)
    column = torch.where(hits.any(-1), hits.argmax(-1), tables.num_channel_ids)
    stepped = tables.next_state[states.clamp(min=0).long(), column]
    return torch.where(states == UNCONSTRAINED, states, stepped)
