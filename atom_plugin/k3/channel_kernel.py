"""The required channel applied to a step's logits: one Triton kernel and its torch reference.

Each logits row has its own state (see required_channel.py), numbered in the
state space that the step's channels share (channel_tables.py), so one launch
serves rows of different channels (required, named, different stop ids):
- forced rows: every logit becomes -inf except the forced id, which is set to
  0.0. The row is only written, never read: any finite value gives the forced
  id probability 1 once the rest is -inf, and 0.0 stays finite whatever the
  model produced there (-inf, NaN). Logprobs are taken before this mask.
- waiting rows: the end ids of the row's channel become -inf, nothing else changes.
- masked rows (call states that allow several ids: a tool name, a key, a value):
  every id that is neither one of the state's `allow_ids` nor of a class in its
  `class_bits` becomes -inf, and so do the end ids; allowed logits are untouched.
- unconstrained rows (and rows of requests without a channel, whose state is
  UNCONSTRAINED): untouched, bit for bit.

The grid is rows x vocabulary tiles, so a 163,840-wide forced row is written
by several programs in parallel; the number of tiles per row shrinks as the
batch grows so the launch stays about `programs` programs. States advance on
the device from committed tokens (`advance_states`), with no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_plugin.attention.triton_common import cdiv, next_power_of_2
from atom_plugin.k3.channel_tables import ChannelTables, edge_window, next_states
from atom_plugin.k3.required_channel import UNCONSTRAINED
from atom_plugin.k3.spec_rows import (
    EDGE_CHUNK,
    next_state,
    row_state,
    spec_row_states_torch,
    table_args,
)
from atom_plugin.k3.token_classes import SPECIAL

_SPECIAL = tl.constexpr(SPECIAL)
IMPLS: tuple[str, ...] = ("triton", "torch")
# Elements one program writes per loop iteration, and the launch size aimed at.
BLOCK = 2048
PROGRAMS = 1024


@triton.jit
def _channel_logits_kernel(
    logits_ptr,
    logits_stride,
    vocab,
    chunk,
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
    forced_ptr,
    end_ids_ptr,
    E,
    masked_ptr,
    class_bits_ptr,
    HAS_SLOT: tl.constexpr,
    SPEC: tl.constexpr,
    HAS_MASKED: tl.constexpr,
    E_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
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
        HAS_SLOT,
        SPEC,
    )
    if state >= 0:
        base = logits_ptr + row.to(tl.int64) * logits_stride
        forced = tl.load(forced_ptr + state)
        lo = tile * chunk
        hi = tl.minimum(lo + chunk, vocab)
        if forced >= 0:
            minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
            zero = tl.zeros([BLOCK], logits_ptr.dtype.element_ty)
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(base + offs, tl.where(offs == forced, zero, minus_inf), mask=offs < hi)
        elif HAS_MASKED and tl.load(masked_ptr + state):
            # Masked: -inf wherever neither the id nor its class is allowed. Only
            # -inf is written (allowed logits are not read), so tiles cannot race
            # with each other or with the end ids written below.
            bits = tl.load(class_bits_ptr + state)
            first = tl.load(edge_off_ptr + state)
            many = tl.load(edge_len_ptr + state)
            minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                cls = tl.load(token_class_ptr + offs, mask=offs < class_table_len, other=_SPECIAL)
                keep = ((bits >> cls.to(tl.int64)) & 1) != 0
                for j in range(0, many, EDGE_CHUNK):  # the state's allowed ids, a chunk at a time
                    lane = j + tl.arange(0, EDGE_CHUNK)
                    allow = tl.load(edge_tok_ptr + first + lane, mask=lane < many, other=-1)
                    keep = keep | (tl.max((offs[:, None] == allow[None, :]).to(tl.int32), 1) != 0)
                tl.store(base + offs, minus_inf, mask=(offs < hi) & ~keep)
        if forced < 0 and tile == 0:
            offs = tl.arange(0, E_BLOCK)
            ends = tl.load(end_ids_ptr + state * E + offs, mask=offs < E, other=-1)
            minus_inf = tl.full([E_BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
            tl.store(base + ends, minus_inf, mask=ends >= 0)


def tiles_per_row(num_rows: int, vocab: int, block: int = BLOCK, programs: int = PROGRAMS) -> int:
    """How many programs share one row: about `programs` in all, at least one per row."""
    most = cdiv(vocab, block)
    return max(1, min(most, cdiv(programs, max(num_rows, 1))))


def apply_channel_triton(
    logits: torch.Tensor,
    tables: ChannelTables,
    states: torch.Tensor,
    row_slot: torch.Tensor | None = None,
    row_pos: torch.Tensor | None = None,
    row_tokens: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
    programs: int = PROGRAMS,
) -> None:
    """Mask `logits` [rows, vocab] in place in one launch.

    Row r's state is `states[row_slot[r]]` (`states[r]` without `row_slot`),
    stepped through its drafts when `row_pos`/`row_tokens` are given (see
    spec_rows.py).
    """
    num_rows, vocab = logits.shape
    tables.check_vocab(vocab)
    if num_rows == 0:
        return
    spec = _check_spec(row_pos, row_tokens)
    tiles = tiles_per_row(num_rows, vocab, block, programs)
    chunk = cdiv(cdiv(vocab, tiles), block) * block
    tiles = cdiv(vocab, chunk)
    _channel_logits_kernel[(num_rows, tiles)](
        logits,
        logits.stride(0),
        vocab,
        chunk,
        states,
        states if row_slot is None else row_slot,
        row_pos if spec else states,
        row_tokens if spec else states,
        *table_args(tables),
        tables.forced,
        tables.end_ids,
        tables.num_end_ids,
        tables.masked,
        tables.class_bits,
        HAS_SLOT=row_slot is not None,
        SPEC=spec,
        HAS_MASKED=tables.has_masked,
        E_BLOCK=next_power_of_2(max(tables.num_end_ids, 1)),
        BLOCK=block,
    )


def apply_channel_torch(
    logits: torch.Tensor,
    tables: ChannelTables,
    states: torch.Tensor,
    row_slot: torch.Tensor | None = None,
    row_pos: torch.Tensor | None = None,
    row_tokens: torch.Tensor | None = None,
    *,
    max_drafts: int | None = None,
) -> None:
    """The reference: same arguments and the same bits as the kernel, as torch ops."""
    num_rows, vocab = logits.shape
    tables.check_vocab(vocab)
    if num_rows == 0:
        return
    slots = torch.arange(num_rows, device=logits.device) if row_slot is None else row_slot
    if _check_spec(row_pos, row_tokens):
        if max_drafts is None:
            max_drafts = int(row_pos.max())  # the reference may sync
        rows = spec_row_states_torch(tables, states, slots, row_pos, row_tokens, max_drafts)
    else:
        rows = states[slots.long()]
    live = rows != UNCONSTRAINED
    safe = rows.clamp(min=0).long()
    forced = torch.where(live, tables.forced[safe], -1)
    waiting = live & (tables.waiting[safe] | tables.masked[safe])
    is_forced = (forced >= 0).unsqueeze(1)
    columns = torch.arange(vocab, device=logits.device)
    masked = torch.where(columns == forced.unsqueeze(1), 0.0, float("-inf")).to(logits.dtype)
    logits.copy_(torch.where(is_forced, masked, logits))
    if tables.has_masked:
        _mask_rows_torch(logits, tables, live & tables.masked[safe] & (forced < 0), safe)
    # Each waiting row bans its own state's end ids (-1 pads): a boolean mask, so
    # repeated columns cannot race as a scatter of values could.
    ends = tables.end_ids[safe].long()
    hit = waiting.unsqueeze(1) & (ends >= 0)
    banned = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, torch.where(hit, ends, vocab), True)
    logits.masked_fill_(banned[:, :vocab], float("-inf"))


def _mask_rows_torch(
    logits: torch.Tensor, tables: ChannelTables, rows: torch.Tensor, states: torch.Tensor
) -> None:
    """-inf in `rows` wherever neither the id nor its class is allowed by the row's state."""
    vocab = logits.shape[1]
    classes = tables.token_class
    cls = torch.full((vocab,), SPECIAL, dtype=torch.int64, device=logits.device)
    inside = min(vocab, classes.numel())
    cls[:inside] = classes[:inside].long()
    by_class = ((tables.class_bits[states].unsqueeze(1) >> cls.unsqueeze(0)) & 1) != 0
    at, inside = edge_window(
        tables.edge_off[states], tables.edge_len[states], tables.edge_tok, tables.max_edges
    )
    allow = torch.where(inside, tables.edge_tok[at].long(), -1)
    by_id = torch.zeros(rows.numel(), vocab + 1, dtype=torch.bool, device=logits.device)
    by_id.scatter_(1, torch.where(allow >= 0, allow, vocab), True)
    keep = by_class | by_id[:, :vocab]
    logits.masked_fill_(rows.unsqueeze(1) & ~keep, float("-inf"))


def _check_spec(row_pos: torch.Tensor | None, row_tokens: torch.Tensor | None) -> bool:
    if (row_pos is None) != (row_tokens is None):
        raise ValueError(
            "speculative rows need both row_pos and row_tokens, got "
            f"row_pos={'a tensor' if row_pos is not None else None}, "
            f"row_tokens={'a tensor' if row_tokens is not None else None}"
        )
    return row_pos is not None


def apply_required_channel(
    logits: torch.Tensor,
    tables: ChannelTables,
    states: torch.Tensor,
    *,
    live: bool,
    row_slot: torch.Tensor | None = None,
    row_pos: torch.Tensor | None = None,
    row_tokens: torch.Tensor | None = None,
    impl: str | None = None,
) -> bool:
    """Apply the channel to a step; returns whether anything was launched.

    `live` is the host's knowledge that some row of this step belongs to a
    request whose channel may still constrain it (a request given a channel
    and not yet seen UNCONSTRAINED); without one nothing is launched. `impl`
    is "triton" or "torch"; by default Triton for GPU tensors, torch on CPU.
    """
    if impl is None:
        impl = "torch" if logits.device.type == "cpu" else "triton"
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {', '.join(IMPLS)}")
    if not live or logits.shape[0] == 0:
        return False
    apply = apply_channel_triton if impl == "triton" else apply_channel_torch
    apply(logits, tables, states, row_slot, row_pos, row_tokens)
    return True


@triton.jit
def _advance_kernel(
    states_ptr,
    scanned_ptr,
    token_ids_ptr,
    token_ids_stride,
    total_len_ptr,
    slots_ptr,
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
    slot = tl.load(slots_ptr + tl.program_id(0))
    state = tl.load(states_ptr + slot)
    lo = tl.load(scanned_ptr + slot)
    hi = tl.load(total_len_ptr + slot)
    if state >= 0:
        tokens = token_ids_ptr + slot.to(tl.int64) * token_ids_stride
        for i in range(lo, hi):
            token = tl.load(tokens + i)
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
        tl.store(states_ptr + slot, state)
    tl.store(scanned_ptr + slot, tl.maximum(lo, hi))


def advance_states(
    tables: ChannelTables,
    states: torch.Tensor,
    scanned: torch.Tensor,
    token_ids: torch.Tensor,
    total_len: torch.Tensor,
    slots: torch.Tensor,
    *,
    impl: str = "triton",
) -> None:
    """Fold committed tokens into the states of `slots`, in place, without a host sync.

    For each slot s: states[s] is stepped through token_ids[s, scanned[s]:total_len[s]]
    and scanned[s] becomes total_len[s]. A new request starts with states[s] =
    START and scanned[s] = its prompt length (scanning starts at the output).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {', '.join(IMPLS)}")
    if slots.numel() == 0:
        return
    if impl == "triton":
        _advance_kernel[(slots.numel(),)](
            states,
            scanned,
            token_ids,
            token_ids.stride(0),
            total_len,
            slots,
            *table_args(tables),
        )
        return
    idx = slots.long()
    lo, hi = scanned[idx].long(), total_len[idx].long()
    state = states[idx]
    longest = int((hi - lo).max())  # the reference may sync
    for n in range(max(longest, 0)):
        at = lo + n
        token = token_ids[idx, at.clamp(max=token_ids.shape[1] - 1)]
        state = torch.where(at < hi, next_states(tables, state, token), state)
    states[idx] = state.to(states.dtype)
    scanned[idx] = torch.maximum(lo, hi).to(scanned.dtype)
