"""The paged MHA ops the vLLM backend calls; each runs the path its metadata's plan names.

The plan (`plan.py`) is made once per step by the builder; without one (tests,
benchmarks, conformance) the call plans itself through the same function. All
paths share the semantics of `reference.py`: decodes first, queries are the
last tokens of their context, causal, optional sliding window and sinks, GQA
by head groups, fp8 caches with per-tensor scales, inert rows (seq_len 0)
give zeros.
"""

from __future__ import annotations

import importlib

import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.checks import check_attention, check_scales, check_write_kv
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mha.plan import AiterPlan, TorchPlan, TritonPlan
from atom_plugin.attention.mha.planner import plan_for_caches
from atom_plugin.attention.select import select_kernel_impl

# Imported on first use: the Triton path needs triton, the AITER path runs on ROCm only.
_PATH_MODULES = {
    TorchPlan: "atom_plugin.attention.mha.reference",
    TritonPlan: "atom_plugin.attention.mha.triton",
    AiterPlan: "atom_plugin.attention.mha.aiter",
}
_IMPL_MODULES = {
    "torch": _PATH_MODULES[TorchPlan],
    "triton": _PATH_MODULES[TritonPlan],
    "aiter": _PATH_MODULES[AiterPlan],
}


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    impl: str | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at `slot_mapping` (block * block_size + offset).

    Only the first `slot_mapping.shape[0]` tokens are read; negative slots are
    skipped. fp8 caches store x / scale, saturated to the format's range.
    `impl` names the path (default: `select_kernel_impl`); vLLM hands the cache
    update no metadata, so the backend passes the path it chose once.
    """
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    check_scales(key_cache.dtype, k_scale, v_scale)
    if slot_mapping.shape[0] == 0:
        return
    path = _IMPL_MODULES[impl or select_kernel_impl(key.device)]
    importlib.import_module(path).write_kv(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output: torch.Tensor,
) -> torch.Tensor:
    """Attention of query/output [T, Hq, D] over the paged caches; writes `output` in place."""
    check_attention(query, key_cache, value_cache, meta, output, params)
    check_scales(key_cache.dtype, params.k_scale, params.v_scale)
    if meta.num_reqs == 0 or meta.num_actual_tokens == 0:
        return output
    plan = meta.plan if meta.plan is not None else plan_for_caches(meta, key_cache)
    path = importlib.import_module(_PATH_MODULES[type(plan)])
    return path.paged_attention(query, key_cache, value_cache, meta, params, output, plan)
