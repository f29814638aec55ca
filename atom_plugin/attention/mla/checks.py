"""The shape checks every MLA decode path makes (host-side only, no device reads)."""

from __future__ import annotations

import torch


def check_mla_shapes(
    q: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, kv_lora_rank: int
):
    if kv_cache.dim() != 3:
        raise ValueError(
            "MLA cache must be [num_blocks, block_size, kv_lora_rank + rope], "
            f"got {tuple(kv_cache.shape)}"
        )
    width = kv_cache.shape[-1]
    if not 0 < kv_lora_rank < width:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} must lie in (0, {width}) for a {width}-wide cache"
        )
    if q.dim() != 3 or q.shape[-1] != width:
        raise ValueError(f"q must be [T, H, {width}], got {tuple(q.shape)}")
    if tuple(output.shape) != (q.shape[0], q.shape[1], kv_lora_rank):
        raise ValueError(
            f"output must be [{q.shape[0]}, {q.shape[1]}, {kv_lora_rank}], "
            f"got {tuple(output.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("the MLA cache's last dimension must be contiguous (stride 1)")
