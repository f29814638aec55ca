"""States of speculative verification rows, computed on the device from the drafts.

A request with committed state s and drafts d1..dk owns k + 1 logits rows.
Row j (0 <= j <= k; row k is the bonus row) is constrained as if d1..dj were
accepted: its state is s stepped through d1..dj. A draft that breaks the channel
still advances the later rows' states (forced states advance whatever the
token); the sampler rejects that draft, so those rows are never used.

The layout is Model Runner V2's: per logits row, `row_slot` (the request's
slot in `states`), `row_pos` (its local position j) and `row_tokens` (the id
fed at that row, so the drafts sit at local positions 1..k). Row j's drafts are
`row_tokens[row - j + 1 .. row]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_plugin.attention.triton_common import next_power_of_2
from atom_plugin.k3.channel_tables import ChannelTables, next_states
from atom_plugin.k3.token_classes import SPECIAL

_SPECIAL = tl.constexpr(SPECIAL)


def spec_row_states_torch(
    tables: ChannelTables,
    states: torch.Tensor,
    row_slot: torch.Tensor,
    row_pos: torch.Tensor,
    row_tokens: torch.Tensor,
    max_drafts: int,
) -> torch.Tensor:
    """Every row's state, as `max_drafts` rounds of vectorised torch ops (no host sync).

    `max_drafts` (the configured number of speculative tokens) must be at least
    the largest `row_pos`; rows beyond it would be stepped too few times.
    """
    num_rows = row_slot.numel()
    rows = torch.arange(num_rows, device=row_slot.device)
    first = rows - row_pos.long()
    row_states = states[row_slot.long()]
    for j in range(1, max_drafts + 1):
        draft = row_tokens[(first + j).clamp(0, max(num_rows - 1, 0))]
        row_states = torch.where(row_pos >= j, next_states(tables, row_states, draft), row_states)
    return row_states.to(torch.int32)


@triton.jit
def load_channel_ids(channel_ids_ptr, K, K_BLOCK: tl.constexpr):
    """The channel ids as a vector, padded with -1 (no token is -1)."""
    offs = tl.arange(0, K_BLOCK)
    return tl.load(channel_ids_ptr + offs, mask=offs < K, other=-1)


@triton.jit
def next_state(
    state, token, ids, next_state_ptr, K, token_class_ptr, class_len, C, K_BLOCK: tl.constexpr
):
    """One step of the channel for a scalar (state, token); -1 (UNCONSTRAINED) stays.

    `ids` is `load_channel_ids(...)`, loaded once per program. An id that is
    none of them takes its class's column (K + class; one class when C is 1,
    SPECIAL for ids past the class table).
    """
    inside = token < class_len
    cls = tl.load(token_class_ptr + tl.minimum(token, class_len - 1))
    cls = tl.where(C > 1, tl.where(inside, cls, _SPECIAL), 0)
    column = tl.min(tl.where(ids == token, tl.arange(0, K_BLOCK), K + cls), axis=0)
    safe = tl.maximum(state, 0)
    stepped = tl.load(next_state_ptr + safe * (K + C) + column)
    return tl.where(state < 0, state, stepped)


@triton.jit
def row_state(
    row,
    states_ptr,
    row_slot_ptr,
    row_pos_ptr,
    row_tokens_ptr,
    channel_ids_ptr,
    next_state_ptr,
    K,
    token_class_ptr,
    class_len,
    C,
    HAS_SLOT: tl.constexpr,
    SPEC: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    """The state of logits row `row`: its slot's state stepped through its drafts."""
    if HAS_SLOT:
        slot = tl.load(row_slot_ptr + row)
    else:
        slot = row
    state = tl.load(states_ptr + slot)
    if SPEC:
        pos = tl.load(row_pos_ptr + row)
        first = row - pos
        ids = load_channel_ids(channel_ids_ptr, K, K_BLOCK)
        for j in range(1, pos + 1):
            token = tl.load(row_tokens_ptr + first + j)
            state = next_state(
                state, token, ids, next_state_ptr, K, token_class_ptr, class_len, C, K_BLOCK
            )
    return state


@triton.jit
def _spec_row_states_kernel(
    out_ptr,
    states_ptr,
    row_slot_ptr,
    row_pos_ptr,
    row_tokens_ptr,
    channel_ids_ptr,
    next_state_ptr,
    K,
    token_class_ptr,
    class_len,
    C,
    K_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    state = row_state(
        row,
        states_ptr,
        row_slot_ptr,
        row_pos_ptr,
        row_tokens_ptr,
        channel_ids_ptr,
        next_state_ptr,
        K,
        token_class_ptr,
        class_len,
        C,
        True,
        True,
        K_BLOCK,
    )
    tl.store(out_ptr + row, state)


def spec_row_states_triton(
    tables: ChannelTables,
    states: torch.Tensor,
    row_slot: torch.Tensor,
    row_pos: torch.Tensor,
    row_tokens: torch.Tensor,
) -> torch.Tensor:
    """Every row's state in one Triton launch (one program per row, no host sync)."""
    num_rows = row_slot.numel()
    out = torch.empty(num_rows, dtype=torch.int32, device=row_slot.device)
    if num_rows:
        _spec_row_states_kernel[(num_rows,)](
            out,
            states,
            row_slot,
            row_pos,
            row_tokens,
            tables.channel_ids,
            tables.next_state,
            tables.num_channel_ids,
            tables.token_class,
            tables.token_class.numel(),
            tables.num_classes,
            K_BLOCK=next_power_of_2(tables.num_channel_ids),
        )
    return out
