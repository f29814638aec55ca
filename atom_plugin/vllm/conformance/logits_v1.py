"""The V1 model runner's half of the logits-processor checks (vLLM 0.32 and 0.33; 0.34
removed that runner and its `vllm.v1.sample.logits_processor` module)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor

from atom_plugin.vllm.conformance.logits import (
    LogitsFor,
    Step,
    greedy_token,
    plain_params,
    small_config,
)

__all__ = ["V1LogitsProcessor", "steps_v1"]
# Imported only where vLLM has its V1 model runner (0.32, 0.33); compat checks it there.
ONLY_WITH_RUNNER = "v1"


def steps_v1(
    cls, prompts, *, steps, remove_at, logits_for: LogitsFor, max_reqs, max_len
) -> Iterator[Step]:
    """`steps` steps of the V1 runner over `prompts`; the last request leaves before
    step `remove_at`. Yields each step's logits before and after `apply`."""
    proc = cls(small_config(max_reqs, max_len), torch.device("cpu"), False)
    outputs = [[] for _ in prompts]
    added = [(i, plain_params(), p, outputs[i]) for i, p in enumerate(prompts)]
    proc.update_state(BatchUpdate(batch_size=len(prompts), removed=[], added=added, moved=[]))
    live = list(range(len(prompts)))
    for step in range(steps):
        if step == remove_at:
            gone = live.pop()
            update = BatchUpdate(batch_size=len(live), removed=[gone], added=[], moved=[])
            proc.update_state(update)
        elif step:
            proc.update_state(None)
        logits = logits_for(len(live), step)
        before = logits.clone()
        yield step, before, proc.apply(logits)
        for i in live:
            outputs[i].append(greedy_token(before, i))
