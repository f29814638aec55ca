"""Can the Gluon MLA decode (`gluon.lockstep`) run here, and why not: the one answer that
`atom-plugin info`, the vLLM backend's block-size preference, the decode plan and the
decode's check of a layer's tensors ask for. Host-only: nothing here imports Triton until
a Hopper GPU is asked about, and Gluon only then (the kernels' launch module, to learn
whether this Triton's Gluon builds them).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from atom_plugin.attention.mla.gluon.shapes import BLOCK_N

GLUON_Q_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MLAStepLayout:
    """What the kernel choice needs beyond the step's sizes: the query's dtype and the
    cache's block size, latent and rope widths (the metadata builder knows them)."""

    q_dtype: torch.dtype
    block_size: int
    kv_lora_rank: int = 512
    rope: int = 64


def gluon_mla_problems(
    device: torch.device | None = None, layout: MLAStepLayout | None = None
) -> list[str]:
    """Why the Gluon kernel cannot run on `device` (None: this process's CUDA GPU) steps of
    `layout` (None: the device alone); empty when it can. Cached: the plan asks once per
    step and the decode once per layer."""
    if device is None:
        if not torch.cuda.is_available():
            return ["no CUDA GPU"]
        device = torch.device("cuda", torch.cuda.current_device())
    return list(_problems(device, layout))


@functools.lru_cache(maxsize=64)
def _problems(device: torch.device, layout: MLAStepLayout | None) -> tuple[str, ...]:
    if device.type != "cuda":
        return (f"device {device} (the Gluon kernel runs on CUDA GPUs)",)
    index = device.index if device.index is not None else torch.cuda.current_device()
    problems = []
    why = _device_problem(index)
    if why:
        problems.append(why)
    if layout is not None:
        problems += _layout_problems(layout)
    return tuple(problems)


@functools.cache
def _device_problem(device_index: int) -> str | None:
    """Why the Gluon kernel cannot run on this GPU; None when it can."""
    if torch.version.hip is not None:  # ROCm reports gfx9 parts as compute capability 9.x
        return "a ROCm GPU (the warpgroup-MMA kernel is for NVIDIA Hopper)"
    major, _ = torch.cuda.get_device_capability(device_index)
    if major != 9:
        return f"compute capability {major}.x (the warpgroup-MMA kernel is for Hopper, 9.x)"
    try:
        importlib.import_module("atom_plugin.attention.mla.gluon.launch")
    except Exception as exc:  # an older Triton without Gluon's Hopper API
        return f"Triton's Gluon Hopper API is not importable ({type(exc).__name__}: {exc})"
    return None


def _layout_problems(layout: MLAStepLayout) -> list[str]:
    """Why the kernel cannot take a step of this query dtype and cache layout."""
    problems = []
    q_dtype, block_size = layout.q_dtype, layout.block_size
    if q_dtype not in GLUON_Q_DTYPES:
        problems.append(f"query dtype {q_dtype} (the kernel takes {GLUON_Q_DTYPES})")
    if block_size is None or block_size % BLOCK_N:
        problems.append(f"block size {block_size} (64-key TMA tiles need a multiple of {BLOCK_N})")
    if layout.kv_lora_rank not in (128, 256, 512):
        problems.append(f"kv_lora_rank {layout.kv_lora_rank} (the kernel takes 128, 256 or 512)")
    if layout.rope not in (16, 32, 64):
        problems.append(f"rope width {layout.rope} (the kernel takes 16, 32 or 64)")
    return problems
