"""MLA attention ops. The decode runs the kernel path its plan belongs to (a
`plan.MLAPlan`, made once per step by `plan_mla_decode`, where the path is chosen); the
cache write runs the path its caller names (the vLLM impl resolves it once)."""

from __future__ import annotations

import torch

from atom_plugin.attention.mla.aiter import AiterMLAPlan, mla_decode_aiter, write_mla_kv_aiter
from atom_plugin.attention.mla.checks import MLAQuery, query_parts
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout
from atom_plugin.attention.mla.plan import MLAPlan, TorchMLAPlan, TritonMLAPlan, plan_mla_decode
from atom_plugin.attention.mla.reference import mla_decode_reference, write_mla_kv_reference
from atom_plugin.attention.select import KERNEL_IMPLS, select_kernel_impl


def write_mla_kv(kv_c, k_pe, kv_cache, slot_mapping, scale=None, *, kernel_impl=None) -> None:
    """Write kv_c [T, kv_lora_rank] and k_pe [T, rope] into the latent cache
    [num_blocks, block_size, kv_lora_rank + rope] at slot_mapping (negative: skip).
    An fp8 cache stores x / scale. `kernel_impl` names the path (the vLLM impl resolves
    it once, on its first write); None selects it for the cache's device."""
    if k_pe.dim() == 3:  # vLLM hands k_pe as [T, 1, rope]
        k_pe = k_pe.squeeze(1)
    match kernel_impl or select_kernel_impl(kv_cache.device):
        case "aiter":
            write_mla_kv_aiter(kv_c, k_pe, kv_cache, slot_mapping, scale)
        case "triton":
            from atom_plugin.attention.mla.triton import write_mla_kv_triton

            write_mla_kv_triton(kv_c, k_pe, kv_cache, slot_mapping, scale)
        case "torch":
            write_mla_kv_reference(kv_c, k_pe, kv_cache, slot_mapping, scale)
        case other:
            raise ValueError(f"kernel_impl must be one of {KERNEL_IMPLS}, got {other!r}")


def mla_decode(
    q: MLAQuery,
    kv_cache: torch.Tensor,
    meta,
    plan: MLAPlan | None = None,
    *,
    scale: float,
    output: torch.Tensor,
    kv_lora_rank: int = 512,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache; writes every row of output
    [T, H, kv_lora_rank] in place (zeros for a token that sees no key or belongs to no
    request) and returns lse [T, H] float32.

    q [T, H, kv_lora_rank + rope], or its latent and rope parts apart as vLLM hands them
    (`mla.checks.MLAQuery`: the Triton path reads each through its own strides, the
    others join them); a request's several query tokens (speculative verification) are
    causal. `plan` is the step's (the metadata builder's, shared by
    every layer); without one (direct callers) the step is planned here, as the builder
    would for these tensors.
    """
    if plan is None:
        latent, _ = query_parts(q, kv_lora_rank)
        layout = MLAStepLayout(
            latent.dtype, kv_cache.shape[1], kv_lora_rank, kv_cache.shape[-1] - kv_lora_rank
        )
        plan = plan_mla_decode(
            meta, latent.shape[0], latent.shape[1], kv_dtype=kv_cache.dtype, layout=layout
        )
    kwargs = dict(scale=scale, output=output, kv_lora_rank=kv_lora_rank, kv_scale=kv_scale)
    match plan:
        case AiterMLAPlan():
            return mla_decode_aiter(q, kv_cache, plan, **kwargs)
        case TritonMLAPlan():
            from atom_plugin.attention.mla.triton import mla_decode_triton

            return mla_decode_triton(q, kv_cache, meta, plan, **kwargs)
        case TorchMLAPlan():
            return mla_decode_reference(q, kv_cache, meta, plan, **kwargs)
    raise TypeError(f"not an MLA decode plan: {type(plan).__name__}")
