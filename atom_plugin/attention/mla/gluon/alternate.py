"""MLA decode stage 1 on Hopper, warp-specialized: the two warpgroups take alternate
KV tiles, a loader warp feeds them.

Same grid, partial results and semantics as `gluon.lockstep`'s lockstep kernel (16-bit
caches only). The difference is how the two warpgroups share the work. In lockstep
both take every tile and split its keys, so both read the whole query for every tile
in 32-key MMAs. Here warpgroup 0 scores the even tiles and warpgroup 1 the odd ones,
each over all 64 keys of its own tile, and each keeps half of the output columns:

- per pair of tiles each warpgroup publishes its tile's row maxima (shared memory and
  an mbarrier), both take the same new running max, each publishes its P (16-bit) and
  multiplies its own P (registers) and the other's (shared memory) into its half;
- a tile arrives through TMA in nine 64-column chunks with a barrier each, so the
  scores start as the first chunk lands; the loader warp refills a stage once both
  warpgroups have released it, and both multiply over stage 0 first (warpgroup 0 its
  own tile, warpgroup 1 the remote one), so stage 0 is refilled while the products
  over stage 1 still run;
- the query's rope part is held in registers: the shared memory holds the latent
  query, two 64-key stages and two P buffers (230 KB).

Like `gluon.lockstep`, this module imports Gluon and only the launcher (`gluon_launch`)
imports it; its box width, warps and registers are in `gluon_shapes`.
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
    program_request,
    query_rows,
    query_smem,
    split_keys,
    zero_chunked_tail,
)


@gluon.jit
def consumer(
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
    Q, QPE, TOK_KV_LEN, MID_O, MID_LSE = ptrs
    qc_smem, kc_ring, kpe_ring, p_smem, max_smem, l_smem = smem
    full, empty, max_bar, p_bar, p_free, l_bar = bars
    q_start, q_len, first, pid_h, split, start, end, num_tiles, qk_scale, num_heads = work
    stride_pt, stride_ph = strides[2], strides[3]  # the query's rope part
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
    qr_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = Q.dtype.element_ty

    # the rows' visible key counts and the query's rope part (registers)
    tok, head, mask_m = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_s)
    t = (q_start + tok).to(gl.int64)
    row_len = gl.load(TOK_KV_LEN + t, mask=mask_m, other=0)
    tok_q, head_q, mask_q = query_rows(
        first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, gl.SliceLayout(1, qr_op)
    )
    offs_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, qr_op))
    pe_row = QPE + (q_start + tok_q).to(gl.int64)[:, None] * stride_pt
    q_rope = gl.load(
        pe_row + head_q[:, None] * stride_ph + offs_r[None, :],
        mask=mask_q[:, None],
        other=0.0,
    )

    m_i = gl.full([64], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([64], gl.float32, layout=row_s)
    acc = gl.zeros([64, HALF], gl.float32, layout=o_layout)
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    offs_n = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
    for j in range(gl.cdiv(num_tiles, 2)):
        ph = j & 1
        mine = 2 * j + W
        n0 = start + mine * 64
        sc = gl.full([64, 64], float("-inf"), gl.float32, layout=s_layout)
        if mine < num_tiles:
            kc = kc_ring.index(W)
            keep = end - n0
            if keep < 64:  # the split's last, partial tile: its stale rows to zero
                zero_chunked_tail(kc, kpe_ring.index(W), full, W, ph, keep, blk)
            s_acc = s_zero
            for c in gl.static_range(8):  # scores as the chunks land
                mbarrier.wait(full.index(W * 9 + c), ph)
                s_acc = warpgroup_mma(
                    qc_smem.slice(c * 64, 64, dim=1),
                    kc.slice(c * 64, 64, dim=1).permute((1, 0)),
                    s_acc,
                    use_acc=c > 0,
                    is_async=True,
                )
            mbarrier.wait(full.index(W * 9 + 8), ph)
            s_acc = warpgroup_mma(q_rope, kpe_ring.index(W).permute((1, 0)), s_acc, is_async=True)
            s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))
            valid = (n0 + offs_n)[None, :] < row_len[:, None]
            sc = gl.where(valid, s_acc * qk_scale, float("-inf"))
        # one running max for both warpgroups: each publishes its tile's row maxima
        rm = gl.max(sc, 1)
        max_smem.index(W).store(rm)
        thread_barrier()
        mbarrier.arrive(max_bar.index(W), count=1)
        mbarrier.wait(max_bar.index(1 - W), ph)
        rm_other = max_smem.index(1 - W).load(row_s)
        m_new = gl.maximum(m_i, gl.maximum(rm, rm_other))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = p.to(dtype)
        # my P for the other warpgroup, once it has read my last one
        mbarrier.wait(p_free.index(W), ph ^ 1)
        p_smem.index(W).store(p16)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(p_bar.index(W), count=1)
        # P @ V over stage 0 first on both warpgroups (warpgroup 0's own tile, warpgroup
        # 1's remote one), so stage 0 is released for the next pair's tile while the
        # products over stage 1 still run
        if W == 0:
            acc = warpgroup_mma(
                gl.convert_layout(p16, p_op),
                kc_ring.index(0).slice(0, HALF, dim=1),
                acc,
                is_async=True,
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.wait(p_bar.index(1), ph)
        else:
            mbarrier.wait(p_bar.index(0), ph)
            acc = warpgroup_mma(
                p_smem.index(0),
                kc_ring.index(0).slice(HALF, HALF, dim=1),
                acc,
                is_async=True,
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if 2 * j + 1 < num_tiles:  # stage 1 holds a tile in this pair
            if W == 0:
                acc = warpgroup_mma(
                    p_smem.index(1),
                    kc_ring.index(1).slice(0, HALF, dim=1),
                    acc,
                    is_async=True,
                )
            else:
                acc = warpgroup_mma(
                    gl.convert_layout(p16, p_op),
                    kc_ring.index(1).slice(HALF, HALF, dim=1),
                    acc,
                    is_async=True,
                )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        thread_barrier()
        mbarrier.arrive(empty.index(0), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        thread_barrier()
        mbarrier.arrive(p_free.index(1 - W), count=1)
        mbarrier.arrive(empty.index(1), count=1)

    # the row sums of both halves of the keys
    l_smem.index(W).store(l_i)
    thread_barrier()
    mbarrier.arrive(l_bar.index(W), count=1)
    mbarrier.wait(l_bar.index(1 - W), 0)
    l_tot = l_i + l_smem.index(1 - W).load(row_s)
    has = l_tot > 0
    l_o = gl.convert_layout(gl.where(has, l_tot, 1.0), row_o)
    out = acc / l_o[:, None]
    tok_o, head_o, mask_mo = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_o)
    t_o = (q_start + tok_o).to(gl.int64)
    offs_dv = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    mid = MID_O + t_o[:, None] * stride_mt + head_o[:, None] * stride_mh + split * stride_ms
    if num_tiles > 0:  # a split without keys: its lse only (as the Triton kernels)
        gl.store(mid + offs_dv[None, :], out.to(MID_O.dtype.element_ty), mask=mask_mo[:, None])
    if W == 0:
        lse = gl.where(
            has, m_i * 0.6931471805599453 + gl.log(gl.where(has, l_tot, 1.0)), float("-inf")
        )
        gl.store(MID_LSE + t * stride_lt + head * stride_lh + split, lse, mask=mask_m)


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

    # the latent query once into shared memory, masked rows zero
    tok, head, mask_m = query_rows(
        first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, gl.SliceLayout(1, blk)
    )
    t = (q_start + tok).to(gl.int64)
    qc_smem = query_smem(Q, t, head, mask_m, stride_qt, stride_qh, LORA, blk)
    row_len = gl.load(TOK_KV_LEN + t, mask=mask_m, other=0)
    start, end, num_tiles = split_keys(row_len, num_splits, split, 64)

    kc_ring, kpe_ring, full, empty = chunk_ring(KPE_DESC, dtype, LORA)
    p_smem = gl.allocate_shared_memory(
        dtype, [2, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    )
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    max_smem = gl.allocate_shared_memory(gl.float32, [2, 64], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, 64], vec)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    max_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(max_bar.index(i), count=1)
        mbarrier.init(p_bar.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(l_bar.index(i), count=1)
    fence_async_shared()
    thread_barrier()

    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    bt_row = BLOCK_TABLE + r.to(gl.int64) * stride_bt
    # Every partition takes the same arguments (Gluon 3.6's workers share one
    # signature), grouped in tuples; the first names the partition's role.
    ptrs = (Q, QPE, TOK_KV_LEN, MID_O, MID_LSE)
    smem = (qc_smem, kc_ring, kpe_ring, p_smem, max_smem, l_smem)
    bars = (full, empty, max_bar, p_bar, p_free, l_bar)
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
                consumer,
                (0, ptrs, smem, bars, work, strides, descs, LORA, ROPE, BLOCK_H, TOKENS, PAGE),
            ),
            (
                consumer,
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
