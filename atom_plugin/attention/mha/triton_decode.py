"""Triton paged decode: split-KV partial attention, then a reduction over the splits.

One program of the split kernel handles (request, kv head, split): all query
heads of the kv head's group share each K/V tile, so KV is read once. A request's kv
heads are adjacent in launch order: the paged cache stores a token's heads side by
side, so programs that run together read neighbouring bytes (DRAM rows) rather than
one head's slice of many blocks. The context is cut into `num_splits` chunks; the
step's plan chooses the count so that its waves of programs keep every SM busy
(`triton_common.choose_num_splits`). Chunk bounds are computed on the device from each
request's seq_len, so any split count is correct for any context (a CUDA graph may
bake the count in).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.triton_common import (
    DECODE_PROGRAMS_PER_SM,
    LOG2E,
    MAX_SPLITS,
    check_config_keys,
    dot_flags,
    fold_sinks,
    mm,
    next_power_of_2,
    occupancy,
)

# Programs of the split kernel an SM of each CUDA device holds, read off the first split
# launch there with the production config: registers and shared memory follow the Triton
# version (on the H200, 3 with Triton 3.6 and 5 with 3.7.1), and the step plan's split
# count is chosen for waves of them.
_programs_per_sm: dict[int, int] = {}

# what a config may hold; `table_blocks`: one block-table read per cache block (the
# production config's up to head size 128)
CONFIG_KEYS = ("BLOCK_N", "num_warps", "num_stages", "table_blocks")


@triton.jit
def kv_blocks(table, n, seq_len, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache block (int64) of keys n .. n + BLOCK_N - 1 (n a multiple of KV_BLOCK, BLOCK_N
    of KV_BLOCK): one table load per cache block, broadcast over its rows, instead of one
    load per key; blocks from seq_len on read 0."""
    NB: tl.constexpr = BLOCK_N // KV_BLOCK
    bi = n // KV_BLOCK + tl.arange(0, NB)
    blk = tl.load(table + bi, mask=bi * KV_BLOCK < seq_len, other=0)
    blk = tl.broadcast_to(blk.to(tl.int64)[:, None], (NB, KV_BLOCK))
    return tl.reshape(blk, (BLOCK_N,))


# Values that change from step to step are not specialized on: each new specialization
# is a JIT compile inside a serving step (vLLM's warm-up and graph capture compile the
# kernels once per constexpr set).
@triton.jit(do_not_specialize=["window", "num_splits"])
def _decode_split_kernel(
    Q,
    K,
    V,
    block_table,
    seq_lens,
    query_start_loc,
    k_scale,
    v_scale,
    O_part,
    L_part,
    sinks,
    Out,
    qk_scale,
    window,
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
    num_q_heads,
    num_splits,
    head_size,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    TABLE_BLOCKS: tl.constexpr,
):
    # a request's kv heads are adjacent in launch order (see the module docstring)
    req = tl.program_id(0) // KV_HEADS
    kvh = tl.program_id(0) % KV_HEADS
    split = tl.program_id(1)
    # seq_len is loaded beside the query bounds, ahead of the branch on them, so the
    # three loads are in flight together
    t = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - t
    seq_len = tl.load(seq_lens + req)
    if q_len == 0:
        return

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < head_size
    q = tl.load(
        Q + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    scale = qk_scale
    if IS_FP8:
        scale = scale * tl.load(k_scale)

    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    first = start
    if TABLE_BLOCKS:  # tiles start on a cache block; keys before `start` are masked
        first = start // KV_BLOCK * KV_BLOCK
    span = seq_len - first
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    s0 = first + split * chunk
    s1 = tl.minimum(s0 + chunk, seq_len)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_table + req.to(tl.int64) * stride_bt
    for n in range(s0, s1, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        pmask = pos < s1
        if TABLE_BLOCKS:
            if HAS_WINDOW:
                pmask = pmask & (pos >= start)
            blk = kv_blocks(table, n, s1, KV_BLOCK, BLOCK_N)
        else:
            blk = tl.load(table + pos // KV_BLOCK, mask=pmask, other=0).to(tl.int64)
        off = pos % KV_BLOCK
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(
            K + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        qk = mm(q, tl.trans(k.to(q.dtype)), UPCAST, PRECISION) * scale
        qk = tl.where(pmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(
            V + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + mm(p.to(q.dtype), v.to(q.dtype), UPCAST, PRECISION)
        m = m_new

    if IS_FP8:
        acc = acc * tl.load(v_scale)
    if DIRECT:  # one split: finish here, no partials and no reduction launch
        if HAS_SINKS:
            l_sum, acc = fold_sinks(sinks + heads, gmask, m, l_sum, acc)
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            Out + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )
    else:
        has = l_sum > 0
        out = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
        lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
        row = (req.to(tl.int64) * num_q_heads + heads) * num_splits + split
        tl.store(
            O_part + row[:, None] * BLOCK_D + d[None, :],
            out,
            mask=gmask[:, None] & dmask[None, :],
        )
        tl.store(L_part + row, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    O_part,
    L_part,
    query_start_loc,
    sinks,
    Out,
    stride_ot,
    stride_oh,
    num_q_heads,
    num_splits,
    head_size,
    HAS_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    h = tl.program_id(1)
    # the partials (every decode row has them: the buffer holds num_decodes requests)
    # are loaded beside the query bounds, ahead of the branch on them
    t = tl.load(query_start_loc + req)
    t_end = tl.load(query_start_loc + req + 1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    row = (req.to(tl.int64) * num_q_heads + h) * num_splits + s
    lse = tl.load(L_part + row, mask=smask, other=float("-inf"))
    parts = tl.load(
        O_part + row[:, None] * BLOCK_D + d[None, :],
        mask=smask[:, None] & (d[None, :] < head_size),
        other=0.0,
    )
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634
    if t_end == t:
        return
    m = tl.max(lse, 0)
    if HAS_SINKS:
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    num = tl.sum(parts * w[:, None], 0)
    out = tl.where(denom > 0, num / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(
        Out + t.to(tl.int64) * stride_ot + h * stride_oh + d,
        out.to(Out.dtype.element_ty),
        mask=d < head_size,
    )


@functools.cache
def _config(head_size: int, kv_block: int) -> dict:
    """The production config (H200 sweeps, docs/benchmarks.md at 7b425cd): up to head size
    128, 64-key tiles three stages deep whose block-table reads go one per cache block. Read
    only: every call of a shape shares it."""
    if head_size > 128:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64, num_warps=4, num_stages=3, table_blocks=64 % kv_block == 0)


def _checked(config: dict, kv_block: int) -> dict:
    """An explicit config, whole and holding only CONFIG_KEYS (the production one is by
    construction)."""
    missing = {"BLOCK_N", "num_warps", "num_stages"} - set(config)
    if missing:
        raise ValueError(f"config {config!r} lacks {sorted(missing)}")
    check_config_keys(config, CONFIG_KEYS)
    if config.get("table_blocks") and config["BLOCK_N"] % kv_block:
        raise ValueError(f"table_blocks needs BLOCK_N a multiple of the cache block {kv_block}")
    return config


def programs_per_sm(device: torch.device) -> int:
    """Split-kernel programs one SM of `device` holds: measured at its first split launch
    there, DECODE_PROGRAMS_PER_SM before that and off CUDA."""
    if device.type != "cuda":
        return DECODE_PROGRAMS_PER_SM
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _programs_per_sm.get(index, DECODE_PROGRAMS_PER_SM)


def _record_occupancy(kernel, device: torch.device) -> None:
    """Remember the occupancy of a CUDA device's first split launch. Not on ROCm (the rule
    is NVIDIA's), nor from the interpreter (it returns no compiled kernel)."""
    if device.type != "cuda" or torch.version.hip or kernel is None:
        return
    if device.index in _programs_per_sm:
        return
    props = torch.cuda.get_device_properties(device)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", None)  # not in old torch
    if shared_per_sm is None:
        return  # the plan keeps DECODE_PROGRAMS_PER_SM
    _programs_per_sm[device.index] = occupancy(
        kernel.n_regs,
        kernel.metadata.shared,
        kernel.metadata.num_warps,
        props.max_threads_per_multi_processor,
        shared_per_sm,
    )


def paged_decode(
    query,
    key_cache,
    value_cache,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output,
    *,
    num_splits: int,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention for the decode rows [0, meta.num_decodes) (one query token each).

    `num_splits` comes from the step's plan (`plan.TritonPlan`); tests pick their own.
    """
    n = meta.num_decodes
    if n == 0:
        return output
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} is outside 1..{MAX_SPLITS}")
    hq, d = query.shape[1], query.shape[2]
    _, kv_block, hkv, _ = key_cache.shape
    group = hq // hkv
    sliding_window, sinks = params.sliding_window, params.sinks
    cfg = _config(d, kv_block) if config is None else _checked(config, kv_block)
    table_blocks = bool(cfg.get("table_blocks"))
    block_d = next_power_of_2(d)
    direct = num_splits == 1
    parts = 0 if direct else n * hq * num_splits
    o_part = torch.empty(parts * block_d, dtype=torch.float32, device=query.device)
    l_part = torch.empty(parts, dtype=torch.float32, device=query.device)
    fp8 = is_fp8(key_cache.dtype)
    kernel = _decode_split_kernel[(n * hkv, num_splits)](
        query,
        key_cache,
        value_cache,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        params.k_scale if fp8 else meta.seq_lens,
        params.v_scale if fp8 else meta.seq_lens,
        o_part,
        l_part,
        sinks if sinks is not None else meta.seq_lens,
        output,
        params.scale * LOG2E,
        sliding_window or 0,
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
        hq,
        num_splits,
        d,
        GROUP=group,
        KV_HEADS=hkv,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        KV_BLOCK=kv_block,
        BLOCK_N=cfg["BLOCK_N"],
        IS_FP8=fp8,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        DIRECT=direct,
        **dot_flags(query),
        TABLE_BLOCKS=table_blocks,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if direct:
        return output
    if config is None:  # the production config's occupancy is what the plan reads
        _record_occupancy(kernel, query.device)
    _decode_reduce_kernel[(n, hq)](
        o_part,
        l_part,
        meta.query_start_loc,
        sinks if sinks is not None else l_part,
        output,
        output.stride(0),
        output.stride(1),
        hq,
        num_splits,
        d,
        HAS_SINKS=sinks is not None,
        # the split count's power of two: the reduce is compute-bound on its tile, and a
        # bucket's split count is fixed, so each bucket compiles (in warm-up) at most once
        BLOCK_S=next_power_of_2(num_splits),
        BLOCK_D=block_d,
        num_warps=4,
    )
    return output
