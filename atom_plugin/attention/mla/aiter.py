"""The AITER MLA calls as ATOM makes them: `concat_and_cache_mla` for the cache write,
`get_mla_metadata_v1` to plan the persistent decode and `mla_decode_fwd` to run it.

AITER's decode reads the cache as `[num_pages, page_size, 1, 576]` pages listed per
request by `kv_indptr` (cumulative page counts), `kv_indices` (the pages, concatenated)
and `kv_last_page_lens`; queries by `qo_indptr`. Multi-token queries are causal inside
AITER. No ROCm machine was available to this project: these calls are checked against
the shapes and layouts AITER documents through a fake module, never run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.mha.aiter import kv_cache_dtype_name, unit_scale
from atom_plugin.attention.mla.checks import check_mla_shapes, whole_query


@dataclass(frozen=True)
class AiterMLAPlan:
    """The AITER path's plan: the page lists and the persistent kernel's work split."""

    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1], cumulative page counts
    kv_indices: torch.Tensor  # int32 [total pages]
    kv_last_page_lens: torch.Tensor  # int32 [B]
    max_seqlen_q: int
    page_size: int
    work_meta_data: torch.Tensor
    work_indptr: torch.Tensor
    work_info_set: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor
    reduce_partial_map: torch.Tensor


def build_aiter_mla_plan(
    meta, *, num_heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int
) -> AiterMLAPlan:
    """Page lists and the persistent-kernel work split for a decode batch.

    Built once per step by the metadata builder (it syncs once: the page count is
    data-dependent), shared by every layer.
    """
    import aiter

    n = meta.num_reqs
    device = meta.block_table.device
    seq = meta.seq_lens[:n].to(torch.int32)
    pages = (seq + page_size - 1) // page_size
    kv_indptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    cols = torch.arange(meta.block_table.shape[1], device=device)
    kv_indices = meta.block_table[:n][cols[None, :] < pages[:, None]].to(torch.int32)
    last = (seq - (pages - 1).clamp(min=0) * page_size).to(torch.int32)
    qo_indptr = meta.query_start_loc[: n + 1].to(torch.int32)
    max_seqlen_q = int(meta.max_query_len)
    info = aiter.get_mla_metadata_info_v1(
        n,
        max_seqlen_q,
        num_heads,
        q_dtype,
        kv_dtype,
        is_sparse=False,
        fast_mode=True,
    )
    work = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info]
    work_meta_data, work_indptr, work_info_set, reduce_indptr, final_map, partial_map = work
    aiter.get_mla_metadata_v1(
        qo_indptr,
        kv_indptr,
        last,
        num_heads,
        1,
        True,
        work_meta_data,
        work_info_set,
        work_indptr,
        reduce_indptr,
        final_map,
        partial_map,
        page_size=page_size,
        kv_granularity=max(page_size, 16),
        max_seqlen_qo=max_seqlen_q,
        uni_seqlen_qo=max_seqlen_q,
        fast_mode=True,
        dtype_q=q_dtype,
        dtype_kv=kv_dtype,
    )
    return AiterMLAPlan(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_lens=last,
        max_seqlen_q=max_seqlen_q,
        page_size=page_size,
        work_meta_data=work_meta_data,
        work_indptr=work_indptr,
        work_info_set=work_info_set,
        reduce_indptr=reduce_indptr,
        reduce_final_map=final_map,
        reduce_partial_map=partial_map,
    )


def mla_decode_aiter(
    q, kv_cache, plan: AiterMLAPlan, *, scale, output, kv_lora_rank=512, kv_scale=None
) -> torch.Tensor:
    from aiter.mla import mla_decode_fwd

    check_mla_shapes(q, kv_cache, output, kv_lora_rank)
    q = whole_query(q)  # AITER's kernel reads one [T, H, 576] query
    if kv_lora_rank != 512 or kv_cache.shape[-1] != 576:
        raise ValueError(
            f"AITER MLA decode runs DeepSeek shapes (512 + 64); got kv_lora_rank={kv_lora_rank}, "
            f"cache width {kv_cache.shape[-1]}"
        )
    page_size = kv_cache.shape[1]
    output.zero_()  # AITER writes its requests' tokens; the semantics zero every other row
    _, lse = mla_decode_fwd(
        q,
        kv_cache.unsqueeze(2),
        output,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_page_lens,
        plan.max_seqlen_q,
        page_size=page_size,
        nhead_kv=1,
        sm_scale=float(scale),
        work_meta_data=plan.work_meta_data,
        work_indptr=plan.work_indptr,
        work_info_set=plan.work_info_set,
        reduce_indptr=plan.reduce_indptr,
        reduce_final_map=plan.reduce_final_map,
        reduce_partial_map=plan.reduce_partial_map,
        kv_scale=kv_scale if is_fp8(kv_cache.dtype) else None,
        return_lse=True,
    )
    return lse


def write_mla_kv_aiter(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    import aiter

    if scale is None:
        if is_fp8(kv_cache.dtype):
            raise ValueError("an fp8 MLA cache needs a scale")
        scale = unit_scale(kv_c.device)
    n = slot_mapping.shape[0]
    aiter.concat_and_cache_mla(
        kv_c[:n], k_pe[:n], kv_cache, slot_mapping, kv_cache_dtype_name(kv_cache.dtype), scale
    )
