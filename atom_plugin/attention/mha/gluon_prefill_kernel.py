"""The Gluon kernel of `mha.gluon_prefill` (Hopper warpgroup MMA, TMA, mbarriers).

A prototype beside `triton_prefill.paged_prefill` (same semantics for what it supports:
16-bit caches, head size 64 or 128, no sliding window, no sinks), not wired into the plan.
A program (kv head, block of query rows, request; the longest causal rows launch first)
holds 128 rows on two warpgroups, 64 rows each: TOKENS query tokens x the GQA group's
BLOCK_G heads (row r = token r // BLOCK_G, head r % BLOCK_G), so each K/V tile serves the
whole group, as in the Triton kernel.

- the rows' queries are stored once into NVMMA-swizzled shared memory;
- each BLOCK_N-key tile of K and of V arrives through TMA, one 16-row box per cache page
  (the cache viewed as rows [pages * page rows, kv heads, head size]), STAGES tiles ahead, into
  rings with one mbarrier per stage and tensor (S starts before V lands);
- S = Q K^T and O += P V are `warpgroup_mma` (P from registers); the online softmax stays
  in registers, in the exp2 domain, with one FMA per score; with OVERLAP, S of tile i is
  issued before P V of tile i - 1 and the softmax of tile i runs while P V does (FA3's
  intra-warpgroup overlap); both warpgroups release a stage through one CTA barrier
  (`gluon_prefill_ws` has the warp-specialized schedule);
- tiles wholly below the program's first query position skip the causal mask;
- the last tile's V rows at or past seq_len are zeroed in shared memory (stale, even NaN,
  cache rows never reach P @ V).

Imports Gluon (Triton >= 3.6, Hopper API): import this module only to launch it. Gluon
kernels do not run in Triton's CPU interpreter; `gluon_problems` (no Gluon import) says
why an input cannot take this path.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import builtin

from atom_plugin.attention.triton_common import LOG2E, cdiv, next_power_of_2

# The CTA-wide barrier is gl.thread_barrier up to Triton 3.6 and gl.barrier from 3.7.
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def _as_box(mem, dtype, shape, layout, _semantic=None):
    """`mem` viewed as a TMA box (Gluon's `_reinterpret`, `reinterpret` in newer Tritons)."""
    view = getattr(mem, "reinterpret", None) or mem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def _issue(k_desc, v_desc, table, page_rows, seq_len, kvh, n0, k_ring, v_ring, k_bars, v_bars,
           st, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """Tile n0's K and V rows into stage `st`, one TMA box [page, 1 head, 64 columns]
    per page and column chunk
    (pages past seq_len read page 0: their rows are masked and their V rows zeroed)."""
    kb = k_bars.index(st)
    vb = v_bars.index(st)
    mbarrier.expect(kb, k_desc.block_type.nbytes * (BLOCK_N // PAGE) * (HEAD // 64))
    mbarrier.expect(vb, v_desc.block_type.nbytes * (BLOCK_N // PAGE) * (HEAD // 64))
    box: gl.constexpr = k_desc.block_type.shape  # [PAGE, 1, 64]: 128 bytes, the swizzle width
    for j in gl.static_range(BLOCK_N // PAGE):
        pos = n0 + j * PAGE
        page = gl.load(table + pos // PAGE, mask=pos < seq_len, other=0)
        row = page * page_rows
        for c in gl.static_range(HEAD // 64):
            # one swizzle-wide column chunk of the page's rows: a contiguous box in the ring
            dst_k = k_ring.index(st).slice(j * PAGE, PAGE, dim=0).slice(c * 64, 64, dim=1)
            dst_v = v_ring.index(st).slice(j * PAGE, PAGE, dim=0).slice(c * 64, 64, dim=1)
            dst_k = _as_box(dst_k, k_desc.dtype, box, k_desc.layout)
            dst_v = _as_box(dst_v, v_desc.dtype, box, v_desc.layout)
            tma.async_copy_global_to_shared(k_desc, [row, kvh, c * 64], kb, dst_k)
            tma.async_copy_global_to_shared(v_desc, [row, kvh, c * 64], vb, dst_v)


@gluon.jit
def _scores(q_smem, k_tile, BM: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """S = Q K^T (BM rows), issued (async: wait on it)."""
    s_zero = gl.zeros([BM, BLOCK_N], gl.float32, layout=s_layout)
    return warpgroup_mma(q_smem, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, n0, qpos, seq_len, scale, m_i, l_i, MASKED: gl.constexpr,
             BLOCK_N: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    """The tile's probabilities against the new running max, the max, the sum and the
    factor alpha that rescales what came before (scores stay unscaled: one FMA each)."""
    if MASKED:
        pos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = (pos[None, :] <= qpos[:, None]) & (pos < seq_len)[None, :]
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    p = gl.exp2(s * scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]


@gluon.jit
def _zero_tail(v_tile, keep, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Rows at or past `keep` of a V tile zeroed in place."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    x = v_tile.load(layout)
    v_tile.store(gl.where((rows < keep)[:, None], x, gl.zeros_like(x)))
    fence_async_shared()
    thread_barrier()


@gluon.jit
def prefill_kernel(
    Q, K_DESC, V_DESC, Out, block_table, seq_lens, query_start_loc, qk_scale, first_req,
    page_rows, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = 128
    TOKENS: gl.constexpr = BM // BLOCK_G
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HEAD, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    dtype: gl.constexpr = Q.dtype.element_ty

    kvh = gl.program_id(0)
    qblock = gl.num_programs(1) - 1 - gl.program_id(1)  # longest causal rows first
    req = first_req + gl.program_id(2)
    t0 = gl.load(query_start_loc + req)
    q_len = gl.load(query_start_loc + req + 1) - t0
    q_first = qblock * TOKENS
    if q_first >= q_len:
        return
    seq_len = gl.load(seq_lens + req)

    # the rows' tokens and heads, in the load/store layout
    r = gl.arange(0, BM, layout=gl.SliceLayout(1, io_layout))
    qi = q_first + r // BLOCK_G
    g = r % BLOCK_G
    rmask = (qi < q_len) & (g < GROUP)
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, io_layout))
    tok = (t0 + qi).to(gl.int64)
    head = kvh * GROUP + g
    q = gl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    q_smem = gl.allocate_shared_memory(
        dtype, [BM, HEAD], gl.NVMMASharedLayout.get_default_for([BM, HEAD], dtype)
    )
    q_smem.store(q)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], tile_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], tile_layout)
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
    fence_async_shared()
    thread_barrier()

    ctx = seq_len - q_len
    p_first = ctx + q_first
    hi = gl.minimum(ctx + gl.minimum(q_first + TOKENS, q_len), seq_len)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    # keys < p_first + 1 are visible to every row of the program
    unmasked = gl.minimum((p_first + 1) // BLOCK_N, num_tiles)
    table = block_table + req.to(gl.int64) * stride_bt
    for s in gl.static_range(STAGES):
        if s < num_tiles:
            _issue(K_DESC, V_DESC, table, page_rows, seq_len, kvh, s * BLOCK_N,
                   k_ring, v_ring, k_bars, v_bars, s, BLOCK_N, PAGE, HEAD)  # fmt: skip

    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rs = gl.arange(0, BM, layout=row_s)
    qpos = ctx + q_first + rs // BLOCK_G
    # a finite start: a row that sees no key of a tile keeps alpha = 1 and p = 0
    m_i = gl.full([BM], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    acc = gl.zeros([BM, HEAD], gl.float32, layout=o_layout)
    if OVERLAP:
        # S of tile i runs beside P V of tile i - 1 (FA3's intra-warpgroup overlap)
        if num_tiles > 0:
            mbarrier.wait(k_bars.index(0), 0)
            sc = _scores(q_smem, k_ring.index(0), BM, BLOCK_N, s_layout)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            if 0 < unmasked:
                p, m_i, l_i, alpha = _softmax(sc, 0, qpos, seq_len, qk_scale, m_i, l_i, False,
                                              BLOCK_N, s_layout)  # fmt: skip
            else:
                p, m_i, l_i, alpha = _softmax(sc, 0, qpos, seq_len, qk_scale, m_i, l_i, True,
                                              BLOCK_N, s_layout)  # fmt: skip
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for i in range(1, num_tiles):
                st = i % STAGES
                prev = (i - 1) % STAGES
                mbarrier.wait(k_bars.index(st), (i // STAGES) & 1)
                sc = _scores(q_smem, k_ring.index(st), BM, BLOCK_N, s_layout)
                mbarrier.wait(v_bars.index(prev), ((i - 1) // STAGES) & 1)
                acc = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
                n0 = i * BLOCK_N
                if i < unmasked:
                    p, m_i, l_i, alpha = _softmax(sc, n0, qpos, seq_len, qk_scale, m_i, l_i,
                                                  False, BLOCK_N, s_layout)  # fmt: skip
                else:
                    p, m_i, l_i, alpha = _softmax(sc, n0, qpos, seq_len, qk_scale, m_i, l_i,
                                                  True, BLOCK_N, s_layout)  # fmt: skip
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                acc = _rescale(acc, alpha, o_layout)
                # both warpgroups are done with tile i - 1: fetch tile i - 1 + STAGES into it
                thread_barrier()
                if i - 1 + STAGES < num_tiles:
                    _issue(K_DESC, V_DESC, table, page_rows, seq_len, kvh,
                           (i - 1 + STAGES) * BLOCK_N, k_ring, v_ring, k_bars, v_bars, prev,
                           BLOCK_N, PAGE, HEAD)  # fmt: skip
            last = num_tiles - 1
            st = last % STAGES
            mbarrier.wait(v_bars.index(st), (last // STAGES) & 1)
            if (last + 1) * BLOCK_N > seq_len:
                _zero_tail(v_ring.index(st), seq_len - last * BLOCK_N, BLOCK_N, io_layout)
            acc = warpgroup_mma(p_op, v_ring.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        for i in range(num_tiles):
            st = i % STAGES
            phase = (i // STAGES) & 1
            n0 = i * BLOCK_N
            mbarrier.wait(k_bars.index(st), phase)
            sc = _scores(q_smem, k_ring.index(st), BM, BLOCK_N, s_layout)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            if i < unmasked:
                p, m_i, l_i, alpha = _softmax(sc, n0, qpos, seq_len, qk_scale, m_i, l_i, False,
                                              BLOCK_N, s_layout)  # fmt: skip
            else:
                p, m_i, l_i, alpha = _softmax(sc, n0, qpos, seq_len, qk_scale, m_i, l_i, True,
                                              BLOCK_N, s_layout)  # fmt: skip
            acc = _rescale(acc, alpha, o_layout)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_bars.index(st), phase)
            if n0 + BLOCK_N > seq_len:
                _zero_tail(v_ring.index(st), seq_len - n0, BLOCK_N, io_layout)
            acc = warpgroup_mma(p_op, v_ring.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # both warpgroups are done with this stage: fetch the tile STAGES ahead into it
            thread_barrier()
            if i + STAGES < num_tiles:
                _issue(K_DESC, V_DESC, table, page_rows, seq_len, kvh, n0 + STAGES * BLOCK_N,
                       k_ring, v_ring, k_bars, v_bars, st, BLOCK_N, PAGE, HEAD)  # fmt: skip

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(s))
        mbarrier.invalidate(v_bars.index(s))

    l_o = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(1, o_layout))
    out = gl.convert_layout((acc / l_o[:, None]).to(Out.dtype.element_ty), io_layout)
    gl.store(
        Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out,
        mask=rmask[:, None],
    )


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """The cache's pages viewed as rows [pages * page rows, kv heads, head size] (page p's
    slot s is row p * page rows + s), in boxes of one page's rows of 64 columns of one head."""
    blocks, page, hkv, d = cache.shape
    step = cache.stride(0) // cache.stride(1)  # rows from one page to the next
    shape = [(blocks - 1) * step + page, hkv, d]
    box = [page, 1, 64]
    layout = gl.NVMMASharedLayout.get_default_for(box, _GLUON_DTYPES[cache.dtype])
    return TensorDescriptor(cache, shape, [cache.stride(1), cache.stride(2), 1], box, layout)


def launch(query, key_cache, value_cache, output, meta, scale, first, num, cfg) -> None:
    """The kernel on requests [first, first + num) (inputs checked by the caller)."""
    hq, d = query.shape[1], query.shape[2]
    _, page, hkv, _ = key_cache.shape
    group = hq // hkv
    block_g = next_power_of_2(group)
    grid = (hkv, cdiv(meta.max_query_len, 128 // block_g), num)
    args = (
        query,
        _descriptor(key_cache),
        _descriptor(value_cache),
        output,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        first,
        key_cache.stride(0) // key_cache.stride(1),
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        meta.block_table.stride(0),
    )
    shape = dict(GROUP=group, BLOCK_G=block_g, HEAD=d, PAGE=page)
    shape.update(BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"])
    if cfg["WS"]:
        from atom_plugin.attention.mha.gluon_prefill_ws import prefill_ws_kernel

        prefill_ws_kernel[grid](*args, **shape, num_warps=4)
    else:
        prefill_kernel[grid](*args, **shape, OVERLAP=cfg["OVERLAP"], num_warps=8)
