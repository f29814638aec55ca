"""MHA causal prefill on Hopper in Gluon: a loader warp and two or three ping-ponged
warpgroups.

A work item is 64 * NWG query rows of one query block, request and kv head (row r: token
r // GROUP, head r % GROUP, as `triton_prefill`), warpgroup w the rows 64w .. 64w + 63: two
warpgroups at head size 128, three at 64, whose products are half as long, so a third
warpgroup's softmax has to hide behind them. Per tile of BLOCK_N keys:

- the loader warp brings K and V into rings of stages through TMA, a box per cache
  page (or per BLOCK_N rows of a larger page) and 64 columns. K and V stages are
  released apart: a K tile once every warpgroup's scores of it are done, a V tile once
  their products with it are. The product of tile j runs in iteration j + 1, so a shared
  release would hold tile j + STAGES's keys back until then, when they are already due;
  released apart, the loader issues tile t's keys before tile t - 1's values, about an
  iteration ahead of each;
- each warpgroup issues the scores of tile j and the product of tile j - 1's
  probabilities with its V, then runs tile j's softmax while the product runs (the
  softmax of one tile overlaps the tensor cores' work on the previous one);
- the warpgroups take turns, round robin, to issue their matrix products (an mbarrier
  each), so one's softmax runs while the others' products occupy the tensor cores.

Programs are persistent, one an SM: program p starts with item p, and its loader draws
each next item from an atomic counter (`_next_item`), skips items without key tiles
(`_with_keys`) and hands the rest to the warpgroups through a two-slot ring in shared
memory (`_publish`, `_take`). The loader runs the K/V ring on across items, so an item's
first tiles load while the warpgroups finish the last one and a short item does not pay
the pipeline's fill and drain. The launcher picks the items' order
(`gluon_prefill_launch.prefill_grid`); `_item` reads it from `kv_major`.

Only `gluon_prefill_launch` imports this module, at the first launch: Gluon exists only
in newer Tritons.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from atom_plugin.attention.gluon_common import thread_barrier

COLS = gl.constexpr(64)  # columns of a TMA box: 128 bytes of 16-bit values, one swizzle row


@gluon.jit
def loader(
    W: gl.constexpr,
    ptrs,
    smem,
    bars,
    sched,
    descs,
    GROUP: gl.constexpr,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE: gl.constexpr,
    BOX: gl.constexpr,
    NWG: gl.constexpr,
):
    """The TMA warp, over the program's work items: tile t's K boxes, then tile t - 1's V
    boxes; the ring runs on across items, so the next item's first keys load while the
    warpgroups finish the last (the partitions share one signature; this one reads few of
    them)."""
    k_ring, v_ring = smem[1], smem[2]
    k_full, v_full, k_empty, v_empty = bars[0], bars[1], bars[2], bars[3]
    k_desc, v_desc, block_table, stride_bt, layout_rows = descs
    rows_per_block, rows_per_head, cols_per_head = layout_rows
    BLOCK_Q: gl.constexpr = 64 * NWG // GROUP
    NB: gl.constexpr = BLOCK_N // BOX
    NBV: gl.constexpr = 2 if NB < 2 else NB
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    bi = gl.arange(0, NBV, layout=vec)
    nbytes: gl.constexpr = NB * (D // COLS) * k_desc.block_type.nbytes
    values = (v_desc, v_ring, v_full, v_empty)
    items, item_full, item_empty = bars[5], bars[6], bars[7]
    num_items, counter = sched[0], sched[8]
    programs = gl.num_programs(0)
    idx = gl.program_id(0)
    n = 0  # items this program has taken
    base = 0  # tiles this program has loaded before the item: the ring's position
    idx = _with_keys(idx, sched, counter, programs, BLOCK_Q, BLOCK_N)
    _publish(items, item_full, item_empty, n, idx)
    while idx < num_items:
        req, kvh, t0, q_len, seq_len, q_first, num_tiles = _item(idx, sched, BLOCK_Q, BLOCK_N)
        bt_row = block_table + req.to(gl.int64) * stride_bt
        head_row = kvh * rows_per_head
        col0 = kvh * cols_per_head
        prev_rows = gl.zeros([NBV], gl.int32, layout=vec)
        for t in range(num_tiles):
            # the tile's pages are read before the wait, so the load overlaps it
            key = t * BLOCK_N + bi * BOX
            page = gl.load(bt_row + key // PAGE, mask=(bi < NB) & (key < seq_len), other=0)
            rows = page * rows_per_block + head_row + key % PAGE
            g = base + t
            s = g % STAGES
            mbarrier.wait(k_empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(k_full.index(s), nbytes)
            _copy_tile(k_desc, k_ring.index(s), k_full.index(s), rows, bi, col0, NB, BOX, D)
            if t > 0:
                _copy_values(values, g - 1, prev_rows, bi, col0, nbytes, NB, BOX, D, STAGES)
            prev_rows = rows
        last = base + num_tiles - 1
        _copy_values(values, last, prev_rows, bi, col0, nbytes, NB, BOX, D, STAGES)
        # the next item is drawn with the ring full of this one's last tiles, whose products
        # the warpgroups have yet to run: the draw's round trip stays off their path
        idx = _next_item(counter, programs, num_items)
        idx = _with_keys(idx, sched, counter, programs, BLOCK_Q, BLOCK_N)
        base += num_tiles
        n += 1
        _publish(items, item_full, item_empty, n, idx)


@gluon.jit
def _next_item(counter, programs, num_items):
    """The program's next item: programs + the counter's next ticket. Items 0 .. programs - 1
    are the programs' first, and each item a program meets (run, or skipped for want of
    keys) is followed by one draw, so the launch draws tickets 0 .. num_items - 1, the
    last of them after every other draw; the program that draws it sets the counter back
    to zero for the next launch (and its CUDA graph replays)."""
    ticket = gl.atomic_add(counter, 1)
    if ticket == num_items - 1:
        gl.store(counter, 0)
    return ticket + programs


@gluon.jit
def _with_keys(idx, sched, counter, programs, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr):
    """`idx`, or the first item drawn after it that has key tiles. Items of query blocks
    past a request's rows (a shorter request than the batch's longest) have none: their
    tickets are drawn here and never handed to the warpgroups."""
    num_items = sched[0]
    empty = idx < num_items
    if empty:
        empty = _item(idx, sched, BLOCK_Q, BLOCK_N)[6] == 0
    while empty:
        idx = _next_item(counter, programs, num_items)
        empty = idx < num_items
        if empty:
            empty = _item(idx, sched, BLOCK_Q, BLOCK_N)[6] == 0
    return idx


@gluon.jit
def _publish(items, item_full, item_empty, n, idx):
    """Hand the warpgroups the program's item n (`idx`; past the last item: stop) through
    slot n % 2 of `items`."""
    slot = n % 2
    mbarrier.wait(item_empty.index(slot), ((n // 2) & 1) ^ 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], idx, gl.int32, layout=one))
    thread_barrier()
    mbarrier.arrive(item_full.index(slot), count=1)


@gluon.jit
def _take(items, item_full, item_empty, n):
    """The program's item n, as the loader published it; the slot is released at once."""
    slot = n % 2
    mbarrier.wait(item_full.index(slot), (n // 2) & 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    idx = gl.max(items.index(slot).load(one), axis=0)
    _arrive_all(item_empty.index(slot))
    return idx


@gluon.jit
def _item(idx, sched, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work item `idx` of the launch: its request, kv head, first token, query and sequence
    lengths, first query row and key tiles (0 where the block lies past the request's
    query). Query blocks go longest causal rows first, kv-head-major or query-block-major
    as `kv_major` says."""
    nq, hkv, kv_major, first_req, query_start_loc, seq_lens = (
        sched[1],
        sched[2],
        sched[3],
        sched[4],
        sched[5],
        sched[6],
    )
    per_req = nq * hkv
    within = idx % per_req
    if kv_major:
        kvh = within % hkv
        qblock = nq - 1 - within // hkv
    else:
        kvh = within // nq
        qblock = nq - 1 - within % nq
    req = first_req + idx // per_req
    t0 = gl.load(query_start_loc + req)
    q_len = gl.load(query_start_loc + req + 1) - t0
    seq_len = gl.load(seq_lens + req)
    q_first = qblock * BLOCK_Q
    hi = seq_len - q_len + gl.minimum(q_first + BLOCK_Q, q_len)  # keys the last row sees
    num_tiles = gl.cdiv(hi, BLOCK_N) * (q_first < q_len).to(gl.int32)
    return req, kvh, t0, q_len, seq_len, q_first, num_tiles


@gluon.jit
def _copy_values(
    values,
    t,
    rows,
    bi,
    col0,
    nbytes: gl.constexpr,
    NB: gl.constexpr,
    BOX: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Tile t's V boxes into its stage of the ring, once the stage's values are released
    (`values`: the V descriptor, ring, full and empty barriers)."""
    v_desc, v_ring, v_full, v_empty = values
    s = t % STAGES
    mbarrier.wait(v_empty.index(s), ((t // STAGES) & 1) ^ 1)
    mbarrier.expect(v_full.index(s), nbytes)
    _copy_tile(v_desc, v_ring.index(s), v_full.index(s), rows, bi, col0, NB, BOX, D)


@gluon.jit
def _copy_tile(
    desc, dst, bar, rows, bi, col0, NB: gl.constexpr, BOX: gl.constexpr, D: gl.constexpr
):
    """A tile's TMA boxes into `dst`: box i holds BOX rows from row `rows[i]` (the element of
    `rows` where `bi == i`), in 64-column pieces from column col0; each lands on `bar`."""
    for i in gl.static_range(NB):
        row = gl.sum(gl.where(bi == i, rows, 0), axis=0)
        for c in gl.static_range(D // COLS):
            box = dst.slice(i * BOX, BOX, dim=0).slice(c * COLS, COLS, dim=1)
            tma.async_copy_global_to_shared(desc, [row, col0 + c * COLS], bar, box)


@gluon.jit
def _scores(s_acc, n0, qpos, p_first, scale, offs_n, BLOCK_N: gl.constexpr):
    """The tile's raw scores, keys past each row's position at -inf (a tile wholly at or
    below the warpgroup's first position needs no mask)."""
    if n0 + BLOCK_N > p_first + 1:
        keep = (n0 + offs_n)[None, :] <= qpos[:, None]
        s_acc = gl.where(keep, s_acc, float("-inf"))
    return s_acc


@gluon.jit
def consumer(
    W: gl.constexpr,
    ptrs,
    smem,
    bars,
    sched,
    descs,
    GROUP: gl.constexpr,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE: gl.constexpr,
    BOX: gl.constexpr,
    NWG: gl.constexpr,
):
    """Warpgroup W, over the program's work items: rows 64W .. 64W + 63 of the item's
    query block over every tile, then their output."""
    Q, Out, stride_qt, stride_qh, stride_ot, stride_oh = ptrs
    q_smem, k_ring, v_ring = smem
    k_full, v_full, k_empty, v_empty, turn = bars[0], bars[1], bars[2], bars[3], bars[4]
    scale = sched[7]
    BLOCK_Q: gl.constexpr = 64 * NWG // GROUP
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = Out.dtype.element_ty

    q_w = q_smem.index(W)
    r = W * 64 + gl.arange(0, 64, layout=row_s)
    r_q = W * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    d_q = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    r_o = W * 64 + gl.arange(0, 64, layout=row_o)
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    items, item_full, item_empty = bars[5], bars[6], bars[7]
    n = 0  # items this program has taken
    base = 0  # tiles this program has consumed before the item: the ring's position
    idx = _take(items, item_full, item_empty, n)
    while idx < sched[0]:
        req, kvh, t0, q_len, seq_len, q_first, num_tiles = _item(idx, sched, BLOCK_Q, BLOCK_N)
        # the warpgroup's query rows (the last item's products are done with q_w)
        tok_q = q_first + r_q // GROUP
        head_q = kvh * GROUP + r_q % GROUP
        q = gl.load(
            Q
            + (t0 + tok_q).to(gl.int64)[:, None] * stride_qt
            + head_q[:, None] * stride_qh
            + d_q[None, :],
            mask=(tok_q < q_len)[:, None],
            other=0.0,
        )
        q_w.store(q)
        fence_async_shared()
        thread_barrier()

        ctx = seq_len - q_len
        qpos = ctx + q_first + r // GROUP
        p_first = ctx + q_first + W * (64 // GROUP)  # the warpgroup's first position
        acc = gl.zeros([64, D], gl.float32, layout=o_layout)

        # tile 0: its scores and softmax; its product waits for tile 1's turn
        s0 = base % STAGES
        mbarrier.wait(k_full.index(s0), (base // STAGES) & 1)
        mbarrier.wait(turn.index(W), base & 1)
        s_acc = _qk(q_w, k_ring.index(s0), s_zero, D)
        _arrive_all(turn.index((W + 1) % NWG))
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))
        _arrive_all(k_empty.index(s0))
        sc = _scores(s_acc, 0, qpos, p_first, scale, offs_n, BLOCK_N)
        m_i = gl.max(sc, 1) * scale
        m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(sc * scale - m_safe[:, None])
        l_i = gl.sum(p, 1)
        p16 = gl.convert_layout(p.to(dtype), p_op)

        for j in range(1, num_tiles):
            g = base + j
            s = g % STAGES
            prev = (g - 1) % STAGES
            mbarrier.wait(k_full.index(s), (g // STAGES) & 1)
            mbarrier.wait(turn.index(W), g & 1)
            s_acc = _qk(q_w, k_ring.index(s), s_zero, D)
            mbarrier.wait(v_full.index(prev), ((g - 1) // STAGES) & 1)
            acc = warpgroup_mma(p16, v_ring.index(prev), acc, is_async=True)
            _arrive_all(turn.index((W + 1) % NWG))
            s_acc = warpgroup_mma_wait(num_outstanding=1, deps=(s_acc,))
            _arrive_all(k_empty.index(s))
            sc = _scores(s_acc, j * BLOCK_N, qpos, p_first, scale, offs_n, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(sc, 1) * scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc * scale - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _arrive_all(v_empty.index(prev))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p16 = gl.convert_layout(p.to(dtype), p_op)

        g_last = base + num_tiles - 1
        last = g_last % STAGES
        mbarrier.wait(v_full.index(last), (g_last // STAGES) & 1)
        acc = warpgroup_mma(p16, v_ring.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _arrive_all(v_empty.index(last))

        l_o = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), row_o)
        out = acc / l_o[:, None]
        tok = q_first + r_o // GROUP
        head = kvh * GROUP + r_o % GROUP
        dst = Out + (t0 + tok).to(gl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        gl.store(dst + d_o[None, :], out.to(dtype), mask=(tok < q_len)[:, None])
        base += num_tiles
        n += 1
        idx = _take(items, item_full, item_empty, n)


@gluon.jit
def _arrive_all(bar):
    """Arrive on `bar` once every warp of the warpgroup has got here (one thread arrives)."""
    thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _qk(q_w, k_tile, s_zero, D: gl.constexpr):
    """Issue q_w @ k_tile^T in 64-column chunks of the head (asynchronous)."""
    s_acc = s_zero
    for c in gl.static_range(D // COLS):
        s_acc = warpgroup_mma(
            q_w.slice(c * COLS, COLS, dim=1),
            k_tile.slice(c * COLS, COLS, dim=1).permute((1, 0)),
            s_acc,
            use_acc=c > 0,
            is_async=True,
        )
    return s_acc


@gluon.jit(do_not_specialize=["first_req", "kv_major", "num_items", "nq"])
def prefill_kernel(
    Q,
    Out,
    K_DESC,
    V_DESC,
    block_table,
    seq_lens,
    query_start_loc,
    qk_scale,
    first_req,
    counter,
    num_items,
    nq,
    hkv,
    kv_major,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    rows_per_block,
    rows_per_head,
    cols_per_head,
    GROUP: gl.constexpr,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE: gl.constexpr,
    BOX: gl.constexpr,
    NWG: gl.constexpr,
):
    """A persistent program over work items (query block, kv head, request) of
    `num_items`: its own index first, then those drawn from `counter`, in the order
    `_item` reads."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(  # a 64-row slab a warpgroup
        dtype, [NWG, 64, D], gl.NVMMASharedLayout.get_default_for([64, D], dtype)
    )
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [NWG, 1], bar_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NWG)
        mbarrier.init(v_empty.index(i), count=NWG)
    for i in gl.static_range(NWG):
        mbarrier.init(turn.index(i), count=1)
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(item_full.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=NWG)
    fence_async_shared()
    thread_barrier()
    mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 issues first

    # Every partition takes the same arguments (Gluon 3.6's workers share one
    # signature), grouped in tuples; the first names the partition's role.
    ptrs = (Q, Out, stride_qt, stride_qh, stride_ot, stride_oh)
    smem = (q_smem, k_ring, v_ring)
    bars = (k_full, v_full, k_empty, v_empty, turn, items, item_full, item_empty)
    sched = (num_items, nq, hkv, kv_major, first_req, query_start_loc, seq_lens, qk_scale, counter)
    layout_rows = (rows_per_block, rows_per_head, cols_per_head)
    descs = (K_DESC, V_DESC, block_table, stride_bt, layout_rows)
    if NWG == 2:
        gl.warp_specialize(
            [
                (
                    consumer,
                    (0, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
                (
                    consumer,
                    (1, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
                (
                    loader,
                    (2, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.warp_specialize(
            [
                (
                    consumer,
                    (0, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
                (
                    consumer,
                    (1, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
                (
                    consumer,
                    (2, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
                (
                    loader,
                    (3, ptrs, smem, bars, sched, descs, GROUP, D, BLOCK_N, STAGES, PAGE, BOX, NWG),
                ),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )
