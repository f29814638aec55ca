"""A RequiredChannel compiled into small device tensors, so states advance on the GPU.

Only the channel's own ids (those of `after` and of the opening's head) change a
waiting state in a way other than going back to START, so the transition table
has one column per channel id plus one default column for every other token.
Forced states advance by position whatever the token; UNCONSTRAINED (-1) is
absorbing and has no row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom_plugin.parsers.required_channel import UNCONSTRAINED, RequiredChannel

# A token id no vocabulary uses: it takes the default column.
_OTHER_TOKEN = 2**31 - 1


@dataclass(frozen=True)
class ChannelTables:
    """Device tensors of one channel (int32 unless said otherwise).

    max_id: the largest id the channel uses (a host int, checked against the logits width).

    forced[s]: the id state s forces, -1 when it forces nothing.
    waiting[s]: bool, s bans the end ids and forces nothing.
    channel_ids[k]: the ids with their own column, ascending.
    next_state[s, k]: the state after channel_ids[k]; column K is every other id.
    end_ids[e]: the ids banned while waiting.
    """

    channel: RequiredChannel
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
        return self.end_ids.numel()

    def check_vocab(self, vocab: int) -> None:
        """Refuse logits too narrow for the channel's ids (the kernel would write past a row)."""
        if self.max_id >= vocab:
            raise ValueError(
                f"logits have {vocab} columns but the channel uses ids up to {self.max_id} "
                f"({self.channel!r})"
            )


def compile_channel(channel: RequiredChannel, device: torch.device | str) -> ChannelTables:
    """Build `channel`'s tables on `device` (once per server, not per step)."""
    states = range(channel.num_states)
    columns = [*channel.channel_ids, _OTHER_TOKEN]

    def tensor(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    return ChannelTables(
        channel=channel,
        max_id=max((*channel.after, *channel.opening, *channel.end_ids)),
        forced=tensor([_or_minus_one(channel.forced_token(s)) for s in states]),
        waiting=tensor([channel.is_waiting(s) for s in states], torch.bool),
        channel_ids=tensor(list(channel.channel_ids)),
        next_state=tensor([[channel.step(s, t) for t in columns] for s in states]),
        end_ids=tensor(sorted(channel.end_ids)),
    )


def _or_minus_one(token: int | None) -> int:
    return -1 if token is None else token


def next_states(tables: ChannelTables, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every state stepped by its token, elementwise, as torch ops without a host sync."""
    hits = (tokens.unsqueeze(-1) == tables.channel_ids).to(torch.int32)
    column = torch.where(hits.any(-1), hits.argmax(-1), tables.num_channel_ids)
    stepped = tables.next_state[states.clamp(min=0).long(), column]
    return torch.where(states == UNCONSTRAINED, states, stepped)
