"""Static decode metadata of the harness's request graphs, rewritten in place per step.

A replayed graph reads the tensors it was recorded with, so a bucket's metadata
lives in buffers that never move: `DecodeGraphBuffers.refresh` writes each step's
batch into them (the full bucket's and each micro-batch's metadata, cut at the
bucket). Inside vLLM, vLLM's persistent inputs and the plugin backends' own
buffers play this part.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.tbo.mode import GraphKey

from .ubatch_metadata import prepare_ubatch_decode

_TENSORS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


def pad_decode_rows(
    meta: PagedAttentionMetadata, rows: int, max_seq_len: int | None = None
) -> PagedAttentionMetadata:
    """A uniform decode batch padded to `rows` requests; padding rows are inert.

    Padding rows get seq_len 0, block-table row 0 and slot -1 for each of their
    query tokens (`_write_padded_rows`). `max_seq_len` (an upper bound) replaces the
    batch's when given.
    """
    if rows < meta.num_reqs:
        raise ValueError(f"cannot pad {meta.num_reqs} requests to {rows} rows")
    q, dev = meta.max_query_len, meta.seq_lens.device
    padded = replace(
        meta,
        num_reqs=rows,
        num_actual_tokens=rows * q,
        num_decodes=rows,
        num_decode_tokens=rows * q,
        max_seq_len=meta.max_seq_len if max_seq_len is None else max_seq_len,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=dev) * q,
        seq_lens=torch.empty(rows, dtype=torch.int32, device=dev),
        block_table=torch.empty((rows, meta.block_table.shape[1]), dtype=torch.int32, device=dev),
        slot_mapping=torch.empty(rows * q, dtype=torch.int64, device=dev),
        plan=None,  # planned on each call: the rows are rewritten in place every step
    )
    _write_padded_rows(padded, meta)
    return padded


def _write_padded_rows(dst: PagedAttentionMetadata, src: PagedAttentionMetadata) -> None:
    """Write a uniform decode batch into `dst`'s rows; the rows after it become inert.

    Writes straight into `dst`'s tensors (no temporaries): the real rows'
    seq_lens, block-table rows and slots, then seq_len 0, table row 0 and
    slot -1 for the padding. `dst`'s query_start_loc is fixed by its rows.
    """
    n, q = src.num_reqs, dst.max_query_len
    if n > dst.num_reqs:
        raise ValueError(f"{n} requests do not fit the captured {dst.num_reqs} rows")
    if src.num_decodes != n or src.num_actual_tokens != n * q:
        raise ValueError(
            f"padded decode rows take a uniform decode batch of query length {q}; got "
            f"num_reqs={n}, num_decodes={src.num_decodes}, tokens={src.num_actual_tokens}"
        )
    if src.block_table.shape[1] != dst.block_table.shape[1]:
        raise ValueError(
            f"block_table has {src.block_table.shape[1]} columns, the captured one "
            f"{dst.block_table.shape[1]}"
        )
    dst.seq_lens[:n].copy_(src.seq_lens[:n], non_blocking=True)
    dst.seq_lens[n:].zero_()
    dst.block_table[:n].copy_(src.block_table[:n], non_blocking=True)
    dst.block_table[n:].zero_()
    dst.slot_mapping[: n * q].copy_(src.slot_mapping[: n * q], non_blocking=True)
    dst.slot_mapping[n * q :].fill_(-1)


class StaticMetadata:
    """A decode bucket's metadata whose tensors never move: captured once, rewritten in place."""

    def __init__(self, template: PagedAttentionMetadata):
        self.meta = replace(template, **{n: getattr(template, n).clone() for n in _TENSORS})

    def write_padded(self, src: PagedAttentionMetadata) -> None:
        """Write a uniform decode batch of at most `num_reqs` rows in place; the rest go inert."""
        _write_padded_rows(self.meta, src)


class DecodeGraphBuffers:
    """The attention metadata buffers of one decode request graph.

    `full` is the whole bucket (the unsplit graph reads it); on a split
    bucket `ubatches` are the two micro-batches' metadata, cut at the bucket
    with `prepare_ubatch_decode` - the same cut on capture and on every
    replay. Their tensors are views of `full`'s, so writing the bucket
    refreshes both micro-batches too.
    """

    def __init__(
        self,
        key: GraphKey,
        split: bool,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
    ):
        self.key, self.split = key, split
        self.max_seq_len = max_blocks_per_req * block_size
        q = key.query_len
        inert = PagedAttentionMetadata(
            num_reqs=0,
            num_actual_tokens=0,
            max_query_len=q,
            max_seq_len=self.max_seq_len,
            num_decodes=0,
            num_decode_tokens=0,
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
            block_table=torch.zeros((0, max_blocks_per_req), dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        )
        self.full = StaticMetadata(pad_decode_rows(inert, key.bucket))
        self.ubatches = prepare_ubatch_decode(self.full.meta, key.bucket) if split else None

    def refresh(self, meta: PagedAttentionMetadata) -> None:
        """Write this step's batch (at most `bucket` decode requests) into the buffers.

        An empty batch (an idle DP rank joining the agreed replay) is all padding.
        """
        other_query_len = meta.num_reqs > 0 and meta.max_query_len != self.key.query_len
        if meta.num_reqs > self.key.bucket or other_query_len:
            raise ValueError(
                f"a batch of {meta.num_reqs} requests x {meta.max_query_len} tokens does not "
                f"fit graph {self.key}"
            )
        if meta.max_seq_len > self.max_seq_len:
            raise ValueError(
                f"max_seq_len={meta.max_seq_len} exceeds the graph's bound {self.max_seq_len}"
            )
        self.full.write_padded(meta)
