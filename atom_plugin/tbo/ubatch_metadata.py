"""Per-micro-batch attention metadata, cut where the slices are cut.

Decode steps use the backends' `prepare_ubatch_decode(meta, mode.ubatch_split_bs)`;
prefill steps are cut here at the token midpoint. Both take their ranges from
`atom_plugin.tbo.split`, like `maybe_create_ubatch_slices`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from atom_plugin.backends.metadata import PagedAttentionMetadata, prepare_ubatch_decode
from atom_plugin.tbo.mode import DECODE, PREFILL, ForwardMode
from atom_plugin.tbo.split import prefill_ubatch_ranges


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
