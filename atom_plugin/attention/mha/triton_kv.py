"""Triton KV-cache write: one program per token stores all its kv heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_plugin.attention.dtypes import fp8_max, is_fp8
from atom_plugin.attention.triton_common import (
    e4m3_min_exponent,
    next_power_of_2,
    round_to_e4m3,
)


@triton.jit
def _write_kv_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    num_heads,
    head_size,
    fp8_limit,
    IS_FP8: tl.constexpr,
    MIN_EXP: tl.constexpr,
    NEG_ZERO: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_size)
    k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask)
    if IS_FP8:  # IEEE division (plain `/` is approximate on GPUs), as torch divides
        k = round_to_e4m3(
            tl.math.div_rn(k.to(tl.float32), tl.load(k_scale)), fp8_limit, MIN_EXP, NEG_ZERO
        )
        v = round_to_e4m3(
            tl.math.div_rn(v.to(tl.float32), tl.load(v_scale)), fp8_limit, MIN_EXP, NEG_ZERO
        )
    kc = key_cache + blk.to(tl.int64) * stride_kcb + off * stride_kcs + h * stride_kch + d
    vc = value_cache + blk.to(tl.int64) * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, k.to(key_cache.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache.dtype.element_ty), mask=mask)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    n = slot_mapping.shape[0]
    _, block_size, hkv, d = key_cache.shape
    fp8 = is_fp8(key_cache.dtype)
    if not fp8:  # unused by the kernel, but it needs pointers
        k_scale = v_scale = slot_mapping
    _write_kv_kernel[(n,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_size,
        hkv,
        d,
        fp8_max(key_cache.dtype) if fp8 else 0.0,
        IS_FP8=fp8,
        MIN_EXP=e4m3_min_exponent(key_cache.dtype) if fp8 else 0,
        NEG_ZERO=key_cache.dtype == torch.float8_e4m3fn,
        BLOCK_H=next_power_of_2(hkv),
        BLOCK_D=next_power_of_2(d),
    )
