"""A stand-in for AITER's Python API, for tests on machines without ROCm.

Each function asserts the argument shapes, dtypes and layouts that AITER
documents for it (aiter/ops/cache.py, attention.py, mha.py and the kernels'
docstrings) and computes the result in torch, so the project's AITER path can
be checked end to end. It proves the calls are well formed, not that AITER's
kernels agree: nothing here ran on ROCm. Every MHA call is appended to `CALLS`
(the MLA fakes in aiter/mla.py keep their own list).
"""

from __future__ import annotations

import importlib.util

import torch

CALLS: list[str] = []

_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_HALF = (torch.float16, torch.bfloat16)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"fake aiter: {msg}")


def _check_kv_dtype(kv_cache_dtype: str, cache: torch.Tensor, k_scale, v_scale) -> None:
    _expect(kv_cache_dtype in ("auto", "fp8"), f"kv_cache_dtype {kv_cache_dtype!r}")
    _expect((kv_cache_dtype == "fp8") == (cache.dtype in _FP8), "kv_cache_dtype vs cache dtype")
    for s in (k_scale, v_scale):
        _expect(
            isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.numel() == 1,
            "k_scale/v_scale must be float32 tensors of one element",
        )


def _store(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    if dtype in _FP8:
        limit = torch.finfo(dtype).max
        return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def _load(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.float() * scale.float() if x.dtype in _FP8 and scale is not None else x.float()


# --- KV-cache writes -------------------------------------------------------------------


def reshape_and_cache_flash(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
) -> None:
    """key/value [T, H, D]; caches NHD [num_blocks, block_size, H, D]; slots int64, <0 skipped."""
    CALLS.append("reshape_and_cache_flash")
    _expect(key.dim() == 3 and value.shape == key.shape, "key/value must be [T, H, D]")
    _expect(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, "caches 4-d NHD")
    _expect(key_cache.shape[2:] == key.shape[1:], "cache [.., .., H, D] must match key")
    _expect(key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "unit last stride")
    _expect(slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1, "slot_mapping int64")
    _expect(key.shape[0] >= slot_mapping.shape[0], "fewer tokens than slots")
    _check_kv_dtype(kv_cache_dtype, key_cache, k_scale, v_scale)
    bs = key_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            key_cache[s // bs, s % bs] = _store(key[t], key_cache.dtype, k_scale)
            value_cache[s // bs, s % bs] = _store(value[t], value_cache.dtype, v_scale)


def reshape_and_cache(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale=None,
    v_scale=None, asm_layout=False,
) -> None:  # fmt: skip
    """K cache [nb, H, D/x, bs, x]; V [nb, H, bs/x, D, x] with asm_layout, else [nb, H, D, bs]."""
    CALLS.append("reshape_and_cache")
    _expect(key.dim() == 3, "key must be [T, H, D]")
    heads, d = key.shape[1], key.shape[2]
    x = 16 // key_cache.element_size()
    _expect(key_cache.dim() == 5 and key_cache.shape[4] == x, f"K cache [nb,H,D/x,bs,x], x={x}")
    nb, h, dx, bs, _ = key_cache.shape
    _expect(h == heads and dx * x == d, "K cache heads/head size")
    if asm_layout:
        _expect(value_cache.shape == (nb, h, bs // x, d, x), "asm V cache [nb,H,bs/x,D,x]")
    else:
        _expect(value_cache.shape == (nb, h, d, bs), "V cache [nb,H,D,bs]")
    _check_kv_dtype(kv_cache_dtype, key_cache, k_scale, v_scale)
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, off = divmod(s, bs)
        key_cache[b, :, :, off, :] = _store(key[t], key_cache.dtype, k_scale).view(h, dx, x)
        vq = _store(value[t], value_cache.dtype, v_scale)  # [H, D]
        if asm_layout:
            value_cache[b, :, off // x, :, off % x] = vq
        else:
            value_cache[b, :, :, off] = vq


def asm_layout_to_nhd(key_cache, value_cache):
    """The asm-layout caches as NHD tensors [nb, bs, H, D] (for computing results)."""
    nb, h, dx, bs, x = key_cache.shape
    k = key_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, h, dx * x)
    v = value_cache.permute(0, 2, 4, 1, 3).reshape(nb, bs, h, value_cache.shape[3])
    return k, v


# --- attention --------------------------------------------------------------------------


def _paged_decode(query, k_nhd, v_nhd, block_tables, context_lens, scale, window, k_scale, v_scale):
    """out[i] for decode row i: attention of query[i] over its context (last key = itself)."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    hq, hkv = query.shape[1], k_nhd.shape[2]
    bs = k_nhd.shape[1]
    for i, s in enumerate(context_lens.tolist()):
        if s == 0:
            continue
        pos = torch.arange(s, device=query.device)
        if window:
            pos = pos[max(0, s - window) :]
        blk = block_tables[i, pos // bs].long()
        k = _load(k_nhd[blk, pos % bs], k_scale).repeat_interleave(hq // hkv, 1)  # [s, Hq, D]
        v = _load(v_nhd[blk, pos % bs], v_scale).repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", query[i].float(), k) * scale, -1)
        out[i] = torch.einsum("hs,shd->hd", p, v)
    return out


def paged_attention_v1(
    out, workspace_buffer, query, key_cache, value_cache, scale, block_tables, cu_query_lens,
    context_lens, max_context_len, alibi_slopes, kv_cache_dtype, kv_cache_layout,
    logits_soft_cap, k_scale, v_scale, fp8_out_scale=None, partition_size=256, mtp=1,
    sliding_window=0,
):  # fmt: skip
    """Decode over NHD caches [nb, bs, Hkv, D]; sliding_window = keys visible (0 = off)."""
    CALLS.append("paged_attention_v1")
    n, hq, d = query.shape
    _expect(out.shape == query.shape and out.dtype == query.dtype, "out like query")
    _expect(query.dtype in _HALF + (torch.float32,), f"query dtype {query.dtype}")
    _expect(kv_cache_layout == "NHD", f"kv_cache_layout {kv_cache_layout!r}")
    _expect(key_cache.dim() == 4 and key_cache.shape[3] == d, "NHD cache [nb, bs, H, D]")
    _expect(key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "unit last stride")
    _expect(hq % key_cache.shape[2] == 0, "query heads multiple of kv heads")
    _expect(block_tables.dtype == torch.int32 and block_tables.shape[0] == n, "block_tables")
    _expect(context_lens.dtype == torch.int32 and context_lens.shape == (n,), "context_lens [n]")
    _expect(cu_query_lens is None or cu_query_lens.dtype == torch.int32, "cu_query_lens int32")
    _expect(isinstance(max_context_len, int), "max_context_len int")
    _expect(n == 0 or int(context_lens.max()) <= max_context_len, "max_context_len bound")
    parts = -(-max_context_len // partition_size)
    need = n * hq * parts * d * query.element_size() + 2 * n * hq * parts * 4
    _expect(workspace_buffer.dtype == torch.uint8 and workspace_buffer.numel() >= need, "workspace")
    _expect(alibi_slopes is None and logits_soft_cap == 0.0 and fp8_out_scale is None, "extras")
    _expect(mtp == 1 and isinstance(sliding_window, int) and sliding_window >= 0, "mtp/window")
    _check_kv_dtype(kv_cache_dtype, key_cache, k_scale, v_scale)
    res = _paged_decode(
        query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
        k_scale, v_scale,
    )  # fmt: skip
    out.copy_(res.to(out.dtype))
    return out


def pa_fwd_asm(
    Q, K, V, block_tables, context_lens, block_tables_stride0, max_qlen=1, K_QScale=None,
    V_QScale=None, out_=None, qo_indptr=None, high_precision=1, kernelName=None,
):  # fmt: skip
    """Q [n, Hq, 128]; K [nb, Hkv, D/x, bs, x]; V [nb, Hkv, bs/x, D, x]; scale 1/sqrt(D)."""
    CALLS.append("pa_fwd_asm")
    n, hq, d = Q.shape
    _expect(d == 128, "asm paged attention needs head_size 128")
    x = 16 // K.element_size()
    _expect(K.dim() == 5 and K.shape[4] == x and K.shape[2] * x == d, "K [nb,Hkv,D/x,bs,x]")
    nb, hkv, _, bs, _ = K.shape
    _expect(V.shape == (nb, hkv, bs // x, d, x), "V [nb,Hkv,bs/x,D,x]")
    _expect(block_tables.dtype == torch.int32 and block_tables.shape[0] == n, "block_tables")
    _expect(block_tables_stride0 == block_tables.stride(0), "block_tables_stride0")
    _expect(context_lens.dtype == torch.int32 and context_lens.shape == (n,), "context_lens")
    _expect(max_qlen == 1 and qo_indptr is None, "decode only")
    _expect((K.dtype in _FP8) == (K_QScale is not None), "K_QScale exactly for fp8 caches")
    out = out_ if out_ is not None else torch.empty_like(Q)
    k, v = asm_layout_to_nhd(K, V)
    res = _paged_decode(Q, k, v, block_tables, context_lens, d**-0.5, 0, K_QScale, V_QScale)
    out.copy_(res.to(out.dtype))
    return out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
    dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
    window_size=(-1, -1), sink_size=0, bias=None, alibi_slopes=None, deterministic=True,
    return_lse=False, return_attn_probs=False, block_table=None, out=None, sink_ptr=None,
    **unknown,
):  # fmt: skip
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] packed; causal aligned bottom-right; window (left, right)."""
    CALLS.append("flash_attn_varlen_func")
    _expect(not unknown, f"unknown arguments {sorted(unknown)}")
    _expect(q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, "packed q/k/v")
    _expect(q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, "heads/head size")
    _expect(k.dtype == q.dtype and v.dtype == q.dtype, "k/v dtype equals q dtype")
    _expect(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu int32")
    _expect(cu_seqlens_q.shape == cu_seqlens_k.shape, "one cu entry per sequence each")
    _expect(dropout_p == 0.0 and block_table is None and bias is None, "inference call")
    _expect(len(window_size) == 2, "window_size (left, right)")
    _expect(
        sink_ptr is None or (sink_ptr.dtype == torch.float32 and sink_ptr.shape == (q.shape[1],)),
        "sink_ptr float32 [Hq]",
    )
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _expect(cq[-1] <= q.shape[0] and ck[-1] <= k.shape[0], "cu_seqlens within tensors")
    _expect(
        max(b - a for a, b in zip(cq[:-1], cq[1:], strict=True)) <= max_seqlen_q,
        "max_seqlen_q bound",
    )
    _expect(
        max(b - a for a, b in zip(ck[:-1], ck[1:], strict=True)) <= max_seqlen_k,
        "max_seqlen_k bound",
    )
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    res = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    left, right = window_size
    for i in range(len(cq) - 1):
        sq, sk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if sq == 0:
            continue
        qi = q[cq[i] : cq[i + 1]].float().transpose(0, 1)
        ki = k[ck[i] : ck[i + 1]].float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[ck[i] : ck[i + 1]].float().repeat_interleave(group, 1).transpose(0, 1)
        logits = qi @ ki.transpose(1, 2) * scale  # [Hq, sq, sk]
        row = torch.arange(sq, device=q.device)[:, None] + sk - sq  # bottom-right alignment
        col = torch.arange(sk, device=q.device)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if causal:
            keep &= col <= row
        if left >= 0:
            keep &= col >= row - left
        if right >= 0 and not causal:
            keep &= col <= row + right
        logits = logits.masked_fill(~keep, float("-inf"))
        m = logits.amax(-1, keepdim=True).clamp_min(-1e30)
        if sink_ptr is not None:
            m = torch.maximum(m, sink_ptr.float().view(-1, 1, 1))
        e = torch.exp(logits - m)
        denom = e.sum(-1, keepdim=True)
        if sink_ptr is not None:
            denom = denom + torch.exp(sink_ptr.float().view(-1, 1, 1) - m)
        o = (e @ vi) / torch.where(denom > 0, denom, torch.ones_like(denom))
        res[cq[i] : cq[i + 1]] = o.transpose(0, 1)
    if out is None:
        out = torch.empty_like(q)
    _expect(out.shape == q.shape and out.dtype == q.dtype, "out like q")
    out.copy_(res.to(out.dtype))
    return (out, None) if return_lse else out


# The MLA fakes live in aiter/mla.py (as mla_decode_fwd does in AITER); AITER also
# exports these three at the top level. Their CALLS list stays their own.
if importlib.util.find_spec(f"{__name__}.mla") is not None:
    from . import mla as _mla

    concat_and_cache_mla = _mla.concat_and_cache_mla
    get_mla_metadata_info_v1 = _mla.get_mla_metadata_info_v1
    get_mla_metadata_v1 = _mla.get_mla_metadata_v1
