"""Torch reference of the paged MHA ops: the definition every kernel is tested against.

Plain per-request loops in float32; it reads the metadata back to the host, so
it is for CPU runs and tests, never for CUDA graphs.
"""

from __future__ import annotations

import torch

from atom_plugin.attention.dtypes import fp8_max, is_fp8
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.params import AttentionParams


def _scale_on(scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | float:
    """The scale as a 0-d float32 tensor on x's device.

    A tensor, not a Python float: CUDA divides by a host scalar as a multiply by
    its reciprocal, which rounds differently from x / scale.
    """
    if scale is None:
        return 1.0
    return scale.reshape(()).to(device=x.device, dtype=torch.float32)


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    """What the cache stores for `x`: x / scale saturated to the fp8 range, or a plain cast."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = fp8_max(cache_dtype)
    return (x.float() / _scale_on(scale, x)).clamp(-limit, limit).to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, scale) -> torch.Tensor:
    """float32 value of cache entries (stored * scale for fp8)."""
    if not is_fp8(x.dtype):
        return x.float()
    return x.float() * _scale_on(scale, x)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    n = slot_mapping.shape[0]
    block_size = key_cache.shape[1]
    slots = slot_mapping.tolist()
    for t in range(n):
        s = slots[t]
        if s < 0:
            continue
        b, off = divmod(s, block_size)
        key_cache[b, off] = quantize_for_cache(key[t], key_cache.dtype, k_scale)
        value_cache[b, off] = quantize_for_cache(value[t], value_cache.dtype, v_scale)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one request as [seq_len, Hkv, D] (still cache dtype)."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_row.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def paged_attention(
    query,
    key_cache,
    value_cache,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output,
    plan=None,
):
    """The definition: per request, softmax over its visible keys (and sink) in float32.
    `plan` is unused (nothing to plan); it keeps the paths' signature."""
    scale, sliding_window, sinks = params.scale, params.sliding_window, params.sinks
    k_scale, v_scale = params.k_scale, params.v_scale
    hq = query.shape[1]
    hkv = key_cache.shape[2]
    group = hq // hkv
    qsl = meta.query_start_loc[: meta.num_reqs + 1].tolist()
    seq_lens = meta.seq_lens[: meta.num_reqs].tolist()
    for i in range(meta.num_reqs):
        t0, t1 = qsl[i], qsl[i + 1]
        q_len, s = t1 - t0, seq_lens[i]
        if q_len == 0:
            continue
        if s == 0:
            output[t0:t1] = 0
            continue
        if q_len > s:
            raise ValueError(f"request {i} has {q_len} new tokens but seq_len {s}")
        k = dequantize_from_cache(gather_kv(key_cache, meta.block_table[i], s), k_scale)
        v = dequantize_from_cache(gather_kv(value_cache, meta.block_table[i], s), v_scale)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[t0:t1].float().transpose(0, 1)  # [Hq, q_len, D]
        logits = (q @ k.transpose(1, 2)) * scale  # [Hq, q_len, s]
        qpos = torch.arange(s - q_len, s, device=q.device)[:, None]
        kpos = torch.arange(s, device=q.device)[None, :]
        visible = kpos <= qpos
        if sliding_window is not None:
            visible &= kpos > qpos - sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.float().to(q.device).view(hq, 1, 1).expand(hq, q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :s]
        else:
            probs = torch.softmax(logits, dim=-1)
        output[t0:t1] = (probs @ v).transpose(0, 1).to(output.dtype)
    return output
