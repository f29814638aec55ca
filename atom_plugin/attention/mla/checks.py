"""The shape checks every MLA decode path makes (host-side only, no device reads), and the
query's two parts."""

from __future__ import annotations

import torch

# The absorbed query: one [T, H, lora + rope] tensor, or its latent and rope parts apart
# ([T, H, lora], [T, H, rope], each with strides of its own), as vLLM's MLA layer hands
# them to a backend's decode.
MLAQuery = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def query_parts(q: MLAQuery, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query's latent and rope parts (views of a whole query: no copy)."""
    if isinstance(q, tuple):
        if len(q) != 2:
            raise ValueError(f"a split query is (latent, rope), got {len(q)} parts")
        return q
    return q[..., :kv_lora_rank], q[..., kv_lora_rank:]


def whole_query(q: MLAQuery) -> torch.Tensor:
    """The query as one [T, H, lora + rope] tensor (a copy where it came in parts)."""
    return torch.cat(q, dim=-1) if isinstance(q, tuple) else q


def dequantized_query(q: MLAQuery, scale: torch.Tensor, dtype: torch.dtype) -> MLAQuery:
    """An fp8 query stored as x / scale (vLLM's fused MLA query kernels' convention, scale
    the layer's q_scale) back in `dtype`, in the form it came in."""
    if isinstance(q, tuple):
        return tuple(part.to(torch.float32).mul(scale).to(dtype) for part in q)
    return q.to(torch.float32).mul(scale).to(dtype)


def check_mla_shapes(q: MLAQuery, kv_cache: torch.Tensor, output: torch.Tensor, kv_lora_rank: int):
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
    if isinstance(q, tuple):
        latent, rope = query_parts(q, kv_lora_rank)
        if (
            latent.dim() != 3
            or rope.dim() != 3
            or latent.shape[:2] != rope.shape[:2]
            or latent.shape[-1] != kv_lora_rank
            or rope.shape[-1] != width - kv_lora_rank
        ):
            raise ValueError(
                f"a split q must be ([T, H, {kv_lora_rank}], [T, H, {width - kv_lora_rank}]), "
                f"got {(tuple(latent.shape), tuple(rope.shape))}"
            )
        if latent.dtype != rope.dtype:
            raise ValueError(f"q's parts differ in dtype: {latent.dtype} and {rope.dtype}")
        tokens, heads = latent.shape[:2]
    else:
        if q.dim() != 3 or q.shape[-1] != width:
            raise ValueError(f"q must be [T, H, {width}], got {tuple(q.shape)}")
        tokens, heads = q.shape[:2]
    if tuple(output.shape) != (tokens, heads, kv_lora_rank):
        raise ValueError(
            f"output must be [{tokens}, {heads}, {kv_lora_rank}], got {tuple(output.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("the MLA cache's last dimension must be contiguous (stride 1)")
