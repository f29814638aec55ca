"""What the logits-processor checks ask of vLLM: the `LogitsProcessor` interface of each
model runner, and a batch of plain requests driven through a processor as that runner
drives it, on vLLM's own request state on CPU (MRV2: `RequestState` with vLLM's CPU
buffers; the committed ids are written into it as the runner's post-processing does).
The V1 runner's half (`logits_v1`) is imported only where vLLM still has that runner."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU buffers for MRV2)
from vllm.config import SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcRequestState,
)
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsProcessor as MRV2LogitsProcessor,
)
from vllm.v1.worker.gpu.states import RequestState

from atom_plugin.vllm.compat.runners import has_v1_runner

# One step: (step, logits before apply, what apply returned).
Step = tuple[int, torch.Tensor, torch.Tensor]
LogitsFor = Callable[[int, int], torch.Tensor]  # (rows, step) -> logits


def runners() -> tuple[str, ...]:
    """The model runners this vLLM has."""
    return ("v1", "mrv2") if has_v1_runner() else ("mrv2",)


def interface(runner: str) -> type:
    """The `LogitsProcessor` base class of `runner` (one of `runners()`)."""
    if runner == "v1":
        from atom_plugin.vllm.conformance.logits_v1 import V1LogitsProcessor

        return V1LogitsProcessor
    return MRV2LogitsProcessor


def steps(runner: str, cls, prompts, **batch) -> Iterator[Step]:
    """`steps_v1` or `steps_mrv2`: a batch driven as `runner` drives it."""
    if runner == "v1":
        from atom_plugin.vllm.conformance.logits_v1 import steps_v1

        batch.pop("vocab")  # V1 processors are built without the vocabulary size
        return steps_v1(cls, prompts, **batch)
    return steps_mrv2(cls, prompts, **batch)


def plain_params() -> SamplingParams:
    return SamplingParams(max_tokens=8)


def small_config(max_reqs: int, max_len: int) -> VllmConfig:
    return VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_reqs, max_model_len=max_len, is_encoder_decoder=False
        )
    )


def greedy_token(before: torch.Tensor, row: int) -> int:
    """The token a greedy sampler takes from the row the processor saw (NaN never wins)."""
    return int(before[row].nan_to_num(-1e9).argmax())


def steps_mrv2(
    cls, prompts, *, steps, remove_at, logits_for: LogitsFor, max_reqs, max_len, vocab
) -> Iterator[Step]:
    """`steps` steps of the MRV2 runner over `prompts`; the last request sits out step
    `remove_at` (left out of the step's batch, not removed from the processor). Yields each
    step's logits before and after `apply`."""
    states = RequestState(max_reqs, max_len, max_len, 0, vocab, torch.device("cpu"))
    proc = cls(small_config(max_reqs, max_len), LogitsProcRequestState.from_request_state(states))
    tokens = {}
    for i, prompt in enumerate(prompts):
        name = f"req-{i}"
        states.add_request(name, len(prompt), prompt, 0, 32)
        slot = states.req_id_to_index[name]
        tokens[slot] = list(prompt)
        proc.add_request(slot, plain_params())
    for step in range(steps):
        slots = sorted(tokens)
        if step == remove_at:
            slots = slots[:-1]
        for slot in slots:
            ids = tokens[slot]
            states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
            states.total_len.gpu[slot] = len(ids)
        proc.apply_staged_writes()
        logits = logits_for(len(slots), step)
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
            input_ids=torch.tensor([tokens[s][-1] for s in slots], dtype=torch.int32),
            pos=torch.arange(len(slots), dtype=torch.int64),
            seq_lens_upper_bound_np=np.array([max_len] * len(slots), dtype=np.int32),
        )
        before = logits.clone()
        yield step, before, proc.apply(logits, ctx)
        for row, slot in enumerate(slots):
            tokens[slot].append(greedy_token(before, row))
