"""Decode steps of the test model replayed from request graphs (CUDA only).

Every bucket of the plan is captured once, up front or (`record_on_first_step`,
as inside vLLM's runner) on the first step that replays it, both through
`BucketGraphs`; a split bucket's graph holds both micro-batches (the runner's
workers issue onto the capture stream and the comm stream forked from it). A
step refreshes the static buffers in place - input ids, the bucket's metadata
and each micro-batch's metadata cut at the bucket - and replays.
"""

from __future__ import annotations

from collections import Counter

import torch

from atom_plugin.tbo import (
    BatchShape,
    ForwardMode,
    MicroBatchRunner,
    TboConfig,
    decode_ubatch_ranges,
    plan_request_graphs,
)
from atom_plugin.tbo.graphs import BucketGraphs, RequestGraphs

from .batches import Batch
from .graph_buffers import DecodeGraphBuffers
from .model import KVCaches, TboTestModel


class GraphedDecoder:
    def __init__(
        self,
        model: TboTestModel,
        caches: KVCaches,
        runner: MicroBatchRunner,
        buckets: list[int],
        config: TboConfig,
        max_blocks_per_req: int,
        capture_error_mode: str = "thread_local",
        graphs=None,
        record_on_first_step: bool = False,
    ):
        """`graphs` replaces the CUDA `RequestGraphs` (CPU tests pass `RerunGraphs`).
        `steps` counts the graphs "captured" and the steps "replayed"."""
        self.model, self.caches, self.runner, self.config = model, caches, runner, config
        planned = plan_request_graphs(buckets, 1, config)
        self.plan = dict(planned)
        self.graphs = graphs or RequestGraphs(model.device, capture_error_mode=capture_error_mode)
        self.recorder = BucketGraphs(self.graphs, planned)
        self.steps: Counter = Counter()
        self.buffers: dict = {}
        self.input_ids: dict = {}
        self.step_fns: dict = {}
        for key in sorted(self.plan, key=lambda k: -k.bucket):  # largest first: the pool is shared
            split = self.plan[key]
            bufs = DecodeGraphBuffers(
                key, split, max_blocks_per_req, model.cfg.block_size, model.device
            )
            ids = torch.zeros(key.bucket, dtype=torch.int64, device=model.device)
            self.buffers[key], self.input_ids[key] = bufs, ids
            self.step_fns[key] = self._step_fn(key, split, bufs, ids)
            if not record_on_first_step:
                self.graphs.capture(key, self.step_fns[key])
                self.steps["captured"] += 1

    def _step_fn(self, key, split, bufs, ids):
        # The step closes over what it reads, never `self`: the decoder holds its steps,
        # and a cycle would leave its graphs to the cyclic collector (`RequestGraphs`).
        model, caches, runner = self.model, self.caches, self.runner
        if not split:
            return lambda: model.forward(ids, bufs.full.meta, caches)
        views = [ids[a:b] for a, b in decode_ubatch_ranges(key.bucket).tokens]
        metas = list(bufs.ubatches)

        def ubatch(ctx):
            return model.forward(views[ctx.id], ctx.forward_context, caches)

        return lambda: torch.cat(runner.run(ubatch, metas))

    def mode(self, batch: Batch) -> ForwardMode:
        shape = BatchShape.from_query_lens(batch.query_lens)
        return ForwardMode.decide([shape], 0, self.config, list(self.plan))

    def step(self, batch: Batch, mode: ForwardMode | None = None) -> torch.Tensor:
        """Hidden states of the batch's tokens (a view of the graph's static output).

        `mode` is the step's mode agreed across DP ranks (`decide_across_dp`);
        without it the decoder decides for this rank alone.
        """
        mode = mode or self.mode(batch)
        if not mode.replay:
            raise ValueError(f"{batch.meta.num_reqs} requests exceed the largest bucket")
        key = mode.graph_key
        if mode.split != self.plan[key]:
            raise AssertionError(f"graph {key} was recorded split={self.plan[key]}, mode {mode}")
        n, meta = batch.meta.num_reqs, batch.meta
        ids = self.input_ids[key]
        ids[:n].copy_(batch.input_ids)
        ids[n:].zero_()
        self.buffers[key].refresh(meta)
        return self.recorder.run(key, self.step_fns[key], self.steps)[:n]
