"""The per-layer arguments every MHA path takes, in one value."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """A layer's attention arguments (what stays fixed from step to step).

    `sliding_window` counts the keys a query sees, itself included; `sinks` is
    one logit per query head; `k_scale`/`v_scale` (float32, one element) are
    read only for fp8 caches. eq=False: the tensors compare by identity.
    """

    scale: float
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
