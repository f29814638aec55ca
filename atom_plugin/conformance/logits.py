"""Logits processors through the interface of the model runner they name.

Contract items:
- resolves: the class path imports and subclasses the runner's `LogitsProcessor`
  (V1: `vllm.v1.sample.logits_processor`; MRV2:
  `vllm.v1.worker.gpu.sample.logits_processor.interface`), built as that runner builds it;
- accepts plain requests: `validate_params(SamplingParams())` does not raise;
- unconstrained rows stay bit-identical: over several steps of a batch of requests
  with no constraint of the processor's (requests added, tokens committed, one removed),
  every logits row `apply` returns equals its input bit for bit, -inf and NaN included.

The batches are vLLM's own request state on CPU (MRV2: `RequestState` with vLLM's CPU
buffers; the committed ids are written into it as the runner's post-processing does).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from atom_plugin.conformance import Check, Finding, checks_of, load
from atom_plugin.specs import LogitsProcessorSpec

HOOK = "atom_logits_processors"
VOCAB, MAX_REQS, MAX_LEN, STEPS = 96, 8, 64, 4
INTERFACES = {
    "v1": "vllm.v1.sample.logits_processor:LogitsProcessor",
    "mrv2": "vllm.v1.worker.gpu.sample.logits_processor.interface:LogitsProcessor",
}


def checks_for(module, plugin: str) -> list[Check]:
    return checks_of(
        module,
        plugin,
        HOOK,
        lambda spec: f"logits processor {spec.name} [{spec.runner}]",
        check_processor,
    )


def _config():
    from vllm.config import SchedulerConfig, VllmConfig

    return VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_REQS, max_model_len=MAX_LEN, is_encoder_decoder=False
        )
    )


def _logits(rows: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[:, 2] = float("-inf")
    logits[:, 3] = float("nan")
    return logits


def _differs(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    same = (before.view(torch.int32) == after.view(torch.int32)).all(dim=1)
    return (~same).nonzero().flatten().tolist()


def check_processor(spec: LogitsProcessorSpec, label: str) -> Iterator[Finding]:
    def finding(item, ok, detail="", case="-"):
        return Finding(label, item, case, ok, detail)

    try:
        from vllm.sampling_params import SamplingParams

        cls = load(spec.class_path)
        base = load(INTERFACES[spec.runner])
        if not (isinstance(cls, type) and issubclass(cls, base)):
            yield finding("resolves", False, f"{spec.class_path} does not subclass {base}")
            return
    except Exception as exc:
        yield finding("resolves", False, f"{spec.class_path}: {exc!r}")
        return
    yield finding("resolves", True, spec.class_path)
    try:
        cls.validate_params(SamplingParams(max_tokens=8))
        yield finding("accepts plain requests", True)
    except Exception as exc:
        yield finding("accepts plain requests", False, f"validate_params raised {exc!r}")
    run = _steps_v1 if spec.runner == "v1" else _steps_mrv2
    case = f"{STEPS} steps, 4 plain requests, one removed after step 2"
    try:
        changed = run(cls)
    except Exception as exc:
        yield finding("unconstrained rows stay bit-identical", False, f"raised {exc!r}", case)
        return
    detail = "; ".join(f"step {s} rows {rows}" for s, rows in changed)
    yield finding("unconstrained rows stay bit-identical", not changed, detail, case)


def _prompts():
    return [[5 + i, 9, 11 + i] for i in range(4)]


def _steps_v1(cls) -> list[tuple[int, list[int]]]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    proc = cls(_config(), torch.device("cpu"), False)
    outputs = [[] for _ in range(4)]
    added = [(i, SamplingParams(max_tokens=8), p, outputs[i]) for i, p in enumerate(_prompts())]
    proc.update_state(BatchUpdate(batch_size=4, removed=[], added=added, moved=[]))
    live = [0, 1, 2, 3]
    changed = []
    for step in range(STEPS):
        if step == 2:
            proc.update_state(BatchUpdate(batch_size=3, removed=[3], added=[], moved=[]))
            live = [0, 1, 2]
        elif step:
            proc.update_state(None)
        logits = _logits(len(live), step)
        before = logits.clone()
        after = proc.apply(logits)
        if rows := _differs(before, after):
            changed.append((step, rows))
        for i in live:
            outputs[i].append(int(before[i].nan_to_num(-1e9).argmax()))
    return changed


def _steps_mrv2(cls) -> list[tuple[int, list[int]]]:
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU buffers for MRV2)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsContext,
        LogitsProcRequestState,
    )
    from vllm.v1.worker.gpu.states import RequestState

    states = RequestState(MAX_REQS, MAX_LEN, MAX_LEN, 0, VOCAB, torch.device("cpu"))
    proc = cls(_config(), LogitsProcRequestState.from_request_state(states))
    tokens = {}
    for i, prompt in enumerate(_prompts()):
        name = f"req-{i}"
        states.add_request(name, len(prompt), prompt, 0, 32)
        slot = states.req_id_to_index[name]
        tokens[slot] = list(prompt)
        proc.add_request(slot, SamplingParams(max_tokens=8))
    changed = []
    for step in range(STEPS):
        slots = sorted(tokens)
        if step == 2:
            slots = slots[:3]
        for slot in slots:
            ids = tokens[slot]
            states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
            states.total_len.gpu[slot] = len(ids)
        proc.apply_staged_writes()
        logits = _logits(len(slots), step)
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
            input_ids=torch.tensor([tokens[s][-1] for s in slots], dtype=torch.int32),
            pos=torch.arange(len(slots), dtype=torch.int64),
            seq_lens_upper_bound_np=np.array([MAX_LEN] * len(slots), dtype=np.int32),
        )
        before = logits.clone()
        after = proc.apply(logits, ctx)
        if rows := _differs(before, after):
            changed.append((step, rows))
        for row, slot in enumerate(slots):
            tokens[slot].append(int(before[row].nan_to_num(-1e9).argmax()))
    return changed
