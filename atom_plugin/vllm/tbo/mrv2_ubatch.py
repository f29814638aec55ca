"""The micro-batches of a split Model Runner V2 step, run on the plugin's runner.

MRV2's `execute_model` hands a step with two micro-batches (`num_ubatches` 2 in its
descriptor, `atom_plugin.vllm.tbo.mrv2_plan`) to `self.ubatch_runner`:
`prepare(input_batch, block_tables, slot_mappings, ...)`, then `run(model,
model_inputs, state)` on an eager step, or the graph manager's `run_fullgraph` on a
FULL one. `TboUBatchRunner` takes that place (vLLM builds its own only for
`--enable-dbo` with DP > 1):

- `prepare` cuts the step at the planned slices (`maybe_create_ubatch_slices`, the
  one split rule): vLLM's `_slice_input_batch` rebases each micro-batch's query
  offsets and sequence lengths into buffers of this runner, and the model state's
  `prepare_attn` has every attention group's builder for that micro-batch
  (`ubatch_idx`) build its metadata from them. A replayed bucket's padding rows own
  one token each (context 0, slot -1), so both halves are uniform one-token decodes.
- `run` runs both micro-batches on the plugin's `MicroBatchRunner`, each under its
  own vLLM forward context, and joins the hidden states in token order.
- `replay` serves the FULL descriptor of a split decode bucket: the bucket's request
  graph (`BucketGraphs`), recorded on its first step with metadata built as for a
  capture and replayed from then on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import (
    DPMetadata,
    create_forward_context,
    get_forward_context,
    override_forward_context,
    set_forward_context,
)
from vllm.v1.attention.backends.utils import PAD_SLOT_ID
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
from vllm.v1.worker.gpu.ubatch_utils import (
    UBatchRunner,
    _slice_input_batch,
    merge_ubatch_outputs,
    slice_model_inputs,
)
from vllm.v1.worker.ubatch_utils import UBatchSlice as VllmUBatchSlice

from atom_plugin.tbo.mode import DECODE, ForwardMode
from atom_plugin.tbo.planner import PlannedSplit
from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.vllm.tbo import dbo_bridge
from atom_plugin.vllm.tbo.decode_graphs import pad_rows_one_token_each
from atom_plugin.vllm.tbo.ubatches import pad_last_row, vllm_slices


@dataclass(frozen=True)
class PreparedUBatch:
    """One micro-batch's metadata, slot mappings and padding mask, and the rows it pads
    on to the token count all DP ranks agreed on (eager splits with DP > 1)."""

    attn_metadata: dict
    slot_mappings: torch.Tensor  # [KV-cache groups, tokens]
    is_padding: torch.Tensor | None
    pad: int


@dataclass(frozen=True)
class SplitState:
    """What `prepare` hands vLLM for the step (vLLM reads `slices`)."""

    split: PlannedSplit
    slices: list[VllmUBatchSlice]
    ubatches: tuple[PreparedUBatch, PreparedUBatch]


def ubatch_input_batches(
    input_batch,
    mode: ForwardMode,
    slices: list[VllmUBatchSlice],
    query_start_loc_bufs,
    seq_lens_bufs,
):
    """Each micro-batch's `InputBatch`, cut at `slices` by vLLM's `_slice_input_batch`
    into the persistent buffers given (one per micro-batch)."""
    if mode.replay:
        qsl_np, qsl = input_batch.query_start_loc_np, input_batch.query_start_loc
        pad_rows_one_token_each(qsl_np, qsl, input_batch.num_reqs, mode.bucket)
    out = []
    for i, vs in enumerate(slices):
        ub = _slice_input_batch(input_batch, vs, query_start_loc_bufs[i], seq_lens_bufs[i])
        if mode.kind == DECODE:
            # A half of padding rows only has no real row to take its longest query from.
            ub = replace(ub, max_query_len=mode.query_len)
        out.append(ub)
    return out


def _trim(out, n: int):
    """The first `n` token rows of a model output (tensor, or tuple/list of them)."""
    if isinstance(out, torch.Tensor):
        return out[:n]
    return type(out)(_trim(part, n) for part in out)


def _zero_rows(out, total: int):
    """`out` extended with zero rows to `total` token rows (the step's own DP padding)."""
    if isinstance(out, torch.Tensor):
        if out.shape[0] >= total:
            return out
        return torch.cat([out, out.new_zeros((total - out.shape[0], *out.shape[1:]))])
    return type(out)(_zero_rows(part, total) for part in out)


class TboUBatchRunner(UBatchRunner):
    """vLLM's micro-batch runner role in `GPUModelRunner`, played by the plugin.

    vLLM's constructor is not run: it starts the threads, CUDA streams and SM control
    of vLLM's own micro-batching. The micro-batches run on the plugin's runner instead
    (`model_runner.tbo_micro_batches`); `model_runner` is the plugin's MRV2 runner,
    which holds the step's plan.
    """

    def __init__(
        self,
        vllm_config,
        device,
        model_state,
        attn_groups,
        kv_cache_config,
        max_num_reqs,
        model_runner=None,
    ):
        if model_runner is None:
            raise ValueError("TboUBatchRunner is built by the plugin's MRV2 model runner")
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.device = device
        self.model_state = model_state
        self.attn_groups = attn_groups
        self.kv_cache_config = kv_cache_config
        self.num_ubatches = NUM_UBATCHES
        self.model_runner = model_runner
        self.planner = model_runner.tbo_planner
        # Rebased per micro-batch, so not views of the step's: fixed addresses for replays.
        self.query_start_loc_bufs = [
            torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
            for _ in range(NUM_UBATCHES)
        ]
        self.seq_lens_bufs = [
            torch.zeros(max_num_reqs, dtype=torch.int32, device=device) for _ in range(NUM_UBATCHES)
        ]
        # Without an all-to-all that yields, the micro-batches run one after the other
        # and vLLM's dbo_* functions must not see them (its MoE asserts as much).
        self._vllm_yields = dbo_bridge.model_yields(self.parallel_config)
        self._state: SplitState | None = None

    def end_step(self) -> None:
        self._state = None

    def prepare(self, input_batch, block_tables, slot_mappings, *args, for_capture=False, **kwargs):
        """Cut the step into the planned micro-batches and build each one's metadata.

        vLLM's other arguments (the descriptor, or its graph mode in 0.32 and 0.33; DP
        state; `for_capture`, which vLLM sets for dummy runs only, and those never split)
        describe what the plan already fixed.
        """
        split = self.planner.split
        if split is None:
            raise RuntimeError("vLLM split a step that the plugin's TBO did not plan to split")
        mode = split.mode
        cg_mode = CUDAGraphMode.FULL if mode.replay else CUDAGraphMode.NONE
        # The step that records a bucket's graph plans for any context, as vLLM's capture does.
        recording = mode.replay and not self.planner.graphs.recorded(mode.graph_key)
        ubatches = []
        slices = vllm_slices(split.slices)
        batches = ubatch_input_batches(
            input_batch, mode, slices, self.query_start_loc_bufs, self.seq_lens_bufs
        )
        for i, (s, ub) in enumerate(zip(split.slices, batches, strict=True)):
            tables = tuple(table[s.request_slice] for table in block_tables)
            slots = slot_mappings[:, s.token_slice]
            metadata = self.model_state.prepare_attn(
                ub,
                cg_mode,
                tables,
                slots,
                self.attn_groups,
                self.kv_cache_config,
                for_capture=recording,
                ubatch_idx=i,
            )
            pad = s.num_padded_tokens - s.num_tokens
            ubatches.append(PreparedUBatch(metadata, slots, ub.is_padding, pad))
        self.planner.count_run(split)
        self._state = SplitState(split, slices, (ubatches[0], ubatches[1]))
        return self._state

    def run(self, model, model_inputs, ubatch_state):
        """An eager split step: vLLM's forward context for the step is current."""
        return self._run_split(model, model_inputs, ubatch_state)

    def replay(self, desc):
        """A split decode bucket's graph: recorded on its first step, replayed after."""
        state = self._state
        if state is None or not state.split.mode.replay:
            raise RuntimeError(f"no split replay was prepared for {desc}")
        planner = self.planner
        key = state.split.mode.graph_key
        # Only the bucket's first step records `step`; its replays read the buffers it read.
        step = None if planner.graphs.recorded(key) else self._recorded_step(desc, state)
        return planner.graphs.run(key, step, planner.steps)

    def _recorded_step(self, desc, state: SplitState):
        """The step a split bucket's graph records."""
        runner = self.model_runner
        n = desc.num_tokens
        # The step's inputs in vLLM's persistent buffers, as vLLM's own capture reads them.
        model_inputs = {
            "input_ids": runner.input_buffers.input_ids[:n],
            "positions": runner.input_buffers.positions[:n],
            "intermediate_tensors": None,
            **self.model_state.prepare_dummy_inputs(desc.num_reqs, n),
        }
        dp_size = self.parallel_config.data_parallel_size
        across_dp = torch.full((dp_size,), n, dtype=torch.int32) if dp_size > 1 else None

        def step():
            with set_forward_context(
                None, self.vllm_config, num_tokens=n, num_tokens_across_dp=across_dp
            ):
                return self._run_split(runner.model, model_inputs, state)

        return step

    def _run_split(self, model, model_inputs, state: SplitState):
        step_context = get_forward_context()
        contexts = [self._ubatch_context(step_context, state, i) for i in range(NUM_UBATCHES)]
        slices = state.split.slices

        def run_ubatch(ctx):
            ubatch, s = state.ubatches[ctx.id], slices[ctx.id]
            inputs = slice_model_inputs(model_inputs, s.token_slice)
            if ubatch.pad:
                for key in ("input_ids", "inputs_embeds"):
                    if key in inputs:
                        inputs[key] = pad_last_row(inputs[key], ubatch.pad)
                positions = inputs["positions"]  # M-RoPE positions are [3, tokens]
                inputs["positions"] = pad_last_row(positions, ubatch.pad, dim=positions.ndim - 1)
            registration = (
                dbo_bridge.registered(ctx) if self._vllm_yields else contextlib.nullcontext()
            )
            with registration:
                out = model(**inputs)
            return _trim(out, s.num_tokens) if ubatch.pad else out

        with override_forward_context(step_context):
            outputs = self.model_runner.tbo_micro_batches.run(
                run_ubatch, contexts, on_resume=dbo_bridge.install_forward_context
            )
        joined = merge_ubatch_outputs(outputs)
        tokens = model_inputs.get("input_ids")
        if tokens is None:
            tokens = model_inputs["inputs_embeds"]
        return _zero_rows(joined, tokens.shape[0])

    def _ubatch_context(self, step_context, state: SplitState, i: int):
        ubatch, s = state.ubatches[i], state.split.slices[i]
        dp_metadata = None
        if step_context.dp_metadata is not None:
            agreed = s.num_padded_tokens
            dp_size = self.parallel_config.data_parallel_size
            across = torch.full((dp_size,), agreed, dtype=torch.int32)
            dp_metadata = DPMetadata.make(self.parallel_config, agreed, across)
        slots = ubatch.slot_mappings
        is_padding = ubatch.is_padding
        if ubatch.pad:
            slots = torch.nn.functional.pad(slots, (0, ubatch.pad), value=PAD_SLOT_ID)
            if is_padding is not None:
                is_padding = torch.cat([is_padding, is_padding.new_ones(ubatch.pad)])
        return create_forward_context(
            ubatch.attn_metadata,
            self.vllm_config,
            dp_metadata=dp_metadata,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=build_slot_mappings_by_layer(slots, self.kv_cache_config),
            additional_kwargs=step_context.additional_kwargs,
            skip_compiled=step_context.skip_compiled,
            is_padding=is_padding,
        )
