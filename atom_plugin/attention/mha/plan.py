"""Typed per-step plans of the MHA paths, one per kernel path: what that path decides
once on the host for a batch, read by every layer. `planner.plan_mha` makes them (the
metadata builder, once per step); `ops` dispatches on their type.

A plan holds only what depends on the batch and the device, never on a layer, so one
plan serves every layer of the step. Launch sizes are chosen from `max_seq_len`, which a
CUDA-graph capture sets to max_model_len: the captured sizes then hold for every replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atom_plugin.attention.mha.gluon_prefill_launch import WorkCounters


@dataclass(frozen=True)
class TorchPlan:
    """The torch reference: nothing to decide ahead."""


@dataclass(frozen=True)
class TritonPlan:
    """The Triton kernels: the split-KV decode's split count, and where the batch has
    prefills and the device takes the Gluon Hopper prefill, that kernel's work counters
    (each layer's own facts decide whether it runs; None: the Triton prefill)."""

    num_splits: int
    gluon_counters: WorkCounters | None = None


@dataclass(frozen=True, eq=False)
class AiterPrefill:
    """The prefill rows' contexts: cumulated seq_lens [n + 1] and each context token's
    (block, offset) in caches of `block_size`, packed row after row (what
    `flash_attn_varlen_func` reads gathered)."""

    cu_seqlens_k: torch.Tensor
    slots: tuple[torch.Tensor, torch.Tensor]
    block_size: int


@dataclass(frozen=True)
class AiterPlan:
    """AITER: the decode's context partitions, the split count of the Triton decode that
    serves layers with sinks, and the prefill contexts (None without prefill rows)."""

    decode_partitions: int
    sink_decode_splits: int
    prefill: AiterPrefill | None


MHAPlan = TorchPlan | TritonPlan | AiterPlan
