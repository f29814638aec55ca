"""MLA decode stage 1 for fp8 caches at 16 query rows (16 heads, one query token), on
`mma.sync` with the fp8 tile read from shared memory 16 bytes at a time, written in Gluon.

The packed Triton kernel runs such steps on `mma.sync` too, but feeds P @ V from an fp8
tile one byte per load: the value operand wants two consecutive keys of one column in a
register, the cache stores consecutive columns of one key, and sm_90 has no transposing
load for 8-bit data. Here each operand is loaded from a relabelled view of the tile
(`rows16_columns`): the MMAs see the latent columns in an order in which every thread's
registers are 16-byte runs of one key's row, widened to fp16 in registers (e4m3 is exact in
fp16; the per-tensor scale goes into the score scale and the output, as in the other
kernels):

- one program holds the 16 rows on four warps, the same grid as the packed kernel (head
  group, KV split, request) and the same partial results, so `mla.triton`'s merge
  finishes it;
- 32-key tiles (latent and rope parts) arrive through TMA, STAGES tiles ahead, into a ring
  of buffers with one mbarrier each;
- S = Q K^T: warp w contracts over its quarter of the columns (latent [128w, 128w + 128),
  rope [16w, 16w + 16)) for all 32 keys, a batched MMA over the warps, and the four
  partial scores are summed across the warps;
- O += P V: warp w holds a quarter of the output columns, for all keys; the output is
  written back through the relabelling's inverse (a pass through shared memory);
- the last, partial tile of a split has its rows past the split's end zeroed in shared
  memory (`common.zero_tail`), so stale (even NaN) cache rows never reach P @ V.

Needs what `gluon.lockstep` needs (a Hopper GPU, a cache TMA can read, 512 latent and 64
rope columns); like it, it does not run in Triton's CPU interpreter and is tested on the
GPU only. Only the launcher (`gluon.launch`) imports this module, at the first launch.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from atom_plugin.attention.gluon_common import thread_barrier
from atom_plugin.attention.mla.gluon.common import (
    fill_ring,
    issue_tile,
    program_request,
    query_rows,
    split_keys,
    tile_ring,
    zero_tail,
)
from atom_plugin.attention.mla.gluon.rows16_columns import view_bases


@gluon.constexpr_function
def relabelled(phys, kind):
    """The shared layout of a relabelled view (`rows16_columns.view_bases`) of a buffer
    whose own layout, as a linear layout, is `phys`."""
    return gl.SharedLinearLayout(
        offset_bases=view_bases(phys.offset_bases, kind), alignment=phys.alignment
    )


@gluon.constexpr_function
def with_warps(s2, warps):
    """The layout of the warps' partial scores [warps, rows, keys] read back so that each
    thread holds every warp's partial of the scores it holds in `s2` (a linear layout)."""
    lift = [[0] + b for b in s2.reg_bases]
    warp_regs = [[1 << i, 0, 0] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=lift + warp_regs,
        lane_bases=[[0] + b for b in s2.lane_bases],
        warp_bases=[[0, 0, 0] for _ in s2.warp_bases],
        block_bases=[],
        shape=[warps] + s2.shape,
    )


@gluon.constexpr_function
def columns_first(ll):
    """The linear layout `ll` of a [keys, cols] tile with its column register bits first:
    the same registers, ordered so that each 32-bit register loaded holds four columns
    of one key, widened two at a time from its halves."""
    return gl.DistributedLinearLayout(
        reg_bases=[b for b in ll.reg_bases if b[0] == 0] + [b for b in ll.reg_bases if b[0] != 0],
        lane_bases=ll.lane_bases,
        warp_bases=ll.warp_bases,
        block_bases=[],
        shape=ll.shape,
    )


RESCALE_LOG2 = gl.constexpr(8.0)  # how far a row's max may outgrow the running one, log2


# The warps' partial scores [4 warps, 16 rows, 32 keys] in shared memory, key bits 3 and
# 4 swizzled with row bits 0 and 1: the 8-byte stores and loads of 16 lanes (rows 0-3,
# keys 0-7) fall in 32 different banks.
PARTIALS_LAYOUT = gl.constexpr(
    gl.SharedLinearLayout(
        offset_bases=[
            [0, 0, 1],
            [0, 0, 2],
            [0, 0, 4],
            [0, 0, 8],
            [0, 0, 16],
            [0, 1, 8],
            [0, 2, 16],
            [0, 4, 0],
            [0, 8, 0],
            [1, 0, 0],
            [2, 0, 0],
        ],  # fmt: skip
    )
)


@gluon.jit
def view(buf, kind: gl.constexpr, shape: gl.constexpr):
    """`buf` seen through the relabelling `kind`, as a descriptor of `shape`."""
    phys: gl.constexpr = gl.to_linear_layout(buf.layout, buf.shape)
    return buf._reinterpret(buf.dtype, shape, relabelled(phys, kind))


@gluon.jit
def value_half(values, h: gl.constexpr, load_layout: gl.constexpr, v_op: gl.constexpr):
    """Keys [16h, 16h + 16) of the value tile (`values`: its 'value' view) as P @ V's B
    operand: loaded and widened in `load_layout` (`columns_first`), then each register
    made of two keys of one column."""
    v = values.slice(h * 16, 16, dim=0).load(load_layout).to(gl.float16)
    return gl.convert_layout(v, v_op)


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
):
    BM: gl.constexpr = 16
    BN: gl.constexpr = KC_DESC.block_type.shape[0]
    W: gl.constexpr = 4
    gl.static_assert(BLOCK_H * TOKENS == BM)
    gl.static_assert(LORA == 512)
    gl.static_assert(ROPE == 64)
    gl.static_assert(BN == 32)
    KW: gl.constexpr = LORA // W
    RW: gl.constexpr = ROPE // W
    # scores: a batched MMA, warp w contracting over its columns; output: the columns split
    s3: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8]
    )
    o2: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8]
    )
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s3, k_width=2)
    k_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s3, k_width=2)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o2, k_width=2)
    v_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=o2, k_width=2)
    s2: gl.constexpr = gl.SliceLayout(0, s3)
    row_s: gl.constexpr = gl.SliceLayout(1, s2)
    row_o: gl.constexpr = gl.SliceLayout(1, o2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])

    pid_h, split, r, q_start, q_len, first = program_request(QSL, token_chunks, TOKENS)
    if first >= q_len:
        return

    # the query rows once into shared memory (masked rows zero), then into registers
    # through the scores' relabelling
    tok_l, head_l, mask_l = query_rows(
        first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, gl.SliceLayout(1, load_layout), BM
    )
    t_l = (q_start + tok_l).to(gl.int64)[:, None]
    offs_c = gl.arange(0, LORA, layout=gl.SliceLayout(0, load_layout))
    offs_p = gl.arange(0, ROPE, layout=gl.SliceLayout(0, load_layout))
    q_c = gl.load(
        Q + t_l * stride_qt + head_l[:, None] * stride_qh + offs_c[None, :],
        mask=mask_l[:, None],
        other=0.0,
    )
    q_pe = gl.load(
        QPE + t_l * stride_pt + head_l[:, None] * stride_ph + offs_p[None, :],
        mask=mask_l[:, None],
        other=0.0,
    )
    q_c = gl.minimum(gl.maximum(q_c.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    q_pe = gl.minimum(gl.maximum(q_pe.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    qc_smem = gl.allocate_shared_memory(
        gl.float16, [BM, LORA], gl.NVMMASharedLayout.get_default_for([BM, LORA], gl.float16)
    )
    qpe_smem = gl.allocate_shared_memory(
        gl.float16, [BM, ROPE], gl.NVMMASharedLayout.get_default_for([BM, ROPE], gl.float16)
    )
    qc_smem.store(q_c)
    qpe_smem.store(q_pe)
    thread_barrier()
    # the latent contraction in two halves of 64 indices (16 bytes a key and thread each)
    q_view = view(qc_smem, "latent_rows", [W, BM, KW])
    q_lo = q_view.slice(0, KW // 2, dim=2).load(q_op)
    q_hi = q_view.slice(KW // 2, KW // 2, dim=2).load(q_op)
    q_rope = view(qpe_smem, "rope_rows", [W, BM, RW]).load(q_op)

    # this program's keys: the rows' longest visible count, cut into splits of whole tiles
    tok, head, mask_m = query_rows(first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, row_s, BM)
    t = (q_start + tok).to(gl.int64)
    row_len = gl.load(TOK_KV_LEN + t, mask=mask_m, other=0)
    start, end, num_tiles = split_keys(row_len, num_splits, split, BN)

    ring = tile_ring(KC_DESC, KPE_DESC, STAGES)
    kc_ring, kpe_ring, bars = ring
    partials = gl.allocate_shared_memory(gl.float32, [W, BM, BN], PARTIALS_LAYOUT)
    all_partials: gl.constexpr = with_warps(gl.to_linear_layout(s2, [BM, BN]), W)
    v_load: gl.constexpr = columns_first(gl.to_linear_layout(v_op, [BN // 2, LORA]))
    fence_async_shared()
    thread_barrier()

    bt_row = BLOCK_TABLE + r.to(gl.int64) * stride_bt
    descs = (KC_DESC, KPE_DESC)
    fill_ring(descs, bt_row, start, num_tiles, ring, PAGE)

    kv_scale = gl.load(KV_SCALE)
    qk_scale = sm_scale * 1.4426950408889634 * kv_scale  # exp2 domain, the cache's scale
    # a finite start for the running max: a row that sees no key of a tile keeps
    # alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN
    m_i = gl.full([BM], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    acc = gl.zeros([BM, LORA], gl.float32, layout=o2)
    s_zero = gl.zeros([W, BM, BN], gl.float32, layout=s3)
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s2))
    for i in range(num_tiles):
        st = i % STAGES
        n0 = start + i * BN
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        kc = kc_ring.index(st)
        kpe = kpe_ring.index(st)
        keep = end - n0  # rows of this tile inside the split
        if keep < BN:
            zero_tail(kc, kpe, keep, 128, load_layout)
        k_view = view(kc, "latent", [W, KW, BN])
        k_lo = k_view.slice(0, KW // 2, dim=1).load(k_op).to(gl.float16)
        s_part = mma_v2(q_lo, k_lo, s_zero)
        k_hi = k_view.slice(KW // 2, KW // 2, dim=1).load(k_op).to(gl.float16)
        s_part = mma_v2(q_hi, k_hi, s_part)
        k_rope = view(kpe, "rope", [W, RW, BN]).load(k_op).to(gl.float16)
        s_part = mma_v2(q_rope, k_rope, s_part)
        # the warps' partial scores summed through shared memory
        partials.store(s_part)
        thread_barrier()
        scores = gl.convert_layout(gl.sum(partials.load(all_partials), 0), s2, assert_trivial=True)

        valid = (n0 + offs_n)[None, :] < row_len[:, None]
        sc = gl.where(valid, scores, float("-inf"))  # scaled inside exp2's argument below
        m_tile = gl.max(sc, 1) * qk_scale
        # The running max moves (and the output rescales) only when a row's max grows
        # past it by more than RESCALE_LOG2: until then p stays below 2^RESCALE_LOG2,
        # which fp16 P and the fp32 sums hold, and a tile skips the rescale's multiplies.
        if gl.max(m_tile - m_i, 0) > RESCALE_LOG2:
            m_new = gl.maximum(m_i, m_tile)
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            m_i = m_new
        p = gl.exp2(sc * qk_scale - m_i[:, None])
        l_i = l_i + gl.sum(p, 1)
        # P @ V in two halves of 16 keys
        p_lo, p_hi = gl.split(gl.permute(gl.reshape(p.to(gl.float16), [BM, 2, BN // 2]), [0, 2, 1]))
        values = view(kc, "value", [BN, LORA])
        v_lo = value_half(values, 0, v_load, v_op)
        acc = mma_v2(gl.convert_layout(p_lo, p_op), v_lo, acc)
        v_hi = value_half(values, 1, v_load, v_op)
        # every warp has read the stage (and the partial scores): fetch the tile STAGES
        # ahead into it
        thread_barrier()
        if i + STAGES < num_tiles:
            issue_tile(descs, bt_row, n0 + STAGES * BN, ring, st, PAGE)
        acc = mma_v2(gl.convert_layout(p_hi, p_op), v_hi, acc)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    has = l_i > 0
    lse = gl.where(has, m_i * 0.6931471805599453 + gl.log(gl.where(has, l_i, 1.0)), float("-inf"))
    l_o = gl.convert_layout(gl.where(has, l_i, 1.0), row_o)
    out = acc / l_o[:, None] * kv_scale

    # the output back in cache column order: through shared memory, relabelled on the way in
    o_smem = gl.allocate_shared_memory(
        gl.float32, [BM, LORA], gl.NVMMASharedLayout.get_default_for([BM, LORA], gl.float32)
    )
    view(o_smem, "value", [BM, LORA]).store(out)
    thread_barrier()
    out = o_smem.load(store_layout)
    tok_o, head_o, mask_o = query_rows(
        first, pid_h, q_len, num_heads, BLOCK_H, TOKENS, gl.SliceLayout(1, store_layout), BM
    )
    t_o = (q_start + tok_o).to(gl.int64)
    offs_dv = gl.arange(0, LORA, layout=gl.SliceLayout(0, store_layout))
    mid = MID_O + t_o[:, None] * stride_mt + head_o[:, None] * stride_mh + split * stride_ms
    if num_tiles > 0:  # a split without keys: its lse only (as the Triton kernels)
        gl.store(mid + offs_dv[None, :], out.to(MID_O.dtype.element_ty), mask=mask_o[:, None])
    gl.store(MID_LSE + t * stride_lt + head * stride_lh + split, lse, mask=mask_m)
