"""Triton varlen prefill / chunked-prefill extend over the paged KV cache.

A program handles (request, block of BLOCK_Q query tokens, kv head): its rows
are BLOCK_Q tokens x the group's query heads (row r = token r // BLOCK_G, head
r % BLOCK_G), so each K/V tile serves the whole group. New tokens sit at the
end of their context (their K/V already written), so a query at position p
sees the cached prefix and the new tokens up to p. Tiles entirely below the
block's first query position need no causal mask and take a cheaper loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.triton_common import (
    LOG2E,
    cdiv,
    check_config_keys,
    dot_flags,
    fold_sinks,
    mm,
    mm_acc,
    next_power_of_2,
)


@triton.jit
def _load_kv(ptr, pmask, dmask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A K or V tile; rows past seq_len (MASKED) and columns past head_size (not EVEN_D) read 0."""
    if MASKED:
        if EVEN_D:
            x = tl.load(ptr, mask=pmask[:, None], other=0.0)
        else:
            x = tl.load(ptr, mask=pmask[:, None] & dmask[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=dmask[None, :], other=0.0)
    return x


@triton.jit
def _tile(
    q,
    K,
    V,
    table,
    n,
    kvh,
    d,
    dmask,
    qpos,
    seq_len,
    window,
    scale,
    m,
    l_sum,
    acc,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    KV_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pos = n + tl.arange(0, BLOCK_N)
    pmask = pos < seq_len  # only MASKED tiles reach past seq_len
    if MASKED:
        blk = tl.load(table + pos // KV_BLOCK, mask=pmask, other=0).to(tl.int64)
    else:
        blk = tl.load(table + pos // KV_BLOCK).to(tl.int64)
    off = pos % KV_BLOCK
    kptr = K + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + d[None, :]
    vptr = V + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :]
    k = _load_kv(kptr, pmask, dmask, MASKED, EVEN_D)
    # qk stays unscaled: scale > 0 commutes with the row max, and qk * scale - m becomes one FMA
    qk = mm(q, tl.trans(k.to(q.dtype)), UPCAST, PRECISION)
    if MASKED:
        visible = pos[None, :] <= qpos[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1) * scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(qk * scale - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    v = _load_kv(vptr, pmask, dmask, MASKED, EVEN_D)
    acc = mm_acc(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], UPCAST, PRECISION)
    return m_new, l_sum, acc


# The first request and the window change from step to step: specializing on them
# would compile the kernel again inside serving steps.
@triton.jit(do_not_specialize=["window", "first_req"])
def _prefill_kernel(
    Q,
    K,
    V,
    Out,
    block_table,
    seq_lens,
    query_start_loc,
    k_scale,
    v_scale,
    sinks,
    qk_scale,
    window,
    first_req,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    head_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = first_req + tl.program_id(0)
    qblock = tl.num_programs(1) - 1 - tl.program_id(1)  # longest causal rows launch first
    kvh = tl.program_id(2)
    t0 = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - t0
    q_first = qblock * BLOCK_Q
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens + req)

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    qi = q_first + r // BLOCK_G
    g = r % BLOCK_G
    head = kvh * GROUP + g
    rmask = (qi < q_len) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_size
    if EVEN_D:
        io_mask = rmask[:, None]
    else:
        io_mask = rmask[:, None] & dmask[None, :]
    tok = (t0 + qi).to(tl.int64)
    if seq_len == 0:
        zeros = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        tl.store(
            Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            zeros.to(Out.dtype.element_ty),
            mask=io_mask,
        )
        return
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    scale = qk_scale
    if IS_FP8:
        scale = scale * tl.load(k_scale)

    ctx = seq_len - q_len
    qpos = ctx + qi
    p_first = ctx + q_first
    hi = tl.minimum(ctx + tl.minimum(q_first + BLOCK_Q, q_len), seq_len)
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    table = block_table + req.to(tl.int64) * stride_bt
    if HAS_WINDOW:
        lo = tl.maximum(p_first - window + 1, 0)
        unmasked_end = lo
    else:
        lo = 0
        # keys < p_first + 1 are visible to every row of the block
        unmasked_end = ((p_first + 1) // BLOCK_N) * BLOCK_N
    for n in range(lo, unmasked_end, BLOCK_N):
        m, l_sum, acc = _tile(
            q, K, V, table, n, kvh, d, dmask, qpos, seq_len, window, scale, m, l_sum, acc,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            KV_BLOCK, BLOCK_N, False, HAS_WINDOW, EVEN_D, UPCAST, PRECISION,
        )  # fmt: skip
    for n in range(unmasked_end, hi, BLOCK_N):
        m, l_sum, acc = _tile(
            q, K, V, table, n, kvh, d, dmask, qpos, seq_len, window, scale, m, l_sum, acc,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            KV_BLOCK, BLOCK_N, True, HAS_WINDOW, EVEN_D, UPCAST, PRECISION,
        )  # fmt: skip

    if HAS_SINKS:
        l_sum, acc = fold_sinks(sinks + head, g < GROUP, m, l_sum, acc)
    if IS_FP8:
        acc = acc * tl.load(v_scale)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=io_mask,
    )


def _configs(head_size: int, block_g: int, cuda: bool) -> list[dict]:
    """Candidates, fastest first (H200 sweeps, docs/benchmarks.md at 7b425cd); a GPU with too little
    shared memory for one falls back to the next.

    On CUDA the first holds 128 rows on 8 warps with 3 stages and caps its registers at
    128 (`maxnreg`), so two programs (~98 KB of shared memory each at head size 128)
    share an SM and one's softmax runs beside the other's matmuls. The next (256 rows,
    16 warps, 5 stages: K/V prefetched two tiles ahead) needs ~161 KB.
    """
    small = dict(BLOCK_Q=max(1, 64 // block_g), BLOCK_N=32, num_warps=4, num_stages=2)
    if head_size > 128:
        return [small]
    big = dict(BLOCK_Q=max(1, 256 // block_g), BLOCK_N=64, num_warps=16, num_stages=5)
    mid = dict(BLOCK_Q=max(1, 64 // block_g), BLOCK_N=64, num_warps=4, num_stages=2)
    if not cuda:
        return [big, mid, small]
    paired = dict(BLOCK_Q=max(1, 128 // block_g), BLOCK_N=64, num_warps=8, num_stages=3)
    return [dict(paired, maxnreg=128), big, mid, small]


# what a config may hold; `maxnreg` caps each program's registers (two CTAs an SM)
CONFIG_KEYS = ("BLOCK_Q", "BLOCK_N", "num_warps", "num_stages", "maxnreg")

# (device, head_size, block_g) -> index of the first config that fit
_FITTING: dict[tuple, int] = {}


def paged_prefill(
    query,
    key_cache,
    value_cache,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output,
    *,
    first_req: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention for rows [first_req, num_reqs) (default: after the decodes), any query length.

    scale (and an fp8 cache's k_scale) must be > 0: the kernel scales each row's max of
    the raw scores, not every score.
    """
    if not params.scale > 0:
        raise ValueError(f"paged_prefill needs scale > 0, got {params.scale!r}")
    first = meta.num_decodes if first_req is None else first_req
    num = meta.num_reqs - first
    if num <= 0 or meta.max_query_len == 0:
        return output
    d = query.shape[2]
    block_g = next_power_of_2(query.shape[1] // key_cache.shape[2])
    if config is not None:
        check_config_keys(config, CONFIG_KEYS)
        _launch(query, key_cache, value_cache, meta, params, output, first, num, config)
        return output
    key = (str(query.device), d, block_g)
    candidates = _configs(d, block_g, query.device.type == "cuda" and not torch.version.hip)
    for i in range(_FITTING.get(key, 0), len(candidates)):
        try:
            _launch(query, key_cache, value_cache, meta, params, output, first, num, candidates[i])
        except OutOfResources:
            if i + 1 == len(candidates):
                raise
            continue
        _FITTING[key] = i
        break
    return output


def _launch(query, key_cache, value_cache, meta, params, output, first, num, cfg) -> None:
    hq, d = query.shape[1], query.shape[2]
    _, kv_block, hkv, _ = key_cache.shape
    group = hq // hkv
    block_g = next_power_of_2(group)
    cfg = dict(cfg)
    # tl.dot needs at least 16 rows
    cfg["BLOCK_Q"] = max(cfg["BLOCK_Q"], cdiv(16, block_g))
    fp8 = is_fp8(key_cache.dtype)
    block_d = next_power_of_2(d)
    grid = (num, cdiv(meta.max_query_len, cfg["BLOCK_Q"]), hkv)
    sliding_window, sinks = params.sliding_window, params.sinks
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        output,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        params.k_scale if fp8 else meta.seq_lens,
        params.v_scale if fp8 else meta.seq_lens,
        sinks if sinks is not None else meta.seq_lens,
        params.scale * LOG2E,
        sliding_window or 0,
        first,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_table.stride(0),
        d,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_D=block_d,
        KV_BLOCK=kv_block,
        BLOCK_N=cfg["BLOCK_N"],
        IS_FP8=fp8,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        EVEN_D=d == block_d,
        **dot_flags(query),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **{k: cfg[k] for k in ("maxnreg",) if k in cfg},
    )
