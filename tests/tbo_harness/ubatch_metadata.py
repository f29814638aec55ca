"""Per-micro-batch attention metadata of the TBO harness, cut where the slices are cut.

Decode steps are cut at `mode.ubatch_split_bs` (`prepare_ubatch_decode`), prefill
steps at the token midpoint (`prepare_ubatch_prefill`). Both take their ranges from
`atom_plugin.tbo.split`, like `maybe_create_ubatch_slices`. Inside vLLM the
backends' builders cut the metadata instead, from vLLM's common metadata split at
the same slices, and plan each micro-batch. A cut here drops the whole batch's
plan (its values describe the whole batch); `ops` plans the cut on each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.tbo.mode import DECODE, PREFILL, ForwardMode
from atom_plugin.tbo.split import decode_ubatch_request_ranges, prefill_ubatch_ranges


def prepare_ubatch_decode(
    meta: PagedAttentionMetadata, split_bs: int
) -> tuple[PagedAttentionMetadata, PagedAttentionMetadata]:
    """Cut a pure-decode batch into the two TBO micro-batches.

    Rows are cut at `decode_ubatch_request_ranges(split_bs)`. In a decode batch
    every row owns exactly one token (token index == row index), padding rows
    included, so each micro-batch's tokens are its rows. Rows at or past the
    real requests (`meta.num_decodes`) come out inert: seq_len 0, slot -1.
    `split_bs` may exceed the scheduled requests on a graph replay, but not the
    rows the block table holds (the builder's padded, persistent rows).
    """
    if isinstance(split_bs, bool) or not isinstance(split_bs, int):
        raise TypeError(f"split_bs must be an int, got {split_bs!r}")
    if meta.max_query_len > 1 or meta.num_decode_tokens != meta.num_decodes:
        raise ValueError(
            "prepare_ubatch_decode needs a pure-decode batch; got "
            f"max_query_len={meta.max_query_len}, num_decodes={meta.num_decodes}, "
            f"num_decode_tokens={meta.num_decode_tokens}, num_reqs={meta.num_reqs}"
        )
    rows_available = meta.block_table.shape[0]
    if split_bs > rows_available:
        raise ValueError(
            f"split_bs={split_bs} exceeds the {rows_available} rows of the block table "
            f"(num_reqs={meta.num_reqs}); pad the builder's rows to the graph bucket"
        )
    (a0, b0), (a1, b1) = decode_ubatch_request_ranges(split_bs)
    real = meta.num_decodes
    device = meta.seq_lens.device
    # Every row at or past `real` is inert; seq_lens/slots may be shorter than
    # split_bs (only the scheduled rows), so pad before masking.
    seq_lens = _pad_to(meta.seq_lens[: min(real, split_bs)], split_bs, 0)
    slots = _pad_to(meta.slot_mapping[: min(real, split_bs)], split_bs, -1)
    table = meta.block_table[:split_bs]

    def cut(a: int, b: int) -> PagedAttentionMetadata:
        n = b - a
        return replace(
            meta,
            num_reqs=n,
            num_actual_tokens=n,
            max_query_len=1,  # both halves hold >= 1 row (decode_ubatch_request_ranges)
            num_decodes=n,
            num_decode_tokens=n,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_lens=seq_lens[a:b],
            block_table=table[a:b],
            slot_mapping=slots[a:b],
            plan=None,
        )

    return cut(a0, b0), cut(a1, b1)


def _pad_to(t: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    if t.shape[0] >= n:
        return t[:n]
    pad = torch.full((n - t.shape[0],), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def prepare_ubatch_prefill(
    meta: PagedAttentionMetadata, query_lens: Sequence[int]
) -> tuple[PagedAttentionMetadata, PagedAttentionMetadata]:
    """Cut a prefill or mixed batch at its token midpoint (`prefill_ubatch_ranges`).

    `query_lens` are the requests' new tokens on the host (what built `meta`).
    The request straddling the cut ends micro-batch 0 with a context that
    stops at its last token there; micro-batch 1 sees its earlier tokens as
    cached prefix (their KV is written by micro-batch 0's attention first).
    """
    lens = list(query_lens)
    if len(lens) != meta.num_reqs or sum(lens) != meta.num_actual_tokens:
        raise ValueError(
            f"query_lens (n={len(lens)}, tokens={sum(lens)}) do not describe the metadata "
            f"(num_reqs={meta.num_reqs}, num_actual_tokens={meta.num_actual_tokens})"
        )
    ranges = prefill_ubatch_ranges(lens)
    qsl = [0]
    for q in lens:
        qsl.append(qsl[-1] + q)
    device = meta.seq_lens.device
    out = []
    for (r0, r1), (t0, t1) in zip(ranges.requests, ranges.tokens, strict=True):
        local = [min(max(qsl[i], t0), t1) - t0 for i in range(r0, r1 + 1)]
        seq_lens = meta.seq_lens[r0:r1].clone()
        cut_off = qsl[r1] - t1  # new tokens of the last request that fall after this micro-batch
        if cut_off > 0:
            seq_lens[-1] -= cut_off
        num_decodes = max(0, min(meta.num_decodes, r1) - r0)
        out.append(
            replace(
                meta,
                num_reqs=r1 - r0,
                num_actual_tokens=t1 - t0,
                max_query_len=max(b - a for a, b in zip(local[:-1], local[1:], strict=True)),
                num_decodes=num_decodes,
                num_decode_tokens=local[num_decodes],
                query_start_loc=torch.tensor(local, dtype=torch.int32, device=device),
                seq_lens=seq_lens,
                block_table=meta.block_table[r0:r1],
                slot_mapping=meta.slot_mapping[t0:t1],
                plan=None,
            )
        )
    return out[0], out[1]


def ubatch_metadata(
    meta: PagedAttentionMetadata, mode: ForwardMode, query_lens: Sequence[int]
) -> tuple[PagedAttentionMetadata, PagedAttentionMetadata]:
    """The two micro-batches' metadata of a split step (decode cut at `mode.ubatch_split_bs`)."""
    if not mode.split:
        raise ValueError(f"the step does not split (mode {mode})")
    if mode.kind == DECODE:
        return prepare_ubatch_decode(meta, mode.ubatch_split_bs)
    if mode.kind == PREFILL:
        return prepare_ubatch_prefill(meta, query_lens)
    raise ValueError(f"a {mode.kind!r} step cannot split; split steps are decode or prefill")
