"""MLA attention ops; each call picks AITER, Triton or the torch reference through
`select_kernel_impl` (the one place that chooses)."""

from __future__ import annotations

import torch

from atom_plugin.attention.mla.reference import mla_decode_reference, write_mla_kv_reference
from atom_plugin.attention.select import select_kernel_impl


def write_mla_kv(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    """Write kv_c [T, kv_lora_rank] and k_pe [T, rope] into the latent cache
    [num_blocks, block_size, kv_lora_rank + rope] at slot_mapping (negative: skip).
    An fp8 cache stores x / scale."""
    if k_pe.dim() == 3:  # vLLM hands k_pe as [T, 1, rope]
        k_pe = k_pe.squeeze(1)
    impl = select_kernel_impl(kv_cache.device)
    if impl == "aiter":
        from atom_plugin.attention.mla.aiter import write_mla_kv_aiter

        write_mla_kv_aiter(kv_c, k_pe, kv_cache, slot_mapping, scale)
    elif impl == "triton":
        from atom_plugin.attention.mla.triton import write_mla_kv_triton

        write_mla_kv_triton(kv_c, k_pe, kv_cache, slot_mapping, scale)
    else:
        write_mla_kv_reference(kv_c, k_pe, kv_cache, slot_mapping, scale)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta,
    *,
    scale: float,
    output: torch.Tensor,
    kv_lora_rank: int = 512,
    kv_scale: torch.Tensor | None = None,
    token_kv_lens: torch.Tensor | None = None,
    aiter_plan=None,
    plan=None,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache; writes output [T, H, kv_lora_rank]
    in place and returns lse [T, H] float32.

    q [T, H, kv_lora_rank + rope]; a request's several query tokens (speculative
    verification) are causal. `token_kv_lens` [T] overrides how many cached rows each
    token sees (decode context parallelism). `aiter_plan` is the builder's
    `AiterMLAPlan`; without one the AITER path builds it here. `plan` is
    `mla_plan.plan_mla_decode`'s, built once per step by the builder so layers skip it;
    it already includes `token_kv_lens`.
    """
    impl = select_kernel_impl(q.device)
    kwargs = dict(scale=scale, output=output, kv_lora_rank=kv_lora_rank, kv_scale=kv_scale)
    if impl == "aiter":
        from atom_plugin.attention.mla.aiter import build_aiter_mla_plan, mla_decode_aiter

        if token_kv_lens is not None:
            raise NotImplementedError(
                "the AITER MLA path takes no per-token key counts (decode context parallelism "
                "with multi-token queries); use ATOM_PLUGIN_KERNELS=triton"
            )
        if aiter_plan is None:
            aiter_plan = build_aiter_mla_plan(
                meta,
                num_heads=q.shape[1],
                q_dtype=q.dtype,
                kv_dtype=kv_cache.dtype,
                page_size=kv_cache.shape[1],
            )
        return mla_decode_aiter(q, kv_cache, aiter_plan, **kwargs)
    if impl == "triton":
        from atom_plugin.attention.mla.triton import mla_decode_triton

        if plan is None:
            kwargs["token_kv_lens"] = token_kv_lens
        return mla_decode_triton(q, kv_cache, meta, plan=plan, **kwargs)
    return mla_decode_reference(q, kv_cache, meta, token_kv_lens=token_kv_lens, plan=plan, **kwargs)
