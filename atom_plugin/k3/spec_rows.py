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

from atom_plugin.k3.channel_tables import ChannelTables, next_states
from atom_plugin.k3.token_classes import SPECIAL

_SPECIAL = tl.constexpr(SPECIAL)
# Edges read per iteration of a state's list, and the widest class list (classes < 64).
EDGE_CHUNK = tl.constexpr(32)
CLASS_BLOCK = tl.constexpr(64)


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
def next_state(
    state,
    token,
    edge_off_ptr,
    edge_len_ptr,
    edge_tok_ptr,
    edge_dst_ptr,
    class_off_ptr,
    class_len_ptr,
    class_cls_ptr,
    class_dst_ptr,
    other_ptr,
    token_class_ptr,
    class_table_len,
):
    """One step of the channel for a scalar (state, token); -1 (UNCONSTRAINED) stays.

    The token's explicit edge if the state has one, else its class's (SPECIAL for ids
    past the class table), else the state's `other`. A state's ids (and classes) are
    distinct, so a sum over the matching lane picks the one edge; the edges are read
    `EDGE_CHUNK` at a time, so a step costs what the state's own edges cost.
    """
    safe = tl.maximum(state, 0)
    first = tl.load(edge_off_ptr + safe)
    count = tl.load(edge_len_ptr + safe)
    by_id = count * 0  # int32 scalars, as the loop's sums are
    found = count * 0
    for j in range(0, count, EDGE_CHUNK):
        lane = j + tl.arange(0, EDGE_CHUNK)
        hit = tl.load(edge_tok_ptr + first + lane, mask=lane < count, other=-1) == token
        by_id += tl.sum(tl.where(hit, tl.load(edge_dst_ptr + first + lane, mask=hit, other=0), 0))
        found += tl.sum(hit.to(tl.int32))
    inside = token < class_table_len
    cls = tl.load(token_class_ptr + tl.minimum(token, class_table_len - 1))
    cls = tl.where(inside, cls, _SPECIAL)
    c = tl.arange(0, CLASS_BLOCK)
    first_c = tl.load(class_off_ptr + safe)
    count_c = tl.load(class_len_ptr + safe)
    hit_c = tl.load(class_cls_ptr + first_c + c, mask=c < count_c, other=-1) == cls
    by_class = tl.sum(tl.where(hit_c, tl.load(class_dst_ptr + first_c + c, mask=hit_c, other=0), 0))
    other = tl.load(other_ptr + safe)
    stepped = tl.where(found > 0, by_id, tl.where(tl.sum(hit_c.to(tl.int32)) > 0, by_class, other))
    return tl.where(state < 0, state, stepped)


@triton.jit
def row_state(
    row,
    states_ptr,
    row_slot_ptr,
    row_pos_ptr,
    row_tokens_ptr,
    edge_off_ptr,
    edge_len_ptr,
    edge_tok_ptr,
    edge_dst_ptr,
    class_off_ptr,
    class_len_ptr,
    class_cls_ptr,
    class_dst_ptr,
    other_ptr,
    token_class_ptr,
    class_table_len,
    HAS_SLOT: tl.constexpr,
    SPEC: tl.constexpr,
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
        for j in range(1, pos + 1):
            token = tl.load(row_tokens_ptr + first + j)
            state = next_state(
                state,
                token,
                edge_off_ptr,
                edge_len_ptr,
                edge_tok_ptr,
                edge_dst_ptr,
                class_off_ptr,
                class_len_ptr,
                class_cls_ptr,
                class_dst_ptr,
                other_ptr,
                token_class_ptr,
                class_table_len,
            )
    return state


def table_args(tables: ChannelTables) -> tuple:
    """The tables' tensors and sizes in the order `next_state` takes them."""
    return (
        tables.edge_off,
        tables.edge_len,
        tables.edge_tok,
        tables.edge_dst,
        tables.class_off,
        tables.class_len,
        tables.class_cls,
        tables.class_dst,
        tables.other,
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
    edge_off_ptr,
    edge_len_ptr,
    edge_tok_ptr,
    edge_dst_ptr,
    class_off_ptr,
    class_len_ptr,
    class_cls_ptr,
    class_dst_ptr,
    other_ptr,
    token_class_ptr,
    class_table_len,
):
    row = tl.program_id(0)
    state = row_state(
        row,
        states_ptr,
        row_slot_ptr,
        row_pos_ptr,
        row_tokens_ptr,
        edge_off_ptr,
        edge_len_ptr,
        edge_tok_ptr,
        edge_dst_ptr,
        class_off_ptr,
        class_len_ptr,
        class_cls_ptr,
        class_dst_ptr,
        other_ptr,
        token_class_ptr,
        class_table_len,
        True,
        True,
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
            out, states, row_slot, row_pos, row_tokens, *table_args(tables)
        )
    return out
