"""Gluon pieces the MLA decode kernels share (`lockstep`, `alternate`, `scorer`, `rows16`):
which request, query rows and keys a program holds, a query part in shared memory
(`query_smem`), one tile's online softmax (`online_softmax`), the ring of TMA tile buffers
(`tile_ring`, `fill_ring`, `issue_tile`; lockstep and rows16), the warp-specialized
kernels' loader partition and what it fills (`chunk_loader`, `chunk_ring`,
`zero_chunked_tail`; alternate and scorer), the pass that widens a tile and zeroes its
rows past a split's end (`widen`, `zero_tail`), and the cache's TMA descriptors (host
side).

Imports Gluon, which exists only in newer Tritons: only the kernels and their launcher
(`gluon_launch`) import this module, at the first launch.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from atom_plugin.attention.gluon_common import thread_barrier, tma_descriptor
from atom_plugin.attention.kept import cache_key
from atom_plugin.attention.mla.cache_view import KEPT_PER_CACHE, cache_row_parts
from atom_plugin.attention.mla.gluon.shapes import BLOCK_N


@gluon.jit
def program_request(QSL, token_chunks, TOKENS: gl.constexpr):
    """This program's head group, KV split and request (grid: head groups, splits,
    requests x token chunks), the request's first query token and its query count,
    and the first of the request's tokens the program holds."""
    pid_h = gl.program_id(0)
    split = gl.program_id(1)
    pid_r = gl.program_id(2)
    r = pid_r // token_chunks
    q_start = gl.load(QSL + r)
    q_len = gl.load(QSL + r + 1) - q_start
    return pid_h, split, r, q_start, q_len, (pid_r % token_chunks) * TOKENS


@gluon.jit
def query_rows(
    first,
    pid_h,
    q_len,
    num_heads,
    BLOCK_H: gl.constexpr,
    TOKENS: gl.constexpr,
    layout,
    ROWS: gl.constexpr = 64,
):
    """A program's ROWS query rows (TOKENS tokens of a request from `first` times
    BLOCK_H heads of head group `pid_h`) in `layout`: each row's token, head and
    whether it is a real one."""
    offs = gl.arange(0, ROWS, layout=layout)
    tok = first + offs // BLOCK_H
    head = pid_h * BLOCK_H + offs % BLOCK_H
    return tok, head, (tok < q_len) & (head < num_heads) & (offs < TOKENS * BLOCK_H)


@gluon.jit
def query_smem(PTR, t, head, mask_m, stride_t, stride_h, WIDTH: gl.constexpr, layout: gl.constexpr):
    """Columns [0, WIDTH) of the query rows (token `t`, `head`; rows outside `mask_m`
    zero) from PTR into NVMMA-swizzled shared memory, as the score MMAs read them."""
    offs = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    rows = gl.load(
        PTR + t[:, None] * stride_t + head[:, None] * stride_h + offs[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )
    dtype: gl.constexpr = PTR.dtype.element_ty
    ROWS: gl.constexpr = t.shape[0]
    buf = gl.allocate_shared_memory(
        dtype, [ROWS, WIDTH], gl.NVMMASharedLayout.get_default_for([ROWS, WIDTH], dtype)
    )
    buf.store(rows)
    return buf


@gluon.jit
def online_softmax(s_acc, n0, row_len, qk_scale, m_i, l_i):
    """One tile's step of the online softmax over scores `s_acc` of keys from `n0` (in
    the exp2 domain after `qk_scale`; keys at or past a row's visible count masked): P,
    the factor that rescales what came before, the new running max and sum."""
    BN: gl.constexpr = s_acc.shape[1]
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_acc.type.layout))
    valid = (n0 + offs_n)[None, :] < row_len[:, None]
    sc = gl.where(valid, s_acc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def split_keys(row_len, num_splits, split, BN: gl.constexpr):
    """Split `split`'s keys [start, end) of the rows' longest visible count, cut in
    splits of whole BN-key tiles, and its tile count."""
    kv_len = gl.max(row_len, 0)
    per_split = gl.cdiv(gl.cdiv(kv_len, num_splits), BN) * BN
    start = split * per_split
    end = gl.minimum(start + per_split, kv_len)
    return start, end, gl.cdiv(gl.maximum(end - start, 0), BN)


@gluon.jit
def widen(src, dst, keep, ROWS: gl.constexpr, layout: gl.constexpr):
    """dst = src widened to dst's dtype (src itself may be dst), rows at or past
    `keep` zeroed."""
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    x = src.load(layout)
    x = gl.where((rows < keep)[:, None], x.to(dst.dtype), 0.0)
    dst.store(x)


@gluon.jit
def zero_tail(kc, kpe, keep, CHUNK: gl.constexpr, layout: gl.constexpr):
    """A tile's latent (`kc`, CHUNK columns at a time) and rope (`kpe`) buffers with their
    rows at or past `keep` zeroed in place, so stale (even NaN) cache rows past a split's
    end never reach P @ V; fenced for the TMA that refills the buffers and the other
    warps' reads."""
    ROWS: gl.constexpr = kc.shape[0]
    for c in gl.static_range(kc.shape[1] // CHUNK):
        part = kc.slice(c * CHUNK, CHUNK, dim=1)
        widen(part, part, keep, ROWS, layout)
    widen(kpe, kpe, keep, ROWS, layout)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def issue_tile(descs, bt_row, n0, ring, st, PAGE: gl.constexpr):
    """The tile at key n0 into stage `st` of `ring` (buffers, barriers), through TMA."""
    kc_desc, kpe_desc = descs
    kc_ring, kpe_ring, bars = ring
    bar = bars.index(st)
    page = gl.load(bt_row + n0 // PAGE)
    row0 = page * PAGE + n0 % PAGE
    mbarrier.expect(bar, kc_desc.block_type.nbytes + kpe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kc_desc, [row0, 0], bar, kc_ring.index(st))
    tma.async_copy_global_to_shared(kpe_desc, [row0, 0], bar, kpe_ring.index(st))


@gluon.jit
def tile_ring(KC_DESC, KPE_DESC, STAGES: gl.constexpr):
    """STAGES buffers for a key tile's latent and rope parts in the descriptors' box
    layouts, with one mbarrier each, initialized: the ring (buffers, barriers) that
    `issue_tile` fills."""
    BN: gl.constexpr = KC_DESC.block_type.shape[0]
    LORA: gl.constexpr = KC_DESC.block_type.shape[1]
    ROPE: gl.constexpr = KPE_DESC.block_type.shape[1]
    kc_ring = gl.allocate_shared_memory(KC_DESC.dtype, [STAGES, BN, LORA], KC_DESC.layout)
    kpe_ring = gl.allocate_shared_memory(KPE_DESC.dtype, [STAGES, BN, ROPE], KPE_DESC.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    return kc_ring, kpe_ring, bars


@gluon.jit
def fill_ring(descs, bt_row, start, num_tiles, ring, PAGE: gl.constexpr):
    """The split's first tiles from key `start`, one into each stage of `ring`."""
    BN: gl.constexpr = descs[0].block_type.shape[0]
    STAGES: gl.constexpr = ring[2].shape[0]
    for s in gl.static_range(STAGES):
        if s < num_tiles:
            issue_tile(descs, bt_row, start + s * BN, ring, s, PAGE)


@gluon.jit
def chunk_ring(KPE_DESC, dtype: gl.constexpr, LORA: gl.constexpr):
    """What `chunk_loader` fills: two 64-key stages of a tile's latent and rope parts, a
    barrier per 64-column chunk and stage that its TMA copy completes (`full`, nine a
    stage) and one per stage that both warpgroups arrive at once done with it (`empty`),
    initialized; the caller fences them with its other barriers."""
    ROPE: gl.constexpr = KPE_DESC.block_type.shape[1]
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, LORA], dtype)
    kc_ring = gl.allocate_shared_memory(dtype, [2, 64, LORA], chunk_layout)
    kpe_ring = gl.allocate_shared_memory(dtype, [2, 64, ROPE], KPE_DESC.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    full = gl.allocate_shared_memory(gl.int64, [18, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(18):
        mbarrier.init(full.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(empty.index(i), count=2)
    return kc_ring, kpe_ring, full, empty


@gluon.jit
def zero_chunked_tail(kc, kpe, full, st, ph, keep, layout: gl.constexpr):
    """`zero_tail` for a tile of `chunk_ring`'s stage `st` (phase `ph`), once its nine
    chunks have landed."""
    for c in gl.static_range(9):
        mbarrier.wait(full.index(st * 9 + c), ph)
    zero_tail(kc, kpe, keep, 64, layout)


@gluon.jit
def chunk_loader(
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
    """The loader partition of the warp-specialized kernels (`alternate`, `scorer`): one
    warp fetching each tile through TMA in nine 64-column chunks, a barrier each, into two
    stages, a stage refilled once both warpgroups released it. It takes the partitions'
    one signature and reads the rings (smem[1], smem[2]), their barriers (bars[0]: full,
    bars[1]: empty) and the split's first key and tile count (work[5], work[7])."""
    kc_ring, kpe_ring = smem[1], smem[2]
    full, empty = bars[0], bars[1]
    start, num_tiles = work[5], work[7]
    kc_desc, kpe_desc, bt_row = descs
    nbytes: gl.constexpr = kc_desc.block_type.nbytes
    for t in range(num_tiles):
        s = t % 2
        mbarrier.wait(empty.index(s), ((t // 2) & 1) ^ 1)
        n0 = start + t * 64
        page = gl.load(bt_row + n0 // PAGE)
        row0 = page * PAGE + n0 % PAGE
        for c in gl.static_range(8):
            bar = full.index(s * 9 + c)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(
                kc_desc, [row0, c * 64], bar, kc_ring.index(s).slice(c * 64, 64, dim=1)
            )
        bar = full.index(s * 9 + 8)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(kpe_desc, [row0, 0], bar, kpe_ring.index(s))


def cache_descriptors(
    kv_cache: torch.Tensor, lora: int, box_cols: int | None = None, box_rows: int = BLOCK_N
) -> list:
    """Gluon TMA descriptors of the cache's latent and rope columns
    (`mla.cache_view.cache_row_parts`) in boxes of `box_rows` rows by `box_cols` columns
    (None: the part's width), made at the first launch over the cache and kept
    (`attention.kept`)."""

    def make() -> list:
        return [
            tma_descriptor(part, shape, strides, [box_rows, box_cols or shape[1]])
            for part, shape, strides in cache_row_parts(kv_cache, lora)
        ]

    key = ("gluon", cache_key(kv_cache), lora, box_cols, box_rows)
    return KEPT_PER_CACHE.get(key, make)
