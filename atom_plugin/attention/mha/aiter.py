"""The AITER path of the MHA ops (ROCm with `import aiter` working).

Never run here: no ROCm device was available; the calls are written against
AITER's public Python signatures (aiter/ops/cache.py, attention.py, mha.py) and
vLLM 0.32's own ROCm AITER backend, and checked only through a fake `aiter`
module (tests/fake_aiter) that asserts the documented shapes and layouts.

Layouts. vLLM hands an MHA layer the caches as NHD views [blocks, block_size,
Hkv, D] of one [blocks, Hkv, block_size, 2D] tensor. The calls that accept that
layout serve `write_kv`/`paged_attention`:
  - `reshape_and_cache_flash` writes NHD caches;
  - `paged_attention_v1(..., kv_cache_layout="NHD", sliding_window=w)` decodes;
  - `flash_attn_varlen_func` runs prefill/extend over each request's context,
    gathered contiguously first (causal is bottom-right aligned, the window is
    (w - 1, 0), sinks go in `sink_ptr`).
No AITER paged decode takes sinks, so decodes with sinks run the project's
Triton decode (Triton runs on ROCm).
ATOM's own decode, `pa_fwd_asm`, reads a different layout that no view of
vLLM's tensor can give: K [blocks, Hkv, D/x, block_size, x] and V [blocks, Hkv,
block_size/x, D, x], x = 16 bytes / element size, written by
`reshape_and_cache(..., asm_layout=True)`. `write_kv_asm_layout` and
`paged_decode_asm_layout` make those calls for caches allocated that way.
"""

from __future__ import annotations

import functools
import importlib

import torch

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mha.plan import AiterPlan

PARTITION_SIZE = 256  # paged_attention_v1's context partition (vLLM uses 256 on ROCm)
ASM_HEAD_SIZE = 128


def _aiter():
    return importlib.import_module("aiter")


def kv_cache_dtype_name(cache_dtype: torch.dtype) -> str:
    """AITER's `kv_cache_dtype` string: "fp8" for fp8 caches, else "auto"."""
    return "fp8" if is_fp8(cache_dtype) else "auto"


def _scales(cache_dtype, k_scale, v_scale, device):
    if is_fp8(cache_dtype):
        return k_scale, v_scale
    one = unit_scale(device)
    return one, one


@functools.cache
def unit_scale(device: torch.device) -> torch.Tensor:
    """The scale AITER's calls (MHA and MLA) take for caches that are not fp8, made once
    per device rather than on every layer's call."""
    return torch.ones(1, dtype=torch.float32, device=device)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    ks, vs = _scales(key_cache.dtype, k_scale, v_scale, key.device)
    _aiter().reshape_and_cache_flash(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype_name(key_cache.dtype),
        ks,
        vs,
    )


def paged_attention(
    query,
    key_cache,
    value_cache,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output,
    plan: AiterPlan,
):
    if meta.num_decodes:
        if params.sinks is not None:
            from atom_plugin.attention.mha.triton_decode import paged_decode

            paged_decode(
                query, key_cache, value_cache, meta, params, output,
                num_splits=plan.sink_decode_splits,
            )  # fmt: skip
        else:
            _decode(query, key_cache, value_cache, meta, params, output, plan.decode_partitions)
    if meta.num_prefills:
        _prefill(query, key_cache, value_cache, meta, params, output, plan)
    return output


def _decode(query, key_cache, value_cache, meta, params: AttentionParams, output, partitions):
    n = meta.num_decodes
    if meta.num_decode_tokens != n:
        raise ValueError(
            f"AITER decode needs one token per decode row, got num_decodes={n}, "
            f"num_decode_tokens={meta.num_decode_tokens}"
        )
    hq, d = query.shape[1], query.shape[2]
    elem = query.element_size()
    workspace = torch.empty(
        n * hq * partitions * d * elem + 2 * n * hq * partitions * 4,
        dtype=torch.uint8,
        device=query.device,
    )
    ks, vs = _scales(key_cache.dtype, params.k_scale, params.v_scale, query.device)
    out = output[:n]
    _aiter().paged_attention_v1(
        out,
        workspace,
        query[:n],
        key_cache,
        value_cache,
        params.scale,
        meta.block_table[:n],
        meta.query_start_loc[: n + 1],
        meta.seq_lens[:n],
        meta.max_seq_len,
        None,  # alibi_slopes
        kv_cache_dtype_name(key_cache.dtype),
        "NHD",
        0.0,  # logits_soft_cap
        ks,
        vs,
        None,  # fp8_out_scale
        PARTITION_SIZE,
        1,  # mtp
        params.sliding_window or 0,
    )
    # inert (padding) rows must read as zeros whatever the kernel leaves there
    out.masked_fill_((meta.seq_lens[:n] == 0).view(n, 1, 1), 0.0)


def context_slots(block_table, seq_lens, total: int, block_size: int):
    """(block, offset) of every context token of the rows, packed row after row [total]."""
    device = block_table.device
    lens = seq_lens.long()
    rows = torch.repeat_interleave(
        torch.arange(lens.shape[0], device=device), lens, output_size=total
    )
    pos = torch.arange(total, device=device) - (torch.cumsum(lens, 0) - lens)[rows]
    return block_table[rows, pos // block_size].long(), pos % block_size


def gather_context(cache, slots, dtype, scale=None):
    """The cache entries at `context_slots` as [total, Hkv, D] in `dtype` (fp8 dequantized)."""
    out = cache[slots]
    if is_fp8(cache.dtype):
        return (out.float() * scale).to(dtype)
    return out.to(dtype)


def _prefill(query, key_cache, value_cache, meta, params: AttentionParams, output, plan):
    first, last = meta.num_decodes, meta.num_reqs
    t0, t1 = meta.num_decode_tokens, meta.num_actual_tokens
    context = plan.prefill
    if context is None or context.block_size != key_cache.shape[1]:
        raise ValueError(
            f"the AITER plan's prefill contexts ({context and context.block_size}-token "
            f"blocks) do not fit this batch's {key_cache.shape[1]}-token cache blocks"
        )
    # one index computation (the plan's) serves K and V of every layer
    k = gather_context(key_cache, context.slots, query.dtype, params.k_scale)
    v = gather_context(value_cache, context.slots, query.dtype, params.v_scale)
    cu_q = meta.query_start_loc[first : last + 1] - meta.query_start_loc[first]
    window, sinks = params.sliding_window, params.sinks
    _aiter().flash_attn_varlen_func(
        q=query[t0:t1],
        k=k,
        v=v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=context.cu_seqlens_k,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        min_seqlen_q=1,
        dropout_p=0.0,
        softmax_scale=params.scale,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
        alibi_slopes=None,
        return_lse=False,
        out=output[t0:t1],
        sink_ptr=None if sinks is None else sinks.float(),  # AITER reads float32 (no copy if so)
    )


# --- ATOM's layout: pa_fwd_asm over caches written by reshape_and_cache(asm_layout=True) ---


def asm_layout_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype):
    """(K shape, V shape) of AITER's asm paged-attention layout for these sizes."""
    x = 16 // torch.empty((), dtype=dtype).element_size()
    if head_size % x or block_size % x:
        raise ValueError(
            f"the asm layout packs {x} elements; head_size={head_size} and "
            f"block_size={block_size} must both be multiples of it"
        )
    return (
        (num_blocks, num_kv_heads, head_size // x, block_size, x),
        (num_blocks, num_kv_heads, block_size // x, head_size, x),
    )


def write_kv_asm_layout(
    key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None
):
    ks, vs = _scales(key_cache.dtype, k_scale, v_scale, key.device)
    _aiter().reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype_name(key_cache.dtype),
        ks,
        vs,
        True,  # asm_layout: V as [blocks, Hkv, block_size/x, D, x]
    )


def paged_decode_asm_layout(
    query, key_cache, value_cache, meta: PagedAttentionMetadata, params: AttentionParams, output
):
    """ATOM's decode call. pa_fwd_asm takes no softmax scale, window or sinks: refuse those."""
    scale = params.scale
    if params.sliding_window is not None or params.sinks is not None:
        raise ValueError("pa_fwd_asm takes no sliding window and no sinks")
    d = query.shape[2]
    if d != ASM_HEAD_SIZE:
        raise ValueError(f"pa_fwd_asm supports head_size {ASM_HEAD_SIZE} only, got {d}")
    if abs(scale - d**-0.5) > 1e-6 * d**-0.5:
        raise ValueError(f"pa_fwd_asm applies 1/sqrt(head_size)={d**-0.5}; got scale={scale}")
    if meta.max_query_len > 1 or meta.num_decodes != meta.num_reqs:
        raise ValueError(
            f"pa_fwd_asm runs pure decode batches; got max_query_len={meta.max_query_len}, "
            f"num_decodes={meta.num_decodes}, num_reqs={meta.num_reqs}"
        )
    n = meta.num_decodes
    fp8 = is_fp8(key_cache.dtype)
    table = meta.block_table[:n]
    _aiter().pa_fwd_asm(
        query[:n],
        key_cache,
        value_cache,
        table,
        meta.seq_lens[:n],
        table.stride(0),
        1,  # max_qlen
        params.k_scale if fp8 else None,
        params.v_scale if fp8 else None,
        output[:n],
    )
    output[:n].masked_fill_((meta.seq_lens[:n] == 0).view(n, 1, 1), 0.0)
    return output
