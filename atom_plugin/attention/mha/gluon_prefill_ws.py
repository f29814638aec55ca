"""The warp-specialized schedule of the Gluon prefill (`gluon_prefill_kernel`'s tiles,
TMA boxes and softmax): a loader warp streams K/V tiles into the ring and each of two
consumer warpgroups owns 64 of the program's 128 rows, releasing a stage through an
mbarrier instead of a CTA-wide barrier. The warpgroups so drift apart and one's softmax
runs beside the other's matmuls (FA3's ping-pong by scheduling, not by named barriers),
and within a warpgroup S of tile i runs beside P V of tile i - 1. Consumer 0 zeroes the
last tile's V rows past seq_len and tells consumer 1 through one more mbarrier.
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

from atom_plugin.attention.mha.gluon_prefill_kernel import (
    _issue,
    _rescale,
    _scores,
    _softmax,
    _zero_tail,
    thread_barrier,
)


@gluon.jit
def _loader(W: gl.constexpr, ptrs, smem, bars, work, descs, GROUP: gl.constexpr,
             BLOCK_G: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             PAGE: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """The TMA warp: tile t into stage t % STAGES once both warpgroups released it."""
    k_ring, v_ring = smem[1], smem[2]
    k_full, v_full, empty = bars[0], bars[1], bars[2]
    seq_len, num_tiles, kvh, page_rows = work[3], work[4], work[6], work[9]
    k_desc, v_desc, table = descs
    for t in range(num_tiles):
        st = t % STAGES
        mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
        _issue(k_desc, v_desc, table, page_rows, seq_len, kvh, t * BLOCK_N,
               k_ring, v_ring, k_full, v_full, st, BLOCK_N, PAGE, HEAD)  # fmt: skip


@gluon.jit
def _consumer(W: gl.constexpr, ptrs, smem, bars, work, descs, GROUP: gl.constexpr,
               BLOCK_G: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               PAGE: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """Rows [64 W, 64 W + 64) of the program: the online softmax over every tile."""
    Out, stride_ot, stride_oh = ptrs
    q_smem, k_ring, v_ring = smem
    k_full, v_full, empty, tail = bars
    t0, q_len, q_first, seq_len, num_tiles, unmasked, kvh, qk_scale, ctx, _ = work
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_smem.dtype
    q_w = q_smem.slice(W * 64, 64, dim=0)

    rs = W * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    qpos = ctx + q_first + rs // BLOCK_G
    m_i = gl.full([64], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD], gl.float32, layout=o_layout)
    if num_tiles > 0:
        mbarrier.wait(k_full.index(0), 0)
        sc = _scores(q_w, k_ring.index(0), 64, BLOCK_N, s_layout)
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
            mbarrier.wait(k_full.index(st), (i // STAGES) & 1)
            sc = _scores(q_w, k_ring.index(st), 64, BLOCK_N, s_layout)
            mbarrier.wait(v_full.index(prev), ((i - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
            if i < unmasked:
                p, m_i, l_i, alpha = _softmax(sc, i * BLOCK_N, qpos, seq_len, qk_scale, m_i,
                                              l_i, False, BLOCK_N, s_layout)  # fmt: skip
            else:
                p, m_i, l_i, alpha = _softmax(sc, i * BLOCK_N, qpos, seq_len, qk_scale, m_i,
                                              l_i, True, BLOCK_N, s_layout)  # fmt: skip
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = _rescale(acc, alpha, o_layout)
            thread_barrier()  # the warpgroup's four warps are done with tile i - 1
            mbarrier.arrive(empty.index(prev), count=1)
        last = num_tiles - 1
        st = last % STAGES
        mbarrier.wait(v_full.index(st), (last // STAGES) & 1)
        if (last + 1) * BLOCK_N > seq_len:
            if W == 0:
                _zero_tail(v_ring.index(st), seq_len - last * BLOCK_N, BLOCK_N, io_layout)
                mbarrier.arrive(tail.index(0), count=1)
            else:
                mbarrier.wait(tail.index(0), 0)
        acc = warpgroup_mma(p_op, v_ring.index(st), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    l_o = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(1, o_layout))
    out = gl.convert_layout((acc / l_o[:, None]).to(Out.dtype.element_ty), io_layout)
    r = W * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, io_layout))
    qi = q_first + r // BLOCK_G
    g = r % BLOCK_G
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, io_layout))
    tok = (t0 + qi).to(gl.int64)
    head = kvh * GROUP + g
    gl.store(
        Out + tok[:, None] * stride_ot + (head * stride_oh)[:, None] + d[None, :],
        out,
        mask=((qi < q_len) & (g < GROUP))[:, None],
    )


@gluon.jit
def prefill_ws_kernel(
    Q, K_DESC, V_DESC, Out, block_table, seq_lens, query_start_loc, qk_scale, first_req,
    page_rows, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """`gluon_prefill_kernel.prefill_kernel`'s grid and arguments, on 4 + 4 + 1 warps."""
    BM: gl.constexpr = 128
    TOKENS: gl.constexpr = BM // BLOCK_G
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
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

    r = gl.arange(0, BM, layout=gl.SliceLayout(1, io_layout))
    qi = q_first + r // BLOCK_G
    g = r % BLOCK_G
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, io_layout))
    tok = (t0 + qi).to(gl.int64)
    q = gl.load(
        Q + tok[:, None] * stride_qt + ((kvh * GROUP + g) * stride_qh)[:, None] + d[None, :],
        mask=((qi < q_len) & (g < GROUP))[:, None],
        other=0.0,
    )
    q_smem = gl.allocate_shared_memory(
        dtype, [BM, HEAD], gl.NVMMASharedLayout.get_default_for([BM, HEAD], dtype)
    )
    q_smem.store(q)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], tile_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], tile_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    tail = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(tail.index(0), count=1)
    fence_async_shared()
    thread_barrier()

    ctx = seq_len - q_len
    hi = gl.minimum(ctx + gl.minimum(q_first + TOKENS, q_len), seq_len)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    # keys < the first row's position + 1 are visible to every row of the program
    unmasked = gl.minimum((ctx + q_first + 1) // BLOCK_N, num_tiles)
    table = block_table + req.to(gl.int64) * stride_bt
    # Gluon 3.6's partitions share one signature: tuples, the first argument the role
    ptrs = (Out, stride_ot, stride_oh)
    smem = (q_smem, k_ring, v_ring)
    bars = (k_full, v_full, empty, tail)
    work = (t0, q_len, q_first, seq_len, num_tiles, unmasked, kvh, qk_scale, ctx, page_rows)
    descs = (K_DESC, V_DESC, table)
    # Gluon 3.6's partitions share one signature: the constants must be arguments of their own
    gl.warp_specialize(
        [
            (
                _consumer,
                (0, ptrs, smem, bars, work, descs, GROUP, BLOCK_G, BLOCK_N, STAGES, PAGE, HEAD),
            ),
            (
                _consumer,
                (1, ptrs, smem, bars, work, descs, GROUP, BLOCK_G, BLOCK_N, STAGES, PAGE, HEAD),
            ),
            (
                _loader,
                (2, ptrs, smem, bars, work, descs, GROUP, BLOCK_G, BLOCK_N, STAGES, PAGE, HEAD),
            ),
        ],
        [4, 1],
        [240, 24],
    )
