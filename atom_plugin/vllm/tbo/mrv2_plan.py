"""Which Model Runner V2 steps split, where, and as which `BatchExecutionDescriptor`.

MRV2's `execute_model` calls `gather_batch_req_state` once per step on every DP
rank, dummy runs included, before any of its own DP collectives. The plugin's runner
plans the step there (`TboStepPlanner.plan`): the step's `BatchShape`, the
prefix-cache veto (`atom_plugin.tbo.hazards`), the DP agreement
(`atom_plugin.tbo.dp`, one all_gather with DP > 1) and `ForwardMode.decide`; the
micro-batches are cut by `maybe_create_ubatch_slices`, the one split rule.

vLLM then asks its graph manager which descriptor the step runs as
(`CudaGraphManager.dispatch`). For a split step the plugin's manager answers with
`split_descriptor`: two micro-batches, FULL at the bucket for a split graph replay,
NONE (eager) otherwise. With DP > 1 vLLM dispatches twice: once for each rank's
vote (the smallest graph mode over the ranks wins, and NONE would drop the split)
and once for the agreed descriptor. Every rank planned the same split, so each
votes FULL and all of them reach the second call.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from atom_plugin.tbo.graphs import BucketGraphs
from atom_plugin.tbo.mode import PREFILL, BatchShape, ForwardMode, GraphKey, TboConfig
from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.tbo.slices import UBatchSlice, maybe_create_ubatch_slices

STAT_KINDS = ("decode", "prefill", "unsplit", "straddled", "vetoed", "replayed", "captured")


def step_shape(query_lens: list[int], uniform_token_count: int | None) -> BatchShape:
    """A step's shape as vLLM classed it: a decode when vLLM found a uniform decode batch
    (`uniform_token_count` tokens for every request, decode-graph eligible), else a prefill."""
    if uniform_token_count is None:
        return BatchShape(len(query_lens), sum(query_lens))
    return BatchShape.from_query_lens(query_lens, uniform_token_count)


def split_descriptor(mode: ForwardMode, num_reqs: int, vote: bool) -> BatchExecutionDescriptor:
    """What vLLM's graph manager answers for a split step of this rank's `num_reqs` requests.

    A replay runs FULL at the bucket (vLLM pads inputs and metadata to it); an eager
    split runs NONE at the agreed token count. `vote`: the first of two DP dispatches,
    whose graph mode only votes; an eager split votes FULL so the ranks' minimum keeps it.
    """
    if not mode.split:
        raise ValueError(f"the step does not split (mode {mode})")
    if mode.replay:
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.FULL,
            num_tokens=mode.num_padded_tokens,
            num_reqs=mode.bucket,
            uniform_token_count=mode.query_len,
            num_ubatches=NUM_UBATCHES,
        )
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL if vote else CUDAGraphMode.NONE,
        num_tokens=mode.num_padded_tokens,
        num_reqs=num_reqs,
        num_ubatches=NUM_UBATCHES,
    )


class RequestBlockIds:
    """Each request's KV-cache block ids per group, kept from the scheduler's outputs as
    MRV2's block tables keep them (which hold them on the GPU only): the prefix-cache
    veto reads them on the host."""

    def __init__(self) -> None:
        self._ids: dict[str, list[list[int]]] = {}

    def update(self, scheduler_output) -> None:
        """Apply one step's scheduler output, in MRV2's order: finished and preempted
        requests leave, new ones (resumed ones included) arrive whole, running ones grow."""
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(scheduler_output.preempted_req_ids or ())
        for req_id in gone:
            self._ids.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._ids[new.req_id] = [list(group) for group in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_ids is None:
                continue
            groups = self._ids.setdefault(req_id, [[] for _ in new_ids])
            for group, ids in zip(groups, new_ids, strict=True):
                group.extend(ids)

    def __len__(self) -> int:
        return len(self._ids)

    def tables(
        self, req_ids: Sequence[str], block_sizes: Sequence[int]
    ) -> list[tuple[np.ndarray, int]]:
        """Per KV-cache group, the block table of `req_ids` (rows padded with -1) and its
        block size: what `reads_blocks_written_now` takes."""
        out = []
        for g, block_size in enumerate(block_sizes):
            rows = [self._ids.get(r, [[]] * len(block_sizes))[g] for r in req_ids]
            width = max((len(row) for row in rows), default=0)
            table = np.full((len(rows), width), -1, dtype=np.int64)
            for i, row in enumerate(rows):
                table[i, : len(row)] = row
            out.append((table, block_size))
        return out


@dataclass(frozen=True)
class PlannedSplit:
    """A split step of this rank: the mode, the micro-batches and the requests scheduled."""

    mode: ForwardMode
    slices: tuple[UBatchSlice, UBatchSlice]
    num_reqs: int

    @property
    def straddles(self) -> bool:
        return self.slices[0].request_slice.stop > self.slices[1].request_slice.start


class TboStepPlanner:
    """Plans each MRV2 step (see the module docstring) and counts the steps run.

    `graphs`: the split decode buckets' request graphs; their keys take part in the
    decision only once vLLM has recorded its own graphs (`graphs_live`): before that
    (start-up warm-up) vLLM runs every step eagerly, and so does a split decode step.
    """

    def __init__(
        self,
        config: TboConfig,
        dp_size: int,
        agree: Callable[[BatchShape, TboConfig, Iterable[GraphKey]], ForwardMode] | None = None,
    ):
        if dp_size > 1 and agree is None:
            raise ValueError(f"data parallelism {dp_size} needs an agreement across the ranks")
        self.config = config
        self.dp_size = dp_size
        self._agree = agree
        self.steps: collections.Counter[str] = collections.Counter()
        self.blocks = RequestBlockIds()
        self.graphs: BucketGraphs | None = None
        self.graphs_live = False
        self.split: PlannedSplit | None = None
        self._dispatches = 0

    def stats(self) -> dict[str, int]:
        return {k: self.steps[k] for k in STAT_KINDS}

    def graph_keys(self) -> list[GraphKey]:
        return self.graphs.keys if self.graphs is not None and self.graphs_live else []

    def end_step(self) -> None:
        self.split, self._dispatches = None, 0

    def plan_idle(self) -> None:
        """A dummy run: it never splits, and with DP > 1 it takes part in the agreement as
        an idle rank that keeps the step whole (vLLM runs dummy batches outside the split)."""
        self.end_step()
        if self.dp_size > 1:
            self._decide(BatchShape(0, 0, splittable=False))

    def plan(
        self,
        query_lens: Sequence[int],
        uniform_token_count: int | None,
        reads_blocks_written_now: Callable[[], bool],
    ) -> PlannedSplit | None:
        """Plan this rank's real step (requests in batch order); the split, or None."""
        self.end_step()
        lens = np.asarray(query_lens).tolist()
        shape = step_shape(lens, uniform_token_count)
        config = self.config
        # Only a step that could split is searched for readers of blocks written now.
        could_split = config.prefill and shape.num_tokens >= config.prefill_min_tokens
        if shape.kind == PREFILL and could_split and reads_blocks_written_now():
            self.steps["vetoed"] += 1
            shape = replace(shape, splittable=False)
        mode = self._decide(shape)
        if not mode.split:
            self.steps["unsplit"] += 1
            return None
        slices = maybe_create_ubatch_slices(mode, lens)
        self.split = PlannedSplit(mode, slices, shape.num_reqs)
        return self.split

    def descriptor(self) -> BatchExecutionDescriptor | None:
        """The planned split's descriptor for this dispatch of the step, or None when the
        step does not split (vLLM's own choice stands)."""
        if self.split is None:
            return None
        self._dispatches += 1
        vote = self.dp_size > 1 and self._dispatches == 1
        return split_descriptor(self.split.mode, self.split.num_reqs, vote)

    def count_run(self, split: PlannedSplit) -> None:
        """A split step's micro-batches were prepared: count it by kind."""
        self.steps[split.mode.kind] += 1
        if split.straddles:
            self.steps["straddled"] += 1

    def _decide(self, shape: BatchShape) -> ForwardMode:
        if self.dp_size == 1:
            return ForwardMode.decide([shape], 0, self.config, self.graph_keys())
        return self._agree(shape, self.config, self.graph_keys())
