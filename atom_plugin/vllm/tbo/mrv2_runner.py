"""Two-batch overlap inside vLLM's Model Runner V2 (MRV2), the GPU runner of vLLM 0.32-0.34.

`AtomTboMRV2ModelRunner` is vLLM's MRV2 `GPUModelRunner` with three of its parts
answering for the plugin (docs/tbo.md, "Model Runner V2"):

- `gather_batch_req_state`, which `execute_model` calls once per step on every DP
  rank: the step is planned there (`mrv2_plan.TboStepPlanner`: shape, prefix-cache
  veto, DP agreement, `ForwardMode.decide`, the slices);
- `self.ubatch_runner` (`mrv2_ubatch.TboUBatchRunner`): each micro-batch's metadata
  from every attention group's builder for that micro-batch, the micro-batches run on
  the plugin's `MicroBatchRunner`, split decode buckets recorded and replayed;
- `self.cudagraph_manager` (`mrv2_graphs.TboCudaGraphManager`): the split step's
  descriptor, and the replay of its graph.

Both objects are put in place after vLLM's `initialize_kv_cache` built its own,
together with a second metadata builder per attention group (one per micro-batch).
"""

from __future__ import annotations

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from atom_plugin import manager
from atom_plugin.tbo.hazards import reads_blocks_written_now
from atom_plugin.vllm.compat.mrv2 import decode_graph_sizes
from atom_plugin.vllm.settings import PluginSettings
from atom_plugin.vllm.tbo.decode_graphs import announce_split_decode_graphs, split_decode_graphs
from atom_plugin.vllm.tbo.dp_agreement import agree_across_dp
from atom_plugin.vllm.tbo.mrv2_graphs import TboCudaGraphManager
from atom_plugin.vllm.tbo.mrv2_plan import TboStepPlanner
from atom_plugin.vllm.tbo.mrv2_ubatch import TboUBatchRunner
from atom_plugin.vllm.tbo.ubatches import builders_per_ubatch


class AtomTboMRV2ModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        config = PluginSettings.from_vllm_config(vllm_config).tbo_config()
        if config is None:
            raise ValueError("the TBO model runner was built with atom_plugin tbo off")
        spec = manager.microbatch_runner()
        if spec is None:
            raise ValueError("no micro-batch runner is registered (atom_microbatch_runner hook)")
        self.tbo_micro_batches = spec.factory(device=self.device)
        self.tbo_runner_name = spec.name
        dp_size = self.parallel_config.data_parallel_size
        self.tbo_planner = TboStepPlanner(config, dp_size, agree_across_dp)

    def tbo_stats(self) -> dict[str, int]:
        """Steps run, by kind (`atom_plugin.tbo.planner.STAT_KINDS`)."""
        return self.tbo_planner.stats()

    # -- set-up ----------------------------------------------------------------------
    def initialize_kv_cache(self, kv_cache_config, is_profiling=False, **kwargs):
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling, **kwargs)
        builders_per_ubatch(
            self.attn_groups, self.vllm_config, self.device, self.kernel_block_sizes
        )
        self.ubatch_runner = TboUBatchRunner(
            self.vllm_config,
            self.device,
            self.model_state,
            self.attn_groups,
            self.kv_cache_config,
            self.max_num_reqs,
            model_runner=self,
        )
        TboCudaGraphManager.adopt(self.cudagraph_manager, self.ubatch_runner)
        self._tbo_plan_graphs(announce=not is_profiling)

    def _tbo_plan_graphs(self, announce: bool) -> None:
        planner, graph_manager = self.tbo_planner, self.cudagraph_manager
        backends = [g.backend.get_name() for groups in self.attn_groups for g in groups]
        planner.graphs, why_not = split_decode_graphs(
            planner.config,
            self.device.type,
            graphs_on=graph_manager.cudagraph_mode != CUDAGraphMode.NONE,
            capture_sizes=decode_graph_sizes(graph_manager),
            max_num_reqs=self.max_num_reqs,
            backends=backends,
            graph_pool=lambda: graph_manager.pool,
        )
        if announce:
            announce_split_decode_graphs(planner.graphs, why_not, planner.config, self.device.type)

    # -- the step ----------------------------------------------------------------------
    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.tbo_planner.config.prefill:  # only the prefix-cache veto reads the block ids
            self.tbo_planner.blocks.update(scheduler_output)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self.tbo_planner.end_step()
            if isinstance(self.ubatch_runner, TboUBatchRunner):
                self.ubatch_runner.end_step()

    def gather_batch_req_state(self, scheduler_output, dummy_run):
        state, uniform_token_count = super().gather_batch_req_state(scheduler_output, dummy_run)
        if state is None:
            self.tbo_planner.plan_idle()
        else:
            self.tbo_planner.plan(
                state.num_scheduled_tokens.tolist(),
                uniform_token_count,
                lambda: self._tbo_reads_blocks_written_now(state),
            )
        return state, uniform_token_count

    def _tbo_reads_blocks_written_now(self, state) -> bool:
        tables = self.tbo_planner.blocks.tables(state.req_ids, self.block_tables.block_sizes)
        num_computed = self.req_states.num_computed_tokens_np[state.idx_mapping_np]
        return reads_blocks_written_now(num_computed, state.num_scheduled_tokens, tables)
