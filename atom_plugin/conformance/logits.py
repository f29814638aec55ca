"""Logits processors through the interface of the model runner they name.

Contract items:
- resolves: the class path imports and subclasses the runner's `LogitsProcessor`
  (V1: `vllm.v1.sample.logits_processor`; MRV2:
  `vllm.v1.worker.gpu.sample.logits_processor.interface`), built as that runner builds it;
- accepts plain requests: `validate_params(SamplingParams())` does not raise;
- unconstrained rows stay bit-identical: over several steps of a batch of requests
  with no constraint of the processor's (requests added, tokens committed, one removed),
  every logits row `apply` returns equals its input bit for bit, -inf and NaN included.

The batches are vLLM's own request state on CPU, driven by `atom_plugin.vllm.conformance.logits`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from atom_plugin.conformance.findings import Check, Finding, checks_of, load
from atom_plugin.specs import LogitsProcessorSpec

HOOK = "atom_logits_processors"
VOCAB, MAX_REQS, MAX_LEN, STEPS, REMOVE_AT = 96, 8, 64, 4, 2


def checks_for(module, plugin: str) -> list[Check]:
    return checks_of(
        module,
        plugin,
        HOOK,
        lambda spec: f"logits processor {spec.name} [{spec.runner}]",
        check_processor,
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
        from atom_plugin.vllm.conformance import logits as host

        if spec.runner not in host.runners():
            yield finding(
                "resolves",
                True,
                f"not checked: this vLLM has no {spec.runner} model runner (vLLM 0.34 removed V1)",
            )
            return
        cls = load(spec.class_path)
        base = host.interface(spec.runner)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            yield finding("resolves", False, f"{spec.class_path} does not subclass {base}")
            return
    except Exception as exc:
        yield finding("resolves", False, f"{spec.class_path}: {exc!r}")
        return
    yield finding("resolves", True, spec.class_path)
    try:
        cls.validate_params(host.plain_params())
        yield finding("accepts plain requests", True)
    except Exception as exc:
        yield finding("accepts plain requests", False, f"validate_params raised {exc!r}")
    case = f"{STEPS} steps, 4 plain requests, one removed after step {REMOVE_AT}"
    try:
        changed = _changed_rows(host, spec.runner, cls)
    except Exception as exc:
        yield finding("unconstrained rows stay bit-identical", False, f"raised {exc!r}", case)
        return
    detail = "; ".join(f"step {s} rows {rows}" for s, rows in changed)
    yield finding("unconstrained rows stay bit-identical", not changed, detail, case)


def _changed_rows(host, runner: str, cls) -> list[tuple[int, list[int]]]:
    """(step, rows) for each step where `apply` changed some row of plain requests."""
    prompts = [[5 + i, 9, 11 + i] for i in range(4)]
    batch = dict(steps=STEPS, remove_at=REMOVE_AT, logits_for=_logits, max_reqs=MAX_REQS)
    steps = host.steps(runner, cls, prompts, **batch, max_len=MAX_LEN, vocab=VOCAB)
    return [(step, rows) for step, before, after in steps if (rows := _differs(before, after))]
