"""The paged MHA ops the vLLM backend calls; each call picks AITER, Triton or torch.

The choice is `select_kernel_impl(device)` (one place). All paths share the
semantics of `reference.py`: decodes first, queries are the last tokens of
their context, causal, optional sliding window and sinks, GQA by head groups,
fp8 caches with per-tensor scales, inert rows (seq_len 0) give zeros.
"""

from __future__ import annotations

import importlib

import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.checks import check_attention, check_scales, check_write_kv
from atom_plugin.attention.select import select_kernel_impl

_IMPL_MODULES = {
    "torch": "atom_plugin.attention.mha.reference",
    "triton": "atom_plugin.attention.mha.triton",
    "aiter": "atom_plugin.attention.mha.aiter",
}


def _impl(device: torch.device):
    return importlib.import_module(_IMPL_MODULES[select_kernel_impl(device)])


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at `slot_mapping` (block * block_size + offset).

    Only the first `slot_mapping.shape[0]` tokens are read; negative slots are
    skipped. fp8 caches store x / scale, saturated to the format's range.
    """
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    check_scales(key_cache.dtype, k_scale, v_scale)
    if slot_mapping.shape[0] == 0:
        return
    _impl(key.device).write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    *,
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query/output [T, Hq, D] over the paged caches; writes `output` in place."""
    check_attention(query, key_cache, value_cache, meta, output, sliding_window, sinks)
    check_scales(key_cache.dtype, k_scale, v_scale)
    if meta.num_reqs == 0 or meta.num_actual_tokens == 0:
        return output
    return _impl(query.device).paged_attention(
        query,
        key_cache,
        value_cache,
        meta,
        scale=scale,
        output=output,
        sliding_window=sliding_window,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
