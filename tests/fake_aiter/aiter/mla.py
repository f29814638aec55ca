"""Fake of AITER's MLA entry points: checks the shapes, dtypes and layouts AITER
documents, then computes the result with plain torch from the page lists it was given.

Signatures follow AITER's public `aiter/mla.py` (`mla_decode_fwd`) and
`aiter/ops/attention.py` (`get_mla_metadata_info_v1`, `get_mla_metadata_v1`) and
`aiter/ops/cache.py` (`concat_and_cache_mla`). `CALLS` records each call by name.
"""

from __future__ import annotations

import math

import torch

CALLS: list[str] = []
FAKE_CU_NUM = 80
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_planned: set[int] = set()  # ids of work_info_set buffers filled by get_mla_metadata_v1


def _int32_vector(name, t, n=None):
    assert isinstance(t, torch.Tensor), f"{name} must be a tensor"
    assert t.dtype == torch.int32 and t.dim() == 1, f"{name}: int32 1-d, got {t.dtype} {t.dim()}-d"
    if n is not None:
        assert t.shape[0] == n, f"{name}: {n} entries, got {t.shape[0]}"
    assert t.is_contiguous(), f"{name} must be contiguous"


def get_mla_metadata_info_v1(
    batch_size,
    max_seqlen_qo,
    num_head_qo,
    q_dtype,
    kv_dtype,
    is_sparse,
    fast_mode=True,
    num_kv_splits=32,
    intra_batch_mode=False,
    max_split_per_batch=-1,
):
    CALLS.append("get_mla_metadata_info_v1")
    assert num_head_qo % 8 == 0, f"num_head_qo={num_head_qo} must be a multiple of 8"
    assert max_seqlen_qo >= 1 and batch_size >= 1
    for d in (q_dtype, kv_dtype):
        assert d in (torch.bfloat16, torch.float16, *_FP8), f"unsupported dtype {d}"
    tiles = math.ceil(max_seqlen_qo * num_head_qo / 128)
    tile_cnt = batch_size * tiles
    max_work = (batch_size + FAKE_CU_NUM - 1) * tiles
    return (
        ((2,), torch.uint64),
        ((FAKE_CU_NUM + 1,), torch.int32),
        ((max_work, 8), torch.int32),
        ((tile_cnt + 1,), torch.int32),
        ((tile_cnt, 2), torch.int32),
        (((FAKE_CU_NUM - 1) * 2 * tiles,), torch.int32),
    )


def get_mla_metadata_v1(
    seqlens_qo_indptr,
    seqlens_kv_indptr,
    kv_last_page_lens,
    num_heads_per_head_k,
    num_heads_k,
    is_causal,
    work_metadata_ptrs,
    work_info_set,
    work_indptr,
    reduce_indptr,
    reduce_final_map,
    reduce_partial_map,
    page_size=1,
    kv_granularity=16,
    max_seqlen_qo=-1,
    uni_seqlen_qo=-1,
    fast_mode=True,
    topk=-1,
    max_split_per_batch=-1,
    intra_batch_mode=False,
    dtype_q=None,
    dtype_kv=None,
):
    CALLS.append("get_mla_metadata_v1")
    bs = seqlens_qo_indptr.shape[0] - 1
    _int32_vector("seqlens_qo_indptr", seqlens_qo_indptr)
    _int32_vector("seqlens_kv_indptr", seqlens_kv_indptr, bs + 1)
    _int32_vector("kv_last_page_lens", kv_last_page_lens, bs)
    assert isinstance(is_causal, bool)
    assert num_heads_k == 1 and num_heads_per_head_k % 8 == 0
    assert work_metadata_ptrs.dtype == torch.uint64 and work_metadata_ptrs.shape == (2,)
    assert work_info_set.dtype == torch.int32 and work_info_set.dim() == 2
    assert work_info_set.shape[1] == 8
    for name, t in (
        ("work_indptr", work_indptr),
        ("reduce_indptr", reduce_indptr),
        ("reduce_partial_map", reduce_partial_map),
    ):
        _int32_vector(name, t)
    assert reduce_final_map.dtype == torch.int32 and reduce_final_map.shape[1] == 2
    assert page_size >= 1 and kv_granularity >= 1
    assert max_seqlen_qo >= 1
    qo = seqlens_qo_indptr.tolist()
    q_lens = [b - a for a, b in zip(qo[:-1], qo[1:], strict=True)]
    assert max(q_lens) <= max_seqlen_qo, "max_seqlen_qo too small"
    for buf in (work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map):
        buf.zero_()
    _planned.add(id(work_info_set))


def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    page_size=1,
    nhead_kv=1,
    sm_scale=None,
    logit_cap=0.0,
    num_kv_splits=None,
    num_kv_splits_indptr=None,
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    q_scale=None,
    kv_scale=None,
    intra_batch_mode=False,
    return_logits=False,
    return_lse=False,
):
    CALLS.append("mla_decode_fwd")
    assert q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16, *_FP8)
    total_s, nhead, qk_dim = q.shape
    assert kv_buffer.dim() == 4, (
        f"kv_buffer must be [pages, page_size, nhead_kv, D], got {kv_buffer.shape}"
    )
    assert kv_buffer.shape[1] == page_size and kv_buffer.shape[2] == nhead_kv == 1
    assert kv_buffer.shape[3] == qk_dim == 576 and kv_buffer.stride(-1) == 1
    assert o.shape == (total_s, nhead, 512) and o.dtype in (torch.bfloat16, torch.float16)
    assert logit_cap <= 0
    bs = qo_indptr.shape[0] - 1
    _int32_vector("qo_indptr", qo_indptr)
    _int32_vector("kv_indptr", kv_indptr, bs + 1)
    _int32_vector("kv_last_page_lens", kv_last_page_lens, bs)
    _int32_vector("kv_indices", kv_indices)
    assert isinstance(sm_scale, float)
    if work_meta_data is not None:
        assert id(work_info_set) in _planned, "persistent buffers were not planned"
        for t in (work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map):
            assert t is not None
    if kv_buffer.dtype in _FP8:
        assert kv_scale is not None and kv_scale.dtype == torch.float32 and kv_scale.numel() == 1
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    assert kv_indices.shape[0] >= kvp[-1]
    last = kv_last_page_lens.tolist()
    lse = torch.full((total_s, nhead), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bs):
        q_len = qo[b + 1] - qo[b]
        assert q_len <= max_seqlen_q
        pages = kv_indices[kvp[b] : kvp[b + 1]].long()
        if q_len == 0:
            continue
        if pages.numel() == 0:
            o[qo[b] : qo[b + 1]] = 0
            continue
        assert 1 <= last[b] <= page_size
        rows = kv_buffer[pages, :, 0].reshape(-1, qk_dim)
        rows = rows[: (pages.numel() - 1) * page_size + last[b]].float()
        if kv_buffer.dtype in _FP8:
            rows = rows * kv_scale.float()
        n = rows.shape[0]
        s = torch.einsum("thd,kd->thk", q[qo[b] : qo[b + 1]].float(), rows) * sm_scale
        visible = n - q_len + torch.arange(q_len, device=q.device) + 1  # causal
        keys = torch.arange(n, device=q.device)
        s = s.masked_fill((keys[None, :] >= visible[:, None])[:, None, :], float("-inf"))
        lse[qo[b] : qo[b + 1]] = torch.logsumexp(s, -1)
        o[qo[b] : qo[b + 1]] = (torch.softmax(s, -1) @ rows[:, :512]).to(o.dtype)
    logits = o.float().unsqueeze(1)
    return logits, (lse if return_lse else None)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    CALLS.append("concat_and_cache_mla")
    assert kv_c.dim() == 2 and k_pe.dim() == 2 and kv_c.shape[0] == k_pe.shape[0]
    assert kv_cache.dim() == 3 and kv_cache.shape[-1] == kv_c.shape[1] + k_pe.shape[1]
    assert kv_cache.stride(-1) == 1
    assert slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1
    assert slot_mapping.shape[0] == kv_c.shape[0]
    assert kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"), kv_cache_dtype
    assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.numel() == 1
    fp8 = kv_cache_dtype != "auto"
    assert fp8 == (kv_cache.dtype in _FP8), "kv_cache_dtype must match the cache tensor"
    slots = slot_mapping
    keep = slots >= 0
    rows = torch.cat([kv_c, k_pe], dim=-1)[keep].float()
    if fp8:
        rows = rows / scale
    bs = kv_cache.shape[1]
    kv_cache[slots[keep] // bs, slots[keep] % bs] = rows.to(kv_cache.dtype)
