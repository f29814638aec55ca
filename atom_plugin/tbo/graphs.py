"""Request graphs: each decode bucket recorded as one CUDA graph, split ones included.

A split bucket's graph holds both micro-batches: the step function calls the
`MicroBatchRunner`, whose workers issue onto the capture stream and a comm
stream forked from it, joined back before the step returns. A replay reads
static buffers; `DecodeGraphBuffers.refresh` rewrites them in place (the full
batch's and each micro-batch's metadata, cut at the bucket) before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from atom_plugin.backends.metadata import PagedAttentionMetadata, prepare_ubatch_decode
from atom_plugin.tbo.mode import GraphKey

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
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


class RequestGraphs:
    """CUDA graphs keyed by (bucket, query length), sharing one memory pool.

    `capture(key, step)` warms `step` up on a side stream, then records it;
    `replay(key)` replays and returns the static outputs of the capture
    (overwritten by the next replay of that graph). `pool`: a graph memory pool
    to share (vLLM's global one inside vLLM); a new one by default.
    """

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        capture_error_mode: str = "thread_local",
        warmup_steps: int = 2,
        pool: Any = None,
    ):
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode {capture_error_mode!r} is not one of "
                f"{', '.join(CAPTURE_ERROR_MODES)}"
            )
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (compiles kernels), got {warmup_steps}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"request graphs need a CUDA device, got {self.device}")
        self.capture_error_mode = capture_error_mode
        self.warmup_steps = warmup_steps
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def keys(self) -> list[GraphKey]:
        return list(self._graphs)

    def capture(self, key: GraphKey, step: Callable[[], Any]) -> Any:
        """Record `step` (which must only read static buffers) as the graph of `key`."""
        if key in self._graphs:
            raise ValueError(f"graph {key} is already captured")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_steps):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            outputs = step()
        self._graphs[key] = (graph, outputs)
        return outputs

    def replay(self, key: GraphKey) -> Any:
        try:
            graph, outputs = self._graphs[key]
        except KeyError:
            raise KeyError(f"no graph captured for {key}; captured: {self.keys()}") from None
        graph.replay()
        return outputs


class RerunGraphs:
    """`RequestGraphs`' stand-in on CPU: a 'replay' re-runs the recorded step.

    The step reads what it captured (its static buffers and metadata objects),
    as a replayed graph does, so a step whose inputs do not reach those buffers
    gives stale results here too. The CPU tests run the split-replay paths on it.
    """

    def __init__(self):
        self._steps: dict[GraphKey, Callable[[], Any]] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._steps

    def keys(self) -> list[GraphKey]:
        return list(self._steps)

    def capture(self, key: GraphKey, step: Callable[[], Any]) -> Any:
        if key in self._steps:
            raise ValueError(f"graph {key} is already captured")
        self._steps[key] = step
        return step()

    def replay(self, key: GraphKey) -> Any:
        try:
            step = self._steps[key]
        except KeyError:
            raise KeyError(f"no graph captured for {key}; captured: {self.keys()}") from None
        return step()


class BucketGraphs:
    """The decode buckets' request graphs, each recorded on the first step that replays it.

    `graphs` is a `RequestGraphs` (or `RerunGraphs` on CPU); `planned` is
    `plan_request_graphs`' answer. `keys` are every bucket, for
    `ForwardMode.decide` (which picks the bucket a step pads to and whether its
    replay splits); `split_buckets` those recorded split.
    """

    def __init__(
        self, graphs: RequestGraphs | RerunGraphs, planned: Sequence[tuple[GraphKey, bool]]
    ):
        self.graphs = graphs
        self.keys: list[GraphKey] = [key for key, _ in planned]
        self.split_buckets: list[int] = [key.bucket for key, split in planned if split]

    def recorded(self, key: GraphKey) -> bool:
        return key in self.graphs

    def run(self, key: GraphKey, step: Callable[[], Any], steps: Counter) -> Any:
        """Replay `key`'s graph, recording `step` first on the bucket's first step;
        counts `steps["captured"]` and `steps["replayed"]`."""
        if key not in self.keys:
            raise KeyError(f"{key} is not a planned bucket: {self.keys}")
        if key not in self.graphs:
            self.graphs.capture(key, step)
            steps["captured"] += 1
        steps["replayed"] += 1
        return self.graphs.replay(key)
