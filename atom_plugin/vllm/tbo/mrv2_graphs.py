"""vLLM's Model Runner V2 graph manager, answering for the plugin's split steps.

MRV2 decides how a step runs by asking `self.cudagraph_manager.dispatch(...)`
(through `dispatch_cg_and_sync_dp`, which with DP = 1 does nothing else) and runs a
FULL step with `run_fullgraph(desc)`. `TboCudaGraphManager` answers a step the
plugin planned to split with the split's descriptor, and replays a split decode
bucket's request graph; every other step gets vLLM's own answer and graphs.

vLLM builds its manager inside `initialize_kv_cache` from arguments that change
between releases; the plugin's runner adopts the built object (`adopt`) rather than
building another, so every holder of it (vLLM's fast-prefill helper among them)
sees the same manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

if TYPE_CHECKING:
    from atom_plugin.vllm.tbo.mrv2_ubatch import TboUBatchRunner


class TboCudaGraphManager(ModelCudaGraphManager):
    """Set up only by `adopt` (vLLM's constructor has run on the adopted object)."""

    tbo_ubatch_runner: TboUBatchRunner  # the split steps' runner, set by `adopt`

    @classmethod
    def adopt(
        cls, manager: ModelCudaGraphManager, ubatch_runner: TboUBatchRunner
    ) -> TboCudaGraphManager:
        """Make vLLM's `manager` answer for the split steps `ubatch_runner` runs."""
        if type(manager) is not ModelCudaGraphManager:
            raise TypeError(
                f"TBO adopts vLLM's ModelCudaGraphManager; this runner built a "
                f"{type(manager).__module__}.{type(manager).__qualname__}"
            )
        manager.__class__ = cls
        manager.tbo_ubatch_runner = ubatch_runner
        ubatch_runner.planner.graphs_live = False
        return manager

    def dispatch(
        self,
        num_reqs,
        num_tokens,
        uniform_token_count,
        num_active_loras,
        max_query_len=None,
        num_ubatches=1,
    ):
        desc = self.tbo_ubatch_runner.planner.descriptor()
        if desc is not None:
            return desc
        return super().dispatch(
            num_reqs,
            num_tokens,
            uniform_token_count,
            num_active_loras,
            max_query_len=max_query_len,
            num_ubatches=num_ubatches,
        )

    def capture(self, *args, **kwargs):
        super().capture(*args, **kwargs)
        # vLLM replays graphs from here on; so do the split decode buckets.
        self.tbo_ubatch_runner.planner.graphs_live = True

    def run_fullgraph(self, desc):
        if desc.num_ubatches > 1:
            return self.tbo_ubatch_runner.replay(desc)
        return super().run_fullgraph(desc)
