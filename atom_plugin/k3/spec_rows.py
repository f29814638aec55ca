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
def state_channel_ids(
    state,
    state_channel_ptr,
    channel_ids_ptr,
    channel_k_ptr,
    channel_classes_ptr,
    K,
    K_BLOCK: tl.constexpr,
):
    """(ids, k, classes) of the channel of `state`: its own ids as a vector padded with
    -1 (no token is -1), how many, and its class columns. A state never leaves its
    channel, so a row loads them once."""
    channel = tl.load(state_channel_ptr + tl.maximum(state, 0))
    offs = tl.arange(0, K_BLOCK)
    ids = tl.load(channel_ids_ptr + channel * K + offs, mask=offs < K, other=-1)
    return ids, tl.load(channel_k_ptr + channel), tl.load(channel_classes_ptr + channel)


@triton.jit
def next_state(
    state,
    token,
    ids,
    k,
    classes,
    row_off_ptr,
    next_state_ptr,
    token_class_ptr,
    class_len,
    K_BLOCK: tl.constexpr,
):
    """One step of the channel for a scalar (state, token); -1 (UNCONSTRAINED) stays.

    `ids`, `k` and `classes` are `state_channel_ids(...)` of the state's channel. An id
    that is none of its ids takes its class's column (k + class; one class when the
    channel has one, SPECIAL for ids past the class table).
    """
    inside = token < class_len
    cls = tl.load(token_class_ptr + tl.minimum(token, class_len - 1))
    cls = tl.where(classes > 1, tl.where(inside, cls, _SPECIAL), 0)
    column = tl.min(tl.where(ids == token, tl.arange(0, K_BLOCK), k + cls), axis=0)
    safe = tl.maximum(state, 0)
    stepped = tl.load(next_state_ptr + tl.load(row_off_ptr + safe) + column)
    return tl.where(state < 0, state, stepped)


@triton.jit
def row_state(
    row,
    states_ptr,
    row_slot_ptr,
    row_pos_ptr,
    row_tokens_ptr,
    state_channel_ptr,
    channel_ids_ptr,
    channel_k_ptr,
    channel_classes_ptr,
    row_off_ptr,
    next_state_ptr,
    K,
    token_class_ptr,
    class_len,
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
        ids, k, classes = state_channel_ids(
            state,
            state_channel_ptr,
            channel_ids_ptr,
            channel_k_ptr,
            channel_classes_ptr,
            K,
            K_BLOCK,
        )
        for j in range(1, pos + 1):
            token = tl.load(row_tokens_ptr + first + j)
            state = next_state(
                state,
                token,
                ids,
                k,
                classes,
                row_off_ptr,
                next_state_ptr,
                token_class_ptr,
                class_len,
                K_BLOCK,
            )
    return state


def table_args(tables: ChannelTables) -> tuple:
    """The tables' tensors and sizes in the order `row_state` takes them (after the rows')."""
    return (
        tables.state_channel,
        tables.channel_ids,
        tables.channel_k,
        tables.channel_classes,
        tables.row_off,
        tables.next_state,
        tables.num_channel_ids,
        tables.token_class,
        tables.token_class.numel(),
    )


@triton.jit
def _spec_row_states_kernel(
    out_ptr,
    states_ptr,
    row_slot_ptr,
    row_pos_ptr,
    row_tokens_ptr,
    state_channel_ptr,
    channel_ids_ptr,
    channel_k_ptr,
    channel_classes_ptr,
    row_off_ptr,
    next_state_ptr,
    K,
    token_class_ptr,
    class_len,
    K_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    state = row_state(
        row,
        states_ptr,
        row_slot_ptr,
        row_pos_ptr,
        row_tokens_ptr,
        state_channel_ptr,
        channel_ids_ptr,
        channel_k_ptr,
        channel_classes_ptr,
        row_off_ptr,
        next_state_ptr,
        K,
        token_class_ptr,
        class_len,
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
            *table_args(tables),
            K_BLOCK=next_power_of_2(tables.num_channel_ids),
        )
    return out
