"""Model Runner V2's parts of the step plan: its planner, descriptor and block-id mirror.

MRV2's `execute_model` calls `gather_batch_req_state` once per step on every DP
rank, dummy runs included, before any of its own DP collectives. The plugin's runner
plans the step there with `TboStepPlanner`, the shared `StepPlanner`
(`atom_plugin.tbo.planner`: shape, prefix-cache veto, DP agreement, decision, slices)
with what MRV2 adds: a decode is what vLLM found a uniform decode batch (its
`uniform_token_count`), the prefix-cache veto reads the block ids kept from vLLM's
scheduler outputs (`RequestBlockIds`), and graph keys count only once vLLM has
recorded its own graphs.

vLLM then asks its graph manager which descriptor the step runs as
(`CudaGraphManager.dispatch`). For a split step the plugin's manager answers with
`split_descriptor`: two micro-batches, FULL at the bucket for a split graph replay,
NONE (eager) otherwise. With DP > 1 vLLM dispatches twice: once for each rank's
vote (the smallest graph mode over the ranks wins, and NONE would drop the split)
and once for the agreed descriptor. Every rank planned the same split, so each
votes FULL and all of them reach the second call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from atom_plugin.tbo.mode import ForwardMode, GraphKey, TboConfig
from atom_plugin.tbo.planner import Agree, StepPlanner
from atom_plugin.tbo.runner import NUM_UBATCHES


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


class TboStepPlanner(StepPlanner):
    """The step planner of the plugin's MRV2 runner (see the module docstring).

    The split decode buckets' keys take part in the decision only once vLLM has
    recorded its own graphs (`graphs_live`): before that (start-up warm-up) vLLM runs
    every step eagerly, and so does a split decode step.
    """

    def __init__(self, config: TboConfig, dp_size: int, agree: Agree | None = None):
        super().__init__(config, dp_size, agree)
        self.blocks = RequestBlockIds()
        self.graphs_live = False
        self._dispatches = 0

    def graph_keys(self) -> list[GraphKey]:
        return super().graph_keys() if self.graphs_live else []

    def end_step(self) -> None:
        super().end_step()
        self._dispatches = 0

    def descriptor(self) -> BatchExecutionDescriptor | None:
        """The planned split's descriptor for this dispatch of the step, or None when the
        step does not split (vLLM's own choice stands)."""
        if self.split is None:
            return None
        self._dispatches += 1
        vote = self.dp_size > 1 and self._dispatches == 1
        return split_descriptor(self.split.mode, self.split.num_reqs, vote)
