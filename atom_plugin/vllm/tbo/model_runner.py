"""Two-batch overlap inside vLLM's (V1) model runner.

`GPUModelRunner.execute_model` is one long method; `TboModelRunnerMixin`
changes three of the methods it calls and nothing else:

- `_determine_batch_execution_and_padding`: the step planned by the plugin's
  `StepPlanner` (`atom_plugin.tbo.planner`: a decode when every request has one new
  token, the prefix-cache veto, the `ForwardMode` agreed over the DP group in one CPU
  collective, none with DP = 1, and the two micro-batch slices, the only definition of
  the micro-batches);
- `_build_attention_metadata`: when the step splits, every KV-cache group's
  builder (the plugin's and vLLM's own) builds one metadata per micro-batch,
  from vLLM's `CommonAttentionMetadata` cut at those same slices;
- `_model_forward`: the micro-batches run the model on the plugin's
  `MicroBatchRunner`, each with its own vLLM `ForwardContext`; vLLM's `dbo_*`
  yield points hand over through the runner (`atom_plugin.vllm.tbo.dbo_bridge`); the
  hidden states are joined in token order, so sampling, logits processors,
  logprobs and KV-cache writes see what an unsplit step gives them.

On a GPU a split decode step whose bucket has a graph replays the plugin's
split request graph (`atom_plugin.vllm.tbo.decode_graphs`); other split steps run
eagerly. The step's plan lives on the runner's planner from the first of those calls
to the last, because `execute_model` hands nothing else from one to the next.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import (
    DPMetadata,
    create_forward_context,
    get_forward_context,
    override_forward_context,
)
from vllm.platforms import current_platform

from atom_plugin import manager
from atom_plugin.tbo.hazards import reads_blocks_written_now
from atom_plugin.tbo.planner import PlannedSplit, StepPlanner
from atom_plugin.vllm.settings import PluginSettings
from atom_plugin.vllm.tbo import dbo_bridge
from atom_plugin.vllm.tbo.decode_graphs import (
    announce_split_decode_graphs,
    pad_rows_one_token_each,
    split_decode_graphs,
)
from atom_plugin.vllm.tbo.dp_agreement import agree_across_dp
from atom_plugin.vllm.tbo.ubatches import builders_per_ubatch, pad_last_row, vllm_slices


class TboModelRunnerMixin:
    """Put first in the bases of vLLM's `GPUModelRunner` or `CPUModelRunner`."""

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        settings = PluginSettings.from_vllm_config(vllm_config)
        config = settings.tbo_config()
        if config is None:
            raise ValueError("the TBO model runner was built with atom_plugin tbo off")
        dp_size = self.parallel_config.data_parallel_size
        # The step's plan, the split decode graphs (set with the builders), the steps run.
        self.tbo_planner = StepPlanner(config, dp_size, agree_across_dp)
        spec = manager.microbatch_runner()
        if spec is None:
            raise ValueError("no micro-batch runner is registered (atom_microbatch_runner hook)")
        self.tbo_runner = spec.factory(device=self.device)
        self.tbo_runner_name = spec.name
        # Without an all-to-all that yields, the micro-batches run one after the other
        # and vLLM's dbo_* functions must not see them (its MoE asserts as much).
        self._tbo_vllm_yields = dbo_bridge.model_yields(self.parallel_config)
        self._tbo_in_step = False

    def tbo_stats(self) -> dict[str, int]:
        """Steps run, by kind (`atom_plugin.tbo.planner.STAT_KINDS`)."""
        return self.tbo_planner.stats()

    # -- builders: one per micro-batch ---------------------------------------------
    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes) -> None:
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        builders_per_ubatch(self.attn_groups, self.vllm_config, self.device, kernel_block_sizes)
        planner = self.tbo_planner
        backends = [g.backend.get_name() for groups in self.attn_groups for g in groups]
        planner.graphs, why_not = split_decode_graphs(
            planner.config,
            self.device.type,
            graphs_on=self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE,
            capture_sizes=self.cudagraph_batch_sizes,
            max_num_reqs=self.max_num_reqs,
            backends=backends,
            graph_pool=current_platform.get_global_graph_pool,
        )
        announce_split_decode_graphs(planner.graphs, why_not, planner.config, self.device.type)

    # -- the step ----------------------------------------------------------------------
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._tbo_in_step = True
        self.tbo_planner.end_step()
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._tbo_in_step = False
            self.tbo_planner.end_step()

    def _determine_batch_execution_and_padding(
        self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, **kwargs
    ):
        result = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, **kwargs
        )
        planner = self.tbo_planner
        if not self._tbo_in_step:
            # Dummy runs (profiling, idle DP ranks) join the DP agreement as idle ranks
            # that keep the step whole: vLLM runs a dummy batch outside the plugin's
            # runner, so it cannot take part in a split replay.
            planner.plan_idle()
            return result
        query_lens = num_scheduled_tokens_np[:num_reqs].tolist()
        # A decode: every request has one new token.
        split = planner.plan(query_lens, 1, lambda: self._tbo_prefix_hazard(query_lens))
        if split is None:
            return result
        planner.count_run(split)
        mode = split.mode
        _cudagraph_mode, batch_desc, _should_ubatch, num_tokens_across_dp, stats = result
        if mode.replay:
            # vLLM pads the step and its metadata to the bucket as for its FULL graphs;
            # the forward itself is the plugin's split graph (`_model_forward`).
            padded = replace(
                batch_desc, num_tokens=mode.num_padded_tokens, num_reqs=mode.bucket, uniform=True
            )
            return CUDAGraphMode.FULL, padded, False, num_tokens_across_dp, stats
        return CUDAGraphMode.NONE, batch_desc, False, num_tokens_across_dp, stats

    def _tbo_prefix_hazard(self, query_lens: list[int]) -> bool:
        n = len(query_lens)
        tables = [
            (bt.get_numpy_array()[:n], bt.block_size)
            for bt in self.input_batch.block_table.block_tables
        ]
        return reads_blocks_written_now(
            self.input_batch.num_computed_tokens_cpu[:n], query_lens, tables
        )

    def _build_attention_metadata(self, *args, **kwargs):
        step = self.tbo_planner.split
        if step is None:
            return super()._build_attention_metadata(*args, **kwargs)
        kwargs["ubatch_slices"] = vllm_slices(step.slices)
        if step.mode.replay:
            qsl = self.query_start_loc
            pad_rows_one_token_each(qsl.np, qsl.gpu, kwargs["num_reqs"], step.mode.bucket)
            # The step that records the graph plans for any context, as vLLM's capture does.
            graphs = self.tbo_planner.graphs
            kwargs["for_cudagraph_capture"] = not graphs.recorded(step.mode.graph_key)
        return super()._build_attention_metadata(*args, **kwargs)

    def _model_forward(
        self,
        input_ids=None,
        positions=None,
        intermediate_tensors=None,
        inputs_embeds=None,
        **model_kwargs,
    ):
        step = self.tbo_planner.split
        if step is None:
            return super()._model_forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs
            )
        if intermediate_tensors is not None or model_kwargs:
            raise NotImplementedError(
                "TBO splits steps without pipeline-parallel intermediate tensors or extra "
                f"model arguments (got {sorted(model_kwargs)})"
            )
        step_context = get_forward_context()
        num_input = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        token_slices = step.input_slices(num_input)
        contexts = [
            self._tbo_forward_context(step_context, i, ts, step)
            for i, ts in enumerate(token_slices)
        ]

        def run_ubatch(ctx):
            ts, padded = token_slices[ctx.id], step.mode.ubatch_num_tokens[ctx.id]
            n = ts.stop - ts.start
            pad = max(0, padded - n)

            def rows(t, dim=0):  # its tokens of `t`, padded to the agreed count
                return None if t is None else pad_last_row(t.narrow(dim, ts.start, n), pad, dim)

            registration = (
                dbo_bridge.registered(ctx) if self._tbo_vllm_yields else contextlib.nullcontext()
            )
            with registration:
                out = self.model(
                    input_ids=rows(input_ids),
                    # M-RoPE positions are [3, tokens]
                    positions=rows(positions, dim=positions.ndim - 1),
                    intermediate_tensors=None,
                    inputs_embeds=rows(inputs_embeds),
                )
            return out[:n] if pad else out

        def run_split():
            with override_forward_context(step_context):
                outputs = self.tbo_runner.run(
                    run_ubatch, contexts, on_resume=dbo_bridge.install_forward_context
                )
            if isinstance(outputs[0], tuple):  # EAGLE-3 auxiliary hidden states
                return tuple(torch.cat(parts, dim=0) for parts in zip(*outputs, strict=True))
            return torch.cat(outputs, dim=0)

        if step.mode.replay:
            planner = self.tbo_planner
            return planner.graphs.run(step.mode.graph_key, run_split, planner.steps)
        return run_split()

    def _tbo_forward_context(self, step_context, i: int, ts: slice, step: PlannedSplit):
        dp_metadata = None
        if step_context.dp_metadata is not None:
            agreed = step.mode.ubatch_num_tokens[i]
            dp_size = self.parallel_config.data_parallel_size
            dp_metadata = DPMetadata.make(
                self.parallel_config, agreed, torch.tensor([agreed] * dp_size, dtype=torch.int32)
            )
        slot_mapping = step_context.slot_mapping
        return create_forward_context(
            step_context.attn_metadata[i],
            self.vllm_config,
            dp_metadata=dp_metadata,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping={name: m[ts] for name, m in slot_mapping.items()}
            if slot_mapping
            else None,
            additional_kwargs=step_context.additional_kwargs,
            skip_compiled=step_context.skip_compiled,
            is_padding=None if step_context.is_padding is None else step_context.is_padding[ts],
        )
