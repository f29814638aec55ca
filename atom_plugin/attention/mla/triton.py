"""The Triton MLA path's launcher: the latent cache write, and the split-KV decode, which
runs the stage-1 kernel its plan names (`mla.launch_plan.TritonMLALaunch`: the packed or
per-token Triton kernel of `mla.triton_kernels`, or the Gluon kernel of `gluon.lockstep`) and
then merges the splits by their log-sum-exps (no merge at one split: stage 1 writes the
output itself).
"""

from __future__ import annotations

import torch

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.kept import cache_key
from atom_plugin.attention.mla.cache_view import (
    KEPT_PER_CACHE,
    tma_descriptors,
    tma_problems,
    use_tma,
)
from atom_plugin.attention.mla.checks import MLAQuery, check_mla_shapes, query_parts
from atom_plugin.attention.mla.gluon import shapes as gluon_shapes
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout, gluon_mla_problems
from atom_plugin.attention.mla.plan import TritonMLAPlan
from atom_plugin.attention.mla.triton_kernels import (
    _mla_decode_per_token,
    _mla_decode_stage1,
    _mla_decode_stage2,
    _mla_fill_keyless,
    _mla_write_kernel,
)
from atom_plugin.attention.triton_common import next_power_of_2

KEYLESS_FILL_HEADS = 16  # heads a `_mla_fill_keyless` store covers (16 x 512 columns)


def write_mla_kv_triton(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    """The cache write on the Triton kernel; `mla.ops.write_mla_kv` states its semantics."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    lora, rope = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != lora + rope or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"cache {tuple(kv_cache.shape)} (last stride {kv_cache.stride(-1)}) does not hold "
            f"kv_c {lora} + k_pe {rope} contiguous columns"
        )
    quant = is_fp8(kv_cache.dtype)
    if quant and scale is None:
        raise ValueError("an fp8 MLA cache needs a scale")
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    _mla_write_kernel[(n,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        scale if quant else kv_c,
        kv_c.stride(0),
        k_pe.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        BLOCK_SIZE=kv_cache.shape[1],
        LORA=lora,
        ROPE=rope,
        BLOCK_DV=next_power_of_2(lora),
        BLOCK_DPE=next_power_of_2(rope),
        QUANT=quant,
    )


def _gluon_input_problems(q: torch.Tensor, kv_cache, lora: int, fp8: bool) -> tuple[str, ...]:
    """Why this layer's query and cache do not fit the Gluon kernel its plan chose: the
    probe's answer for the layout they have, the cache's TMA view, the cache's dtype;
    found at the first launch over the cache and kept (`attention.kept`)."""

    def find() -> tuple[str, ...]:
        rope = kv_cache.shape[2] - lora
        layout = MLAStepLayout(q.dtype, kv_cache.shape[1], lora, rope)
        problems = gluon_mla_problems(q.device, layout)
        problems += tma_problems(kv_cache, lora, rope, gluon_shapes.BLOCK_N)
        if not fp8 and kv_cache.dtype != q.dtype:
            problems.append(f"the cache's dtype {kv_cache.dtype} is not the query's {q.dtype}")
        return tuple(problems)

    key = ("gluon input", cache_key(kv_cache), q.dtype, q.device, lora, fp8)
    return KEPT_PER_CACHE.get(key, find)


def split_partials(T: int, H: int, splits: int, kv_lora_rank: int, device):
    """Stage 1's partial outputs and lses per (token, head, split), left unfilled: a
    split without keys may leave its partial unwritten (its lse is -inf), and the merge
    reads no partial of such a split."""
    mid_o = torch.empty((T, H, splits, kv_lora_rank), dtype=torch.float32, device=device)
    return mid_o, torch.empty((T, H, splits), dtype=torch.float32, device=device)


def _run_triton_stage1(
    q_c, q_pe, kv_cache, meta, T, kv_len, req, mid_o, mid_lse, kv_scale, scale, launch, kv_lora_rank
):
    """Stage 1 on the Triton kernel `launch` names ('packed' or 'per_token') for the
    step's first T query tokens; `q_c` / `q_pe`: the query's latent and rope parts."""
    H = q_c.shape[1]
    fp8 = launch.fp8_cache
    splits = launch.num_splits
    rope = kv_cache.shape[2] - kv_lora_rank
    block_table = meta.block_table
    precision = "ieee" if q_c.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit
    tma = use_tma(launch.tma, kv_cache, kv_lora_rank, rope, launch.block_n)
    descs = (kv_cache, kv_cache)  # unused without tma
    if tma:
        descs = tma_descriptors(kv_cache, kv_lora_rank, launch.block_n)
    # The two stage-1 kernels take the same arguments around their token indexing.
    head = (q_c, q_pe, kv_cache, *descs, block_table)
    tail = (mid_o, mid_lse, kv_scale if fp8 else q_c, float(scale), H, splits)
    strides = (
        q_c.stride(0),
        q_c.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
    )
    constants = dict(
        PAGE=kv_cache.shape[1],
        LORA=kv_lora_rank,
        ROPE=rope,
        BLOCK_DV=next_power_of_2(kv_lora_rank),
        BLOCK_DPE=max(16, next_power_of_2(rope)),
        BLOCK_H=launch.block_h,
        BLOCK_N=launch.block_n,
        IS_FP8=fp8,
        PRECISION=precision,
        TMA=tma,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if launch.kernel == "per_token":
        _mla_decode_per_token[(launch.head_groups, splits, T)](
            *head, req, kv_len, *tail, *strides, **constants
        )
    else:
        _mla_decode_stage1[(launch.head_groups, splits, meta.num_reqs * launch.token_chunks)](
            *head,
            meta.query_start_loc,
            kv_len,
            *tail,
            launch.token_chunks,
            *strides,
            TOKENS=launch.tokens,
            FP16_MATH=launch.fp16_math,
            **constants,
        )


def mla_decode_triton(
    q: MLAQuery,
    kv_cache,
    meta,
    plan: TritonMLAPlan,
    *,
    scale,
    output,
    kv_lora_rank=512,
    kv_scale=None,
) -> torch.Tensor:
    """Split-KV MLA decode; see `mla.reference.mla_decode_reference` for the semantics
    (every row of `output` is written: nothing need be filled beforehand). `q` may come
    whole or as its latent and rope parts (`mla.checks.MLAQuery`): the kernels read each
    part through its own strides.
    `plan` is `plan_mla_decode`'s, made once per step (by the metadata builder) and
    shared by every layer: the token plan and the launch."""
    check_mla_shapes(q, kv_cache, output, kv_lora_rank)
    q_c, q_pe = (p if p.stride(-1) == 1 else p.contiguous() for p in query_parts(q, kv_lora_rank))
    T, H, _ = q_c.shape
    lse = torch.empty((T, H), dtype=torch.float32, device=q_c.device)
    if T == 0:
        return lse
    fp8 = is_fp8(kv_cache.dtype)
    if fp8 and kv_scale is None:
        raise ValueError("an fp8 MLA cache needs kv_scale")
    launch = plan.launch
    if launch.fp8_cache != fp8:
        raise ValueError(
            f"the plan was made for an {'fp8' if launch.fp8_cache else '16/32-bit'} cache, "
            f"the cache is {kv_cache.dtype}"
        )
    req, kv_len = plan.token_req, plan.token_kv_len
    if req.shape[0] < T:  # tokens past the plan see no key
        output[req.shape[0] :].zero_()
        lse[req.shape[0] :] = float("-inf")
        T = req.shape[0]
    splits = launch.num_splits
    if splits == 1:  # stage 1 writes the result itself: no partials, no merge
        # Stage 1 writes no row of a token that sees no key; the merge, where it runs,
        # writes every row. Here those tokens' rows alone are written first (a kernel that
        # reads each token's key count), not the whole output.
        _mla_fill_keyless[(T,)](
            kv_len,
            output,
            lse,
            H,
            output.stride(0),
            output.stride(1),
            lse.stride(0),
            LORA=kv_lora_rank,
            BLOCK_H=KEYLESS_FILL_HEADS,
            BLOCK_DV=next_power_of_2(kv_lora_rank),
        )
        mid_o, mid_lse = output.unsqueeze(2), lse.unsqueeze(2)
    else:
        mid_o, mid_lse = split_partials(T, H, splits, kv_lora_rank, q_c.device)
    if launch.kernel == "gluon":
        problems = _gluon_input_problems(q_c, kv_cache, kv_lora_rank, fp8)
        if problems:
            raise ValueError("the plan chose the gluon kernel, but: " + "; ".join(problems))
        from atom_plugin.attention.mla.gluon import launch as gluon_launch  # imports Gluon

        gluon_launch.run_stage1(
            q_c,
            q_pe,
            kv_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.num_reqs,
            kv_len,
            mid_o,
            mid_lse,
            kv_scale,
            scale,
            launch,
            kv_lora_rank,
        )
    else:
        _run_triton_stage1(
            q_c, q_pe, kv_cache, meta, T, kv_len, req, mid_o, mid_lse, kv_scale, scale, launch,
            kv_lora_rank,
        )  # fmt: skip
    if splits == 1:
        return lse
    dv = next_power_of_2(kv_lora_rank)
    block_s = launch.merge_block_s  # the plan's split tile (`launch_plan.merge_block_s`)
    block_dv = min(dv, launch.merge_block_dv)
    _mla_decode_stage2[(H, T, dv // block_dv)](
        mid_o,
        mid_lse,
        req,
        output,
        lse,
        splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        output.stride(0),
        output.stride(1),
        lse.stride(0),
        LORA=kv_lora_rank,
        BLOCK_DV=block_dv,
        BLOCK_S=block_s,  # splits per tile: one compile per power of two up to 64
        ONE_CHUNK=splits <= block_s,  # all splits in one pass
    )
    return lse
