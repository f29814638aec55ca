"""Planning a step of the MHA paths (`plan_mha`): the one place on the attention path
that asks `select_kernel_impl` which path runs, and what that path decides once per
batch (`plan.py`'s types)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atom_plugin.attention.mha.plan import AiterPlan, AiterPrefill, MHAPlan, TorchPlan, TritonPlan
from atom_plugin.attention.select import select_kernel_impl

if TYPE_CHECKING:
    from atom_plugin.attention.metadata import PagedAttentionMetadata
    from atom_plugin.attention.mha.gluon_prefill_launch import WorkCounters


def plan_mha(
    meta: PagedAttentionMetadata,
    *,
    device: torch.device,
    num_kv_heads: int,
    block_size: int,
    impl: str | None = None,
) -> MHAPlan:
    """The plan of `impl` (default: `select_kernel_impl(device)`) for this batch."""
    impl = impl or select_kernel_impl(device)
    if impl == "torch":
        return TorchPlan()
    if impl == "triton":
        return TritonPlan(
            num_splits=_decode_splits(meta, num_kv_heads, device),
            gluon_counters=_gluon_counters(device) if meta.num_prefills else None,
        )
    if impl == "aiter":
        from atom_plugin.attention.mha import aiter

        return AiterPlan(
            decode_partitions=-(-max(meta.max_seq_len, 1) // aiter.PARTITION_SIZE),
            sink_decode_splits=_decode_splits(meta, num_kv_heads, device),
            prefill=_aiter_prefill(meta, block_size) if meta.num_prefills else None,
        )
    raise ValueError(f"no MHA plan for kernel implementation {impl!r}")


def prepare_mha_plans(device: torch.device, impl: str) -> None:
    """Make what `impl`'s plans on `device` share from step to step: the Gluon prefill's
    work counters. The metadata builder calls this as it starts, before any CUDA graph
    capture, which must not allocate them."""
    if impl == "triton":
        _gluon_counters(device)


def _gluon_counters(device: torch.device) -> WorkCounters | None:
    """The Gluon prefill's work counters where `device` takes that kernel, else None."""
    from atom_plugin.attention.mha import gluon_prefill_launch as gpl

    return gpl.work_counters(device) if gpl.device_takes_gluon_prefill(device) else None


def plan_for_caches(
    meta: PagedAttentionMetadata, key_cache: torch.Tensor, impl: str | None = None
) -> MHAPlan:
    """`plan_mha` with the layout read from a [blocks, block_size, Hkv, D] cache
    (for callers that run the ops without a builder)."""
    _, block_size, num_kv_heads, _ = key_cache.shape
    return plan_mha(
        meta,
        device=key_cache.device,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        impl=impl,
    )


def _decode_splits(meta: PagedAttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    if meta.num_decodes == 0:
        return 1
    # Imported here: the Triton modules import triton, which the torch path does not need.
    from atom_plugin.attention.mha.triton_decode import programs_per_sm
    from atom_plugin.attention.triton_common import choose_num_splits, device_sm_count

    return choose_num_splits(
        meta.num_decodes,
        num_kv_heads,
        meta.max_seq_len,
        device_sm_count(device),
        programs_per_sm(device),
    )


def _aiter_prefill(meta: PagedAttentionMetadata, block_size: int) -> AiterPrefill:
    from atom_plugin.attention.mha import aiter

    first, last = meta.num_decodes, meta.num_reqs
    seq_lens = meta.seq_lens[first:last]
    cu_k = torch.zeros(last - first + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, out=cu_k[1:])
    total = int(cu_k[-1])  # host read: sizes the gathered context (prefills are not graphed)
    slots = aiter.context_slots(meta.block_table[first:last], seq_lens, total, block_size)
    return AiterPrefill(cu_seqlens_k=cu_k, slots=slots, block_size=block_size)
