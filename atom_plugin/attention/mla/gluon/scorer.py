"""MLA decode stage 1 on Hopper, warp-specialized: one warpgroup scores every KV tile,
both multiply.

Same grid, partial results and semantics as `gluon.lockstep`'s kernel (16-bit caches
only). In lockstep both warpgroups score every tile, each over half its keys: each reads
the whole 72 KB query from shared memory for 32-key MMAs, which read more shared memory
than they compute. Here warpgroup 0 scores all 64 keys of every tile (the query read once
a tile, 64-key MMAs), takes the softmax and hands P and the rescale factor to warpgroup 1
through shared memory; each warpgroup keeps half of the output columns and multiplies P
into it. Warpgroup 1's product of tile i runs while warpgroup 0 scores tile i + 1.

- a tile arrives through TMA in nine 64-column chunks with a barrier each (the loader
  warp of `gluon.common`), so the scores start as the first chunk lands; a stage is
  refilled once both warpgroups have multiplied over it;
- the shared memory holds the query (latent and rope), two 64-key stages, one P buffer
  and the rescale factors (230,320 bytes).

Like `gluon.lockstep`, this module imports Gluon and only the launcher (`gluon_launch`)
imports it; its warps and registers are in `gluon_shapes`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from atom_plugin.attention.gluon_common import thread_barrier
from atom_plugin.attention.mla.gluon.common import (
    chunk_loader,
    chunk_ring,
    online_softmax,
    program_request,
    query_rows,
    query_smem,
    split_keys,
    zero_chunked_tail,
)


@gluon.jit
def scorer(
    W: gl.constexpr,
    ptrs,
    smem,
    bars,
    work,
    strides,
    descs,
    LORA: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    TOKENS: gl.constexpr,
    PAGE: gl.constexpr,
):
    """Warpgroup 0: the scores and softmax of every tile, P @ V into the left half."""
    TOK_KV_LEN, MID_O, MID_LSE = ptrs[2], ptrs[3], ptrs[4]
    qc_smem, kc_ring, kpe_ring, p_smem, alpha_smem, l_smem, qpe_smem = smem
    full, empty, p_bar, p_free, l_bar = bars
    q_start, q_len, first, pid_h, split, start, end, num_tiles, qk_scale, num_heads = work
    stride_mt, stride_mh, stride_ms = strides[4], strides[5], strides[6]
    stride_lt, stride_lh = strides[7], strides[8]
    HALF: gl.constexpr = LORA // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = qc_smem.dtype

    tok, head, mask_m = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_s)
    t = (q_start + tok).to(gl.int64)
    row_len = gl.load(TOK_KV_LEN + t, mask=mask_m, other=0)

    m_i = gl.full([64], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([64], gl.float32, layout=row_s)
    acc = gl.zeros([64, HALF], gl.float32, layout=o_layout)
    for i in range(num_tiles):
        st = i % 2
        ph = (i // 2) & 1
        n0 = start + i * 64
        kc = kc_ring.index(st)
        kpe = kpe_ring.index(st)
        keep = end - n0
        if keep < 64:  # the split's last, partial tile: its stale rows to zero
            zero_chunked_tail(kc, kpe, full, st, ph, keep, blk)
        s_acc = gl.zeros([64, 64], gl.float32, layout=s_layout)
        for c in gl.static_range(8):  # scores as the chunks land
            mbarrier.wait(full.index(st * 9 + c), ph)
            s_acc = warpgroup_mma(
                qc_smem.slice(c * 64, 64, dim=1),
                kc.slice(c * 64, 64, dim=1).permute((1, 0)),
                s_acc,
                use_acc=c > 0,
                is_async=True,
            )
        mbarrier.wait(full.index(st * 9 + 8), ph)
        s_acc = warpgroup_mma(qpe_smem, kpe.permute((1, 0)), s_acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))
        p, alpha, m_i, l_i = online_softmax(s_acc, n0, row_len, qk_scale, m_i, l_i)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = p.to(dtype)
        # P and the rescale for warpgroup 1, once it has multiplied the last P
        mbarrier.wait(p_free, (i & 1) ^ 1)
        p_smem.store(p16)
        alpha_smem.store(alpha)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(p_bar, count=1)
        acc = warpgroup_mma(
            gl.convert_layout(p16, p_op), kc.slice(0, HALF, dim=1), acc, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        thread_barrier()
        mbarrier.arrive(empty.index(st), count=1)

    l_smem.store(l_i)
    thread_barrier()
    mbarrier.arrive(l_bar, count=1)
    has = l_i > 0
    l_o = gl.convert_layout(gl.where(has, l_i, 1.0), row_o)
    out = acc / l_o[:, None]
    tok_o, head_o, mask_mo = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_o)
    t_o = (q_start + tok_o).to(gl.int64)
    offs_dv = gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    mid = MID_O + t_o[:, None] * stride_mt + head_o[:, None] * stride_mh + split * stride_ms
    if num_tiles > 0:  # a split without keys: its lse only (as the Triton kernels)
        gl.store(mid + offs_dv[None, :], out.to(MID_O.dtype.element_ty), mask=mask_mo[:, None])
    lse = gl.where(has, m_i * 0.6931471805599453 + gl.log(gl.where(has, l_i, 1.0)), float("-inf"))
    gl.store(MID_LSE + t * stride_lt + head * stride_lh + split, lse, mask=mask_m)


@gluon.jit
def multiplier(
    W: gl.constexpr,
    ptrs,
    smem,
    bars,
    work,
    strides,
    descs,
    LORA: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    TOKENS: gl.constexpr,
    PAGE: gl.constexpr,
):
    """Warpgroup 1: each tile's P (from warpgroup 0) @ V into the right half."""
    MID_O = ptrs[3]
    kc_ring, p_smem, alpha_smem, l_smem = smem[1], smem[3], smem[4], smem[5]
    empty, p_bar, p_free, l_bar = bars[1], bars[2], bars[3], bars[4]
    q_start, q_len, first, pid_h, split, _, _, num_tiles, _, num_heads = work
    stride_mt, stride_mh, stride_ms = strides[4], strides[5], strides[6]
    HALF: gl.constexpr = LORA // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    acc = gl.zeros([64, HALF], gl.float32, layout=o_layout)
    for i in range(num_tiles):
        st = i % 2
        mbarrier.wait(p_bar, i & 1)
        alpha = alpha_smem.load(row_o)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem, kc_ring.index(st).slice(HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        thread_barrier()
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(empty.index(st), count=1)

    mbarrier.wait(l_bar, 0)
    l_i = l_smem.load(row_o)
    out = acc / gl.where(l_i > 0, l_i, 1.0)[:, None]
    tok_o, head_o, mask_mo = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_o)
    t_o = (q_start + tok_o).to(gl.int64)
    offs_dv = HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    mid = MID_O + t_o[:, None] * stride_mt + head_o[:, None] * stride_mh + split * stride_ms
    if num_tiles > 0:
        gl.store(mid + offs_dv[None, :], out.to(MID_O.dtype.element_ty), mask=mask_mo[:, None])


@gluon.jit
def stage1(
    Q,
    QPE,
    KC_DESC,
    KPE_DESC,
    BLOCK_TABLE,
    QSL,
    TOK_KV_LEN,
    MID_O,
    MID_LSE,
    sm_scale,
    num_heads,
    num_splits,
    token_chunks,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_bt,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    PAGE: gl.constexpr,
    LORA: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    TOKENS: gl.constexpr,
):
    pid_h, split, r, q_start, q_len, first = program_request(QSL, token_chunks, TOKENS)
    if first >= q_len:
        return
    dtype: gl.constexpr = Q.dtype.element_ty
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    # the query's latent and rope parts once into shared memory, masked rows zero
    tok, head, mask_m = query_rows(
        first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, gl.SliceLayout(1, blk)
    )
    t = (q_start + tok).to(gl.int64)
    qc_smem = query_smem(Q, t, head, mask_m, stride_qt, stride_qh, LORA, blk)
    qpe_smem = query_smem(QPE, t, head, mask_m, stride_pt, stride_ph, ROPE, blk)
    row_len = gl.load(TOK_KV_LEN + t, mask=mask_m, other=0)
    start, end, num_tiles = split_keys(row_len, num_splits, split, 64)

    kc_ring, kpe_ring, full, empty = chunk_ring(KPE_DESC, dtype, LORA)
    p_smem = gl.allocate_shared_memory(
        dtype, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    )
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [64], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [64], vec)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    p_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    p_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    l_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(p_bar, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(l_bar, count=1)
    fence_async_shared()
    thread_barrier()

    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    bt_row = BLOCK_TABLE + r.to(gl.int64) * stride_bt
    # The partitions take one signature (Gluon 3.6's workers share it), laid out as
    # `chunk_loader` reads it.
    ptrs = (Q, QPE, TOK_KV_LEN, MID_O, MID_LSE)
    smem = (qc_smem, kc_ring, kpe_ring, p_smem, alpha_smem, l_smem, qpe_smem)
    bars = (full, empty, p_bar, p_free, l_bar)
    work = (q_start, q_len, first, pid_h, split, start, end, num_tiles, qk_scale, num_heads)
    strides = (
        stride_qt,
        stride_qh,
        stride_pt,
        stride_ph,
        stride_mt,
        stride_mh,
        stride_ms,
        stride_lt,
        stride_lh,
    )
    descs = (KC_DESC, KPE_DESC, bt_row)
    gl.warp_specialize(
        [
            (
                scorer,
                (0, ptrs, smem, bars, work, strides, descs, LORA, ROPE, BLOCK_H, TOKENS, PAGE),
            ),
            (
                multiplier,
                (1, ptrs, smem, bars, work, strides, descs, LORA, ROPE, BLOCK_H, TOKENS, PAGE),
            ),
            (
                chunk_loader,
                (2, ptrs, smem, bars, work, strides, descs, LORA, ROPE, BLOCK_H, TOKENS, PAGE),
            ),
        ],
        [4, 1],
        [240, 24],
    )
