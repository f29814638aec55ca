"""MLA decode stage 1 as a Hopper warpgroup-MMA kernel, written in Gluon.

One program holds 64 query rows (the heads of a head group times the request's packed
query tokens, padded to 64) on two warpgroups, the same grid as the packed Triton
kernel (head group, KV split, request and token chunk) and the same partial results,
so `mla.triton`'s merge finishes it. Where the Triton kernels keep the query and the
64 x 512 fp32 accumulator in registers of one warpgroup (and spill), here the query
lives in shared memory and each warpgroup owns half of the accumulator's columns:

- the query's latent and rope parts are stored once into NVMMA-swizzled shared memory;
- each 64-key tile (one page, or a 64-row part of one) arrives through TMA, STAGES
  tiles ahead, into a ring of buffers with one mbarrier each;
- S = Q_c K_c^T + Q_pe K_pe^T and O += P V run as `warpgroup_mma` on the buffers
  (the latent columns are both K and V), the keys of S split between the warpgroups,
  the output columns of O likewise;
- fp8 tiles are widened unscaled to fp16 through registers into one more buffer (e4m3
  is exact in fp16; the per-tensor scale goes into the score scale and the output), as
  the packed Triton kernel does;
- the last, partial tile of a split has its rows past the split's end zeroed in shared
  memory before the matmuls, so stale (even NaN) cache rows never reach P @ V.

The kernel needs a CUDA GPU of compute capability 9.x and a cache TMA can read in
64-row tiles (`gluon.probe` and `mla.cache_view.tma_problems` say where it can run);
Gluon kernels do not run in Triton's CPU interpreter, so this path is tested on the GPU
only. This module imports Gluon: only the launcher (`gluon_launch`) imports it, at the
first launch; its tiles, warps and stages are in `gluon_shapes`, which the plan reads.
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
    fill_ring,
    issue_tile,
    online_softmax,
    program_request,
    query_rows,
    split_keys,
    tile_ring,
    widen,
    zero_tail,
)


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
    KV_SCALE,
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
    STAGES: gl.constexpr,
    IS_FP8: gl.constexpr,
):
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    # S [64, BN]: the keys split between the two warpgroups; O [64, LORA]: the columns
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, LORA // 2, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mma_dtype: gl.constexpr = gl.float16 if IS_FP8 else Q.dtype.element_ty

    pid_h, split, r, q_start, q_len, first = program_request(QSL, token_chunks, TOKENS)
    if first >= q_len:
        return

    # the query rows once into shared memory (masked rows zero)
    tok_l, head_l, mask_ml = query_rows(
        first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, gl.SliceLayout(1, load_layout)
    )
    t_l = (q_start + tok_l).to(gl.int64)[:, None]
    q_row = Q + t_l * stride_qt + head_l[:, None] * stride_qh
    pe_row = QPE + t_l * stride_pt + head_l[:, None] * stride_ph
    offs_c = gl.arange(0, LORA, layout=gl.SliceLayout(0, load_layout))
    offs_p = gl.arange(0, ROPE, layout=gl.SliceLayout(0, load_layout))
    q_c = gl.load(q_row + offs_c[None, :], mask=mask_ml[:, None], other=0.0)
    q_pe = gl.load(pe_row + offs_p[None, :], mask=mask_ml[:, None], other=0.0)
    if IS_FP8:
        q_c = gl.minimum(gl.maximum(q_c.to(gl.float32), -65504.0), 65504.0)
        q_pe = gl.minimum(gl.maximum(q_pe.to(gl.float32), -65504.0), 65504.0)
    qc_smem = gl.allocate_shared_memory(
        mma_dtype, [BM, LORA], gl.NVMMASharedLayout.get_default_for([BM, LORA], mma_dtype)
    )
    qpe_smem = gl.allocate_shared_memory(
        mma_dtype, [BM, ROPE], gl.NVMMASharedLayout.get_default_for([BM, ROPE], mma_dtype)
    )
    qc_smem.store(q_c.to(mma_dtype))
    qpe_smem.store(q_pe.to(mma_dtype))

    # this program's keys: the rows' longest visible count, cut into splits of whole tiles
    tok, head, mask_m = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_s)
    t = (q_start + tok).to(gl.int64)
    row_len = gl.load(TOK_KV_LEN + t, mask=mask_m, other=0)
    start, end, num_tiles = split_keys(row_len, num_splits, split, BN)

    ring = tile_ring(KC_DESC, KPE_DESC, STAGES)
    kc_ring, kpe_ring, bars = ring
    if IS_FP8:
        kc_wide = gl.allocate_shared_memory(
            mma_dtype, [BN, LORA], gl.NVMMASharedLayout.get_default_for([BN, LORA], mma_dtype)
        )
        kpe_wide = gl.allocate_shared_memory(
            mma_dtype, [BN, ROPE], gl.NVMMASharedLayout.get_default_for([BN, ROPE], mma_dtype)
        )
    fence_async_shared()
    thread_barrier()

    bt_row = BLOCK_TABLE + r.to(gl.int64) * stride_bt
    descs = (KC_DESC, KPE_DESC)
    fill_ring(descs, bt_row, start, num_tiles, ring, PAGE)

    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if IS_FP8:
        kv_scale = gl.load(KV_SCALE)
        qk_scale = qk_scale * kv_scale
    # a finite start for the running max: a row that sees no key of a tile keeps
    # alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN
    m_i = gl.full([BM], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    acc = gl.zeros([BM, LORA], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    for i in range(num_tiles):
        st = i % STAGES
        n0 = start + i * BN
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        kc = kc_ring.index(st)
        kpe = kpe_ring.index(st)
        keep = end - n0  # rows of this tile inside the split
        if IS_FP8:
            for c in gl.static_range(LORA // 128):
                widen(
                    kc.slice(c * 128, 128, dim=1),
                    kc_wide.slice(c * 128, 128, dim=1),
                    keep,
                    BN,
                    load_layout,
                )
            widen(kpe, kpe_wide, keep, BN, load_layout)
            fence_async_shared()
            thread_barrier()
            # the fp8 buffer is free again: fetch the tile STAGES ahead into it
            if i + STAGES < num_tiles:
                issue_tile(descs, bt_row, n0 + STAGES * BN, ring, st, PAGE)
            kc = kc_wide
            kpe = kpe_wide
        elif keep < BN:
            zero_tail(kc, kpe, keep, 64, load_layout)

        s_acc = warpgroup_mma(qc_smem, kc.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_acc = warpgroup_mma(qpe_smem, kpe.permute((1, 0)), s_acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))

        p, alpha, m_i, l_i = online_softmax(s_acc, n0, row_len, qk_scale, m_i, l_i)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(mma_dtype), p_layout)
        acc = warpgroup_mma(p_op, kc, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if not IS_FP8:
            # both warpgroups are done with this stage: fetch the tile STAGES ahead
            thread_barrier()
            if i + STAGES < num_tiles:
                issue_tile(descs, bt_row, n0 + STAGES * BN, ring, st, PAGE)
        else:
            thread_barrier()  # the wide buffer is rewritten by the next tile

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    has = l_i > 0
    lse = gl.where(has, m_i * 0.6931471805599453 + gl.log(gl.where(has, l_i, 1.0)), float("-inf"))
    l_o = gl.convert_layout(gl.where(has, l_i, 1.0), row_o)
    out = acc / l_o[:, None]
    if IS_FP8:
        out = out * kv_scale
    tok_o, head_o, mask_mo = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_o)
    t_o = (q_start + tok_o).to(gl.int64)
    offs_dv = gl.arange(0, LORA, layout=gl.SliceLayout(0, o_layout))
    mid = MID_O + t_o[:, None] * stride_mt + head_o[:, None] * stride_mh + split * stride_ms
    if num_tiles > 0:  # a split without keys: its lse only (as the Triton kernels)
        gl.store(mid + offs_dv[None, :], out.to(MID_O.dtype.element_ty), mask=mask_mo[:, None])
    gl.store(MID_LSE + t * stride_lt + head * stride_lh + split, lse, mask=mask_m)
