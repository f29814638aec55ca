"""Argument checks of the paged MHA ops (host-side only, no device reads)."""

from __future__ import annotations

import torch

from atom_plugin.attention.dtypes import (
    ACTIVATION_DTYPES,
    CACHE_DTYPES,
    SINK_DTYPES,
    dtype_names,
    is_fp8,
)
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.params import AttentionParams


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Caches are [num_blocks, block_size, num_kv_heads, head_size] views, last stride 1."""
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4:
            raise ValueError(
                f"{name} must be 4-d [num_blocks, block_size, num_kv_heads, head_size], "
                f"got shape {tuple(c.shape)}"
            )
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last-dim stride, got {c.stride()}")
        if c.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} dtype {c.dtype} is not one of {dtype_names(CACHE_DTYPES)}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} must match"
        )


def check_scales(cache_dtype: torch.dtype, k_scale, v_scale) -> None:
    """fp8 caches need both per-tensor scales; other caches ignore them (vLLM always passes 1.0)."""
    if not is_fp8(cache_dtype):
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"an fp8 KV cache ({cache_dtype}) needs {name}")
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32:
            raise ValueError(
                f"{name} must be a float32 tensor of one element, got "
                f"{type(s).__name__} {getattr(s, 'dtype', '')} {tuple(getattr(s, 'shape', ()))}"
            )


def check_write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_caches(key_cache, value_cache)
    _, _, hkv, d = key_cache.shape
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or x.shape[1:] != (hkv, d):
            raise ValueError(
                f"{name} must be [T, {hkv}, {d}] to match the cache, got {tuple(x.shape)}"
            )
        if x.dtype not in ACTIVATION_DTYPES:
            raise ValueError(
                f"{name} dtype {x.dtype} is not one of {dtype_names(ACTIVATION_DTYPES)}"
            )
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last-dim stride, got {x.stride()}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be a 1-d int64 tensor, got {slot_mapping.dim()}-d "
            f"{slot_mapping.dtype}"
        )
    n = slot_mapping.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(
            f"slot_mapping has {n} slots but key/value hold {key.shape[0]}/{value.shape[0]} tokens"
        )


def check_attention(
    query, key_cache, value_cache, meta: PagedAttentionMetadata, output, params: AttentionParams
) -> None:
    check_caches(key_cache, value_cache)
    _, _, hkv, d = key_cache.shape
    if query.dim() != 3 or query.shape[2] != d:
        raise ValueError(f"query must be [T, Hq, {d}], got {tuple(query.shape)}")
    if query.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"query dtype {query.dtype} is not one of {dtype_names(ACTIVATION_DTYPES)}"
        )
    hq = query.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    if output.shape != query.shape:
        raise ValueError(
            f"output shape {tuple(output.shape)} must equal query shape {tuple(query.shape)}"
        )
    if output.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"output dtype {output.dtype} is not one of {dtype_names(ACTIVATION_DTYPES)}"
        )
    if output.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("query and output must have a unit last-dim stride")
    if query.shape[0] < meta.num_actual_tokens:
        raise ValueError(
            f"query holds {query.shape[0]} tokens but num_actual_tokens={meta.num_actual_tokens}"
        )
    sliding_window, sinks = params.sliding_window, params.sinks
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"sliding_window must be None or a positive int (keys visible, itself included), "
            f"got {sliding_window!r}"
        )
    if sinks is not None:
        if sinks.dim() != 1 or sinks.shape[0] != hq:
            raise ValueError(
                f"sinks must be a tensor [{hq}] (one per query head), got {tuple(sinks.shape)}"
            )
        if sinks.dtype not in SINK_DTYPES:
            raise ValueError(f"sinks dtype {sinks.dtype} is not one of {dtype_names(SINK_DTYPES)}")
