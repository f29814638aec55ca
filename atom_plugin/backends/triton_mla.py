"""Triton MLA kernels: the latent cache write and a split-KV decode with a reduction.

Decode stage 1 runs one program per (head group, KV split, request and token chunk).
All heads share the latent rows, so a program loads each block of cached rows once and
scores it against BLOCK_M query rows (BLOCK_H heads x the request's query tokens packed
together, so a 16-head request with 2 speculative tokens reads its rows once, not twice)
with two matmuls (latent part and rope part), then accumulates P @ kv_c. Each query row
masks the keys it may not see (causal rows of one request see different counts). Head
groups are the fastest-varying grid axis, so the groups that read the same rows run next
to each other and mostly hit L2. The kernel from before packing, one program per
(head group, split, query token), stays beside it (`_mla_decode_per_token`) and runs
where it measured faster (`choose_kernel`). Stage 2 merges the splits with their
log-sum-exps, in chunks of splits; with one split, stage 1 writes the output itself and
stage 2 does not run. Correctness does not depend on the number of splits; the per-step
plan (`plan_launch`, called by `mla_plan.plan_mla_decode`) picks the kernel and the split
count from batch, heads and context.

Where the cache allows it (a CUDA GPU with TMA, 16-bit, fp32 or fp8 rows, BLOCK_N
dividing the block size, 16-byte alignment) whole tiles load through TMA tensor
descriptors: a tile never crosses a page, so it is one box of the cache viewed as rows.
The last, partial tile of each split, and every tile otherwise, go through masked
pointer loads. The packed kernel widens an fp8 tile unscaled to fp16 or bf16
(`fp8_math`; e4m3 values are exact in both) and folds the per-tensor scale into the score
scale and the output; the per-token kernel reads fp8 through pointer loads only and
dequantizes in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_plugin.backends.checks import FP8_DTYPES, is_fp8
from atom_plugin.backends.mla_plan import MLAStepLayout, check_mla_shapes, plan_mla_decode
from atom_plugin.backends.triton_common import (
    cdiv,
    device_has_tma,
    device_sm_count,
    next_power_of_2,
)

# The split count changes from step to step, and with it the strides of the partial lse
# buffer [tokens, heads, splits] (the partial outputs' strides stay multiples of 16).
_SPLIT_SHAPED = ["num_splits", "stride_lt", "stride_lh"]


@triton.jit
def _mla_write_kernel(
    KV_C,
    K_PE,
    CACHE,
    SLOTS,
    SCALE,
    stride_c,
    stride_pe,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    dst = CACHE + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    offs_c = tl.arange(0, BLOCK_DV)
    offs_pe = tl.arange(0, BLOCK_DPE)
    c = tl.load(KV_C + t.to(tl.int64) * stride_c + offs_c, mask=offs_c < LORA)
    pe = tl.load(K_PE + t.to(tl.int64) * stride_pe + offs_pe, mask=offs_pe < ROPE)
    if QUANT:
        inv = 1.0 / tl.load(SCALE)
        c = c.to(tl.float32) * inv
        pe = pe.to(tl.float32) * inv
    tl.store(dst + offs_c, c.to(CACHE.dtype.element_ty), mask=offs_c < LORA)
    tl.store(dst + LORA + offs_pe, pe.to(CACHE.dtype.element_ty), mask=offs_pe < ROPE)


def write_mla_kv_triton(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    n = slot_mapping.shape[0]
    if n == 0:
        return
    lora, rope = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != lora + rope or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"cache {tuple(kv_cache.shape)} (last stride {kv_cache.stride(-1)}) does not hold "
            f"kv_c {lora} + k_pe {rope} contiguous columns"
        )
    quant = is_fp8(kv_cache.dtype)
    if quant and scale is None:
        raise ValueError("an fp8 MLA cache needs a scale")
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    _mla_write_kernel[(n,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        scale if quant else kv_c,
        kv_c.stride(0),
        k_pe.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        BLOCK_SIZE=kv_cache.shape[1],
        LORA=lora,
        ROPE=rope,
        BLOCK_DV=next_power_of_2(lora),
        BLOCK_DPE=next_power_of_2(rope),
        QUANT=quant,
    )


@triton.jit
def _mla_tile(q_c, q_pe, kv_c, k_pe, valid, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) with one tile of latent rows; `valid`
    [rows, keys] says which keys each query row sees."""
    s = tl.dot(q_c, tl.trans(kv_c), input_precision=PRECISION)
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
    s = tl.where(valid, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c, input_precision=PRECISION)
    return m_new, l_i, acc


# Not specialized on what changes from step to step: each new specialization would be a
# JIT compile inside a serving step.
@triton.jit(do_not_specialize=[*_SPLIT_SHAPED, "token_chunks"])
def _mla_decode_stage1(
    Q,
    KV,
    KV_C_DESC,
    K_PE_DESC,
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
    stride_kb,
    stride_ks,
    stride_bt,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    PAGE: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP16_MATH: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    pid_r = tl.program_id(2)
    r = pid_r // token_chunks
    q_start = tl.load(QSL + r)
    q_len = tl.load(QSL + r + 1) - q_start
    first = (pid_r % token_chunks) * TOKENS
    if first >= q_len:
        return
    # query rows: TOKENS tokens of request r times BLOCK_H heads
    offs_m = tl.arange(0, TOKENS * BLOCK_H)
    tok = first + offs_m // BLOCK_H
    head = pid_h * BLOCK_H + offs_m % BLOCK_H
    mask_m = (tok < q_len) & (head < num_heads)
    t = (q_start + tok).to(tl.int64)
    row_len = tl.load(TOK_KV_LEN + t, mask=mask_m, other=0)
    kv_len = tl.max(row_len, 0)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    offs_dv = tl.arange(0, BLOCK_DV)
    offs_pe = tl.arange(0, BLOCK_DPE)
    mask_dv = offs_dv < LORA
    mask_pe = offs_pe < ROPE
    q_row = Q + t[:, None] * stride_qt + head[:, None] * stride_qh
    q_c = tl.load(q_row + offs_dv[None, :], mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
    q_pe = tl.load(
        q_row + LORA + offs_pe[None, :], mask=mask_m[:, None] & mask_pe[None, :], other=0.0
    )
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if IS_FP8:
        kv_scale = tl.load(KV_SCALE)
        qk_scale = qk_scale * kv_scale  # the tiles are widened unscaled
        if FP16_MATH:
            # e4m3 -> fp16 is one instruction per pair (-> bf16 is several); the query
            # is clamped to fp16's range, the matmuls accumulate in fp32 as before
            q_c = tl.clamp(q_c.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            q_pe = tl.clamp(q_pe.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # a finite start for the running max: a row that sees no key of a tile (a causal
    # row's last tile) keeps alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN
    m_i = tl.full([TOKENS * BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([TOKENS * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([TOKENS * BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = BLOCK_TABLE + r.to(tl.int64) * stride_bt
    tail = start
    if TMA:
        # Whole tiles through TMA: a tile never crosses a page (BLOCK_N divides PAGE,
        # tiles start at multiples of BLOCK_N), so its rows are one box of the cache
        # viewed as [blocks * PAGE, LORA + ROPE]. Only the last, partial tile needs masks.
        tail = start + (end - start) // BLOCK_N * BLOCK_N
        every = tl.full([1, BLOCK_N], 1, tl.int1)  # one token per program: whole tiles
        for n in range(start, tail, BLOCK_N):
            page = tl.load(bt_row + n // PAGE)
            row0 = page * PAGE + n % PAGE
            kv_c = KV_C_DESC.load([row0, 0])
            k_pe = K_PE_DESC.load([row0, 0])
            if IS_FP8:
                kv_c = kv_c.to(q_c.dtype)
                k_pe = k_pe.to(q_c.dtype)
            if TOKENS == 1:
                valid = every
            else:
                valid = (n + tl.arange(0, BLOCK_N))[None, :] < row_len[:, None]
            m_i, l_i, acc = _mla_tile(
                q_c, q_pe, kv_c, k_pe, valid, m_i, l_i, acc, qk_scale, PRECISION
            )
    for n in range(tail, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        row = KV + page * stride_kb + (pos % PAGE).to(tl.int64) * stride_ks
        kv_c = tl.load(
            row[:, None] + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0
        )
        k_pe = tl.load(
            row[:, None] + LORA + offs_pe[None, :],
            mask=mask_n[:, None] & mask_pe[None, :],
            other=0.0,
        )
        if IS_FP8:
            kv_c = kv_c.to(q_c.dtype)
            k_pe = k_pe.to(q_c.dtype)
        if TOKENS == 1:
            valid = mask_n[None, :]
        else:
            valid = pos[None, :] < row_len[:, None]
        m_i, l_i, acc = _mla_tile(q_c, q_pe, kv_c, k_pe, valid, m_i, l_i, acc, qk_scale, PRECISION)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if IS_FP8:
        out = out * kv_scale
    lse = tl.where(has, m_i * 0.6931471805599453 + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    mid = MID_O + t[:, None] * stride_mt + head[:, None] * stride_mh + split * stride_ms
    out = out.to(MID_O.dtype.element_ty)  # the output's dtype when there is one split
    tl.store(mid + offs_dv[None, :], out, mask=mask_m[:, None] & mask_dv[None, :])
    tl.store(MID_LSE + t * stride_lt + head * stride_lh + split, lse, mask=mask_m)


@triton.jit(do_not_specialize=_SPLIT_SHAPED)
def _mla_decode_per_token(
    Q,
    KV,
    KV_C_DESC,
    K_PE_DESC,
    BLOCK_TABLE,
    TOK_REQ,
    TOK_KV_LEN,
    MID_O,
    MID_LSE,
    KV_SCALE,
    sm_scale,
    num_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_bt,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    PAGE: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """The kernel this module had before request packing (one program per head group,
    split and query token; fp8 tiles through pointer loads, dequantized in fp32). The
    plan keeps it where the H200 runs measured it faster (`choose_kernel`)."""
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.program_id(2)
    req = tl.load(TOK_REQ + t)
    if req < 0:
        return
    kv_len = tl.load(TOK_KV_LEN + t)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_pe = tl.arange(0, BLOCK_DPE)
    mask_dv = offs_dv < LORA
    mask_pe = offs_pe < ROPE
    q_row = Q + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_c = tl.load(q_row + offs_dv[None, :], mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    q_pe = tl.load(
        q_row + LORA + offs_pe[None, :], mask=mask_h[:, None] & mask_pe[None, :], other=0.0
    )
    if IS_FP8:
        kv_scale = tl.load(KV_SCALE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_bt
    tail = start
    if TMA:
        # Whole tiles through TMA: a tile never crosses a page (BLOCK_N divides PAGE,
        # tiles start at multiples of BLOCK_N), so its rows are one box of the cache
        # viewed as [blocks * PAGE, LORA + ROPE]. Only the last, partial tile needs masks.
        tail = start + (end - start) // BLOCK_N * BLOCK_N
        every = tl.full([BLOCK_N], 1, tl.int1)
        for n in range(start, tail, BLOCK_N):
            page = tl.load(bt_row + n // PAGE)
            row0 = page * PAGE + n % PAGE
            kv_c = KV_C_DESC.load([row0, 0])
            k_pe = K_PE_DESC.load([row0, 0])
            m_i, l_i, acc = _mla_tile(
                q_c, q_pe, kv_c, k_pe, every[None, :], m_i, l_i, acc, qk_scale, PRECISION
            )
    for n in range(tail, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        row = KV + page * stride_kb + (pos % PAGE).to(tl.int64) * stride_ks
        kv_c = tl.load(
            row[:, None] + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0
        )
        k_pe = tl.load(
            row[:, None] + LORA + offs_pe[None, :],
            mask=mask_n[:, None] & mask_pe[None, :],
            other=0.0,
        )
        if IS_FP8:
            kv_c = (kv_c.to(tl.float32) * kv_scale).to(q_c.dtype)
            k_pe = (k_pe.to(tl.float32) * kv_scale).to(q_c.dtype)
        m_i, l_i, acc = _mla_tile(
            q_c, q_pe, kv_c, k_pe, mask_n[None, :], m_i, l_i, acc, qk_scale, PRECISION
        )

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i * 0.6931471805599453 + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    mid = MID_O + t.to(tl.int64) * stride_mt + offs_h[:, None] * stride_mh + split * stride_ms
    out = out.to(MID_O.dtype.element_ty)  # the output's dtype when there is one split
    tl.store(mid + offs_dv[None, :], out, mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(MID_LSE + t.to(tl.int64) * stride_lt + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=_SPLIT_SHAPED)
def _mla_decode_stage2(
    MID_O,
    MID_LSE,
    TOK_REQ,
    OUT,
    LSE,
    num_splits,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_st,
    LORA: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    """Merge one (token, head)'s splits over BLOCK_DV output columns by their lse: all at
    once when they fit in BLOCK_S (ONE_CHUNK), else BLOCK_S at a time with a running max."""
    h = tl.program_id(0)
    t = tl.program_id(1)
    if tl.load(TOK_REQ + t) < 0:
        return
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LORA
    lse_row = MID_LSE + t.to(tl.int64) * stride_lt + h * stride_lh
    mid = MID_O + t.to(tl.int64) * stride_mt + h * stride_mh
    if ONE_CHUNK:
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_splits
        lse = tl.load(lse_row + offs_s, mask=mask_s, other=float("-inf"))
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_safe)
        denom = tl.sum(w, 0)
        parts = tl.load(
            mid + offs_s[:, None] * stride_ms + offs_dv[None, :],
            mask=mask_s[:, None] & mask_dv[None, :],
            other=0.0,
        )
        out = tl.sum(w[:, None] * parts, 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(
            OUT + t.to(tl.int64) * stride_ot + h * stride_oh + offs_dv,
            out.to(OUT.dtype.element_ty),
            mask=mask_dv,
        )
        tl.store(
            LSE + t.to(tl.int64) * stride_st + h,
            tl.where(denom > 0, m_safe + tl.log(denom), float("-inf")),
        )
        return
    m = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
    denom = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_splits
        lse = tl.load(lse_row + offs_s, mask=mask_s, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        parts = tl.load(
            mid + offs_s[:, None] * stride_ms + offs_dv[None, :],
            mask=mask_s[:, None] & mask_dv[None, :],
            other=0.0,
        )
        acc = acc * rescale + tl.sum(w[:, None] * parts, 0)
        denom = denom * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(
        OUT + t.to(tl.int64) * stride_ot + h * stride_oh + offs_dv,
        out.to(OUT.dtype.element_ty),
        mask=mask_dv,
    )
    if tl.program_id(2) == 0:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(
            LSE + t.to(tl.int64) * stride_st + h,
            tl.where(denom > 0, m_safe + tl.log(denom), float("-inf")),
        )


MAX_SPLITS = 256  # KV splits per request; stage 2 merges them MERGE_BLOCK_S at a time
MERGE_BLOCK_S = 64
MERGE_MIN_DV = 32  # the narrowest merge program (output columns)
MERGE_CHUNKED_DV = 128  # columns per merge program: many splits, fewer rows than SMs
MIN_KEYS_PER_SPLIT = 64  # fewer per split lost at batch 1 (H200 sweeps)


PER_TOKEN_MAX_KEYS = 8192  # requests x context up to which 16 heads run per token


def choose_kernel(
    num_heads: int,
    num_reqs: int,
    context: int,
    packed_splits: int,
    gluon: bool = False,
    max_query_len: int = 1,
) -> str:
    """'gluon', 'packed' or 'per_token', whichever the H200 runs measured faster
    (docs/benchmarks.md). `gluon`: the warpgroup-MMA kernel can run the step (Hopper, a
    cache of 64-row tiles, a 16-bit query: `gluon_step_problems`). It runs above 16
    heads (1.25-1.53x the Triton kernels at batch >= 32), and at 16 heads where its 64
    query rows fill up or the packed plan splits past one merge pass: speculative rows
    (32 x 8K x 2 tokens 1.16x bf16, 1.24x fp8) and batch 1 at long contexts (1 x 32K
    1.18x bf16, 1.06x fp8); elsewhere at 16 heads the packed kernel was as fast or faster
    (128 x 4K: 0.88x). Without it: above 16 heads packing gains nothing at one token per
    program, so the packed kernel runs only where its plan needs more than MERGE_BLOCK_S
    splits (batch 1, long contexts: 1.19-1.22x at 64 heads x 32K; the per-token kernel
    was 1-15% faster elsewhere, fp8 most); at 16 heads it runs everywhere but the
    smallest steps (batch 1 x 4K: the per-token kernel 5% faster)."""
    many_splits = packed_splits > MERGE_BLOCK_S
    if gluon and (num_heads > 16 or max_query_len > 1 or many_splits):
        return "gluon"
    if num_heads > 16:
        return "packed" if many_splits else "per_token"
    return "per_token" if num_reqs * context <= PER_TOKEN_MAX_KEYS else "packed"


def default_config(
    num_heads: int, fp8_cache: bool = False, kernel: str = "packed", max_query_len: int = 1
) -> dict:
    """Launch parameters per kernel, head count, cache kind and query tokens per
    request. `BLOCK_H`: heads per program; `BLOCK_M`: query rows per program (heads x
    packed tokens of one request); `per_sm`: programs the split rule assumes run at
    once on one SM; `fp8_math`: the matmul dtype for an fp8 cache ("fp16": e4m3 widens
    in one instruction per pair; "bf16"). `tma`: load whole tiles through TMA tensor
    descriptors - True requires it, False never, None whenever the cache allows it on
    a CUDA GPU with TMA. `merge_dv`: output columns per merge program (None:
    `merge_block_dv`'s rule). The packed kernel's choices are the H200 sweeps' fastest
    (docs/benchmarks.md): at 16 heads and one query token 32-key tiles five stages deep
    (Triton pipelines a tile whose page comes from the block table (stages - 1) // 2
    tiles ahead: two here, in 93.7 KB of shared memory, so two programs still share an
    SM), fp8 through TMA widened to fp16; with speculative tokens 64-key tiles on 8
    warps, one program per SM; above 16 heads, 64 heads x 64 keys per step on 8 warps,
    fp8 through pointer loads widened to bf16. The per-token kernel keeps its launch
    from before packing (its fp8 tiles always take pointer loads)."""
    if kernel == "gluon":  # tiles, warps and stages are the kernel's own (gluon_mla)
        return {"BLOCK_H": 64, "per_sm": 1, "merge_dv": None, "schedule": None}
    if kernel == "per_token":
        small = num_heads <= 16
        return {
            "BLOCK_H": 16 if small else 64,
            "BLOCK_N": 32 if small else 64,
            "num_warps": 4 if small else 8,
            "num_stages": 2,
            "tma": False if fp8_cache else None,
            "merge_dv": None,
        }
    if num_heads <= 16:
        wide = max_query_len > 1
        return {
            "BLOCK_H": 16,
            "BLOCK_M": 64,
            "BLOCK_N": 64 if wide else 32,
            "num_warps": 8 if wide else 4,
            "num_stages": 5,
            "tma": None,
            "per_sm": 1 if wide else 2,
            "fp8_math": "fp16",
            "merge_dv": None,
        }
    return {
        "BLOCK_H": 64,
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "num_warps": 8,
        "num_stages": 2,
        "tma": False if fp8_cache else None,
        "per_sm": 1,
        "fp8_math": "bf16",
        "merge_dv": None,
    }


KERNELS = ("packed", "per_token", "gluon")


def _config(
    num_heads: int, fp8_cache: bool, kernel: str, config: dict, max_query_len: int = 1
) -> dict:
    cfg = default_config(num_heads, fp8_cache, kernel, max_query_len)
    unknown = sorted(set(config) - set(cfg))
    if unknown:
        raise ValueError(
            f"unknown {kernel} MLA decode config keys {unknown}; valid keys: "
            f"{sorted(cfg) + ['kernel']}"
        )
    cfg.update(config)
    if cfg.get("tma") not in (None, True, False):
        raise ValueError(f"tma must be None, True or False, got {cfg['tma']!r}")
    if cfg.get("fp8_math", "fp16") not in ("fp16", "bf16"):
        raise ValueError(f"fp8_math must be 'fp16' or 'bf16', got {cfg['fp8_math']!r}")
    if cfg.get("schedule") not in (None, *GLUON_SCHEDULES):
        raise ValueError(
            f"schedule must be None (the rule) or one of {GLUON_SCHEDULES}, got {cfg['schedule']!r}"
        )
    if fp8_cache and cfg.get("schedule") == "alternate":
        raise ValueError("the alternate schedule takes 16-bit caches only (fp8: 'lockstep')")
    dv = cfg["merge_dv"]
    if dv is not None and (not isinstance(dv, int) or dv < 16 or dv & (dv - 1)):
        raise ValueError(f"merge_dv must be None or a power of two >= 16, got {dv!r}")
    if kernel == "per_token" and fp8_cache and cfg["tma"] is not False:
        raise ValueError(
            f"the per_token kernel reads fp8 tiles through pointer loads only (tma={cfg['tma']})"
        )
    return cfg


GLUON_SCHEDULES = ("lockstep", "alternate")
ALTERNATE_MIN_TILES = 32  # 64-key tiles per program from which the alternate schedule runs


def gluon_schedule(
    named: str | None, fp8_cache: bool, num_heads: int, context: int, splits: int
) -> str:
    """The Gluon kernel's schedule: `named` if given, else 'alternate' (warp-specialized,
    warpgroups on alternate tiles) for 16-bit caches above 16 heads when each program
    scores at least ALTERNATE_MIN_TILES tiles, else 'lockstep'. H200 runs 18-19 (one run
    each, the final kernels): alternate 1.15-1.31x at 128 heads from 32 x 4K (32 tiles a
    program) up, 1.16-1.18x at 64 heads x 32K, 1.20-1.29x for 2-token rows; 0.97x at 64
    heads x 32 x 4K (16 tiles), 0.91x at batch 1 (4 tiles); at 16 heads and batch 1
    0.83x (run 15)."""
    if named is not None:
        return named
    tiles = cdiv(context, splits * 64)
    wide = not fp8_cache and num_heads > 16
    return "alternate" if wide and tiles >= ALTERNATE_MIN_TILES else "lockstep"


@dataclass(frozen=True)
class TritonMLALaunch:
    """The Triton decode's launch for one step, the same for every layer. `kernel`
    'packed': grid (head_groups, num_splits, num_reqs * token_chunks), `tokens` query
    tokens of a request per program; 'per_token': grid (head_groups, num_splits,
    tokens of the step)."""

    kernel: str
    block_h: int
    tokens: int
    token_chunks: int
    head_groups: int
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool | None
    fp8_cache: bool  # the cache kind the launch was planned for
    fp16_math: bool  # for an fp8 cache
    merge_block_dv: int  # output columns per merge program (`merge_block_dv`)
    schedule: str = "lockstep"  # gluon: "lockstep" (gluon_mla) or "alternate" (its module)


def plan_launch(
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    num_heads: int,
    context: int,
    device: torch.device,
    fp8_cache: bool = False,
    config: dict | None = None,
    num_splits: int | None = None,
    layout: MLAStepLayout | None = None,
) -> TritonMLALaunch:
    """Host-only launch planning from the step's sizes (no device reads): the kernel,
    heads and tokens per program, and the split count for `context` keys per request.
    `config` may name the kernel ('kernel': one of KERNELS); a config that names none
    tunes the packed kernel. `layout` (query dtype, block size, latent and rope widths)
    lets the plan pick the Gluon kernel where it can run; without it the plan keeps to
    the Triton kernels unless `config` names 'gluon'."""
    config = dict(config or {})
    kernel = config.pop("kernel", None if not config else "packed")
    if kernel not in (None, *KERNELS):
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    sms = device_sm_count(device)
    most = max(1, min(MAX_SPLITS, cdiv(context, MIN_KEYS_PER_SPLIT)))
    q_max = max(1, max_query_len)

    def packing(block_h: int, block_m: int):
        block_h = max(16, min(block_h, next_power_of_2(num_heads)))
        tokens = max(1, min(next_power_of_2(q_max), block_m // block_h))
        return block_h, tokens, cdiv(q_max, tokens), cdiv(num_heads, block_h)

    def split_count(programs: int, block_n: int, slots: int, most: int) -> int:
        if num_splits is not None:
            return num_splits
        tiles = max(1, cdiv(context, block_n))
        return best_num_splits(max(1, programs), tiles, slots, most)

    gluon, schedule = False, "lockstep"
    if kernel in (None, "gluon"):
        problems = gluon_step_problems(device, layout)
        if kernel == "gluon" and problems:
            raise ValueError("the gluon MLA kernel cannot run this step: " + "; ".join(problems))
        gluon = not problems
    if kernel in (None, "packed"):
        cfg = _config(num_heads, fp8_cache, "packed", config, max_query_len)
        block_h, tokens, token_chunks, head_groups = packing(cfg["BLOCK_H"], cfg["BLOCK_M"])
        splits = split_count(
            num_reqs * token_chunks * head_groups, cfg["BLOCK_N"], sms * cfg["per_sm"], most
        )
        if kernel is None:
            kernel = choose_kernel(num_heads, num_reqs, context, splits, gluon, max_query_len)
    if kernel == "gluon":
        from atom_plugin.backends import gluon_mla

        cfg = _config(num_heads, fp8_cache, "gluon", config, max_query_len)
        cfg.update(
            BLOCK_N=gluon_mla.BLOCK_N,
            num_warps=gluon_mla.NUM_WARPS,
            num_stages=gluon_mla.STAGES,
            tma=True,
        )
        block_h, tokens, token_chunks, head_groups = packing(cfg["BLOCK_H"], gluon_mla.BLOCK_M)
        splits = split_count(
            num_reqs * token_chunks * head_groups, gluon_mla.BLOCK_N, sms * cfg["per_sm"], most
        )
        schedule = gluon_schedule(cfg["schedule"], fp8_cache, num_heads, context, splits)
    if kernel == "per_token":
        cfg = _config(num_heads, fp8_cache, "per_token", config)
        block_h = max(16, min(cfg["BLOCK_H"], next_power_of_2(num_heads)))
        tokens = token_chunks = 1
        head_groups = cdiv(num_heads, block_h)
        splits = split_count(num_tokens * head_groups, cfg["BLOCK_N"], sms, MERGE_BLOCK_S)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={splits} must lie in [1, {MAX_SPLITS}]")
    merge_dv = cfg["merge_dv"] or merge_block_dv(num_tokens * num_heads, splits, sms)
    return TritonMLALaunch(
        kernel=kernel,
        block_h=block_h,
        tokens=tokens,
        token_chunks=token_chunks,
        head_groups=head_groups,
        num_splits=splits,
        block_n=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        tma=cfg["tma"],
        fp8_cache=fp8_cache,
        fp16_math=cfg.get("fp8_math", "fp16") == "fp16",
        merge_block_dv=merge_dv,
        schedule=schedule,
    )


def gluon_step_problems(device: torch.device, layout: MLAStepLayout | None) -> list[str]:
    """Why the Gluon kernel cannot run steps of `layout` on `device`; empty when it can
    (asked once per step by the plan and once per layer by the decode: cached)."""
    return list(_gluon_step_problems(device, layout))


@functools.lru_cache(maxsize=64)
def _gluon_step_problems(device: torch.device, layout: MLAStepLayout | None) -> tuple[str, ...]:
    if layout is None:
        return ("the plan was given no step layout (query dtype, block size, widths)",)
    if device.type != "cuda":
        return (f"device {device} (the Gluon kernel runs on CUDA GPUs)",)
    from atom_plugin.backends import gluon_mla

    return tuple(
        gluon_mla.gluon_problems(
            device, layout.q_dtype, layout.block_size, layout.kv_lora_rank, layout.rope
        )
    )


def _gluon_input_problems(q, kv_cache, lora: int, fp8: bool) -> list[str]:
    """Why this layer's query and cache do not fit the Gluon kernel its plan chose."""
    from atom_plugin.backends import gluon_mla

    rope = kv_cache.shape[2] - lora
    layout = MLAStepLayout(q.dtype, kv_cache.shape[1], lora, rope)
    problems = gluon_step_problems(q.device, layout)
    problems += _tma_problems(kv_cache, lora, rope, gluon_mla.BLOCK_N)
    if not fp8 and kv_cache.dtype != q.dtype:
        problems.append(f"the cache's dtype {kv_cache.dtype} is not the query's {q.dtype}")
    return problems


TMA_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + FP8_DTYPES


def _tma_problems(kv_cache: torch.Tensor, lora: int, rope: int, block_n: int) -> list[str]:
    """Why TMA descriptors cannot read the cache as [blocks * page, lora + rope] rows
    in tiles of `block_n`; empty when they can."""
    page = kv_cache.shape[1]
    size = kv_cache.element_size()
    problems = []
    if kv_cache.dtype not in TMA_DTYPES:
        problems.append(f"cache dtype {kv_cache.dtype} (tma takes {TMA_DTYPES})")
    if page % block_n:
        problems.append(f"BLOCK_N={block_n} does not divide the block size {page}")
    if kv_cache.stride(2) != 1 or kv_cache.stride(0) != page * kv_cache.stride(1):
        problems.append(f"cache strides {kv_cache.stride()} are not rows of one 2-d view")
    if (kv_cache.stride(1) * size) % 16:
        problems.append(f"cache rows ({kv_cache.stride(1)} elements apart) are not 16-byte aligned")
    if kv_cache.data_ptr() % 16 or (kv_cache.data_ptr() + lora * size) % 16:
        problems.append("the latent or rope columns do not start 16-byte aligned")
    for name, n in (("kv_lora_rank", lora), ("rope", rope)):
        if n < 16 or n & (n - 1):
            problems.append(f"{name}={n} is not a power of two >= 16")
    if kv_cache.is_cuda and not device_has_tma(kv_cache.device):
        problems.append("the GPU has no TMA (needs CUDA compute capability 9.0 or newer)")
    return problems


def _use_tma(want, kv_cache, lora, rope, block_n) -> bool:
    # auto (None) means CUDA only; the CPU interpreter takes tma=True for tests
    if want is False or (want is None and not kv_cache.is_cuda):
        return False
    problems = _tma_problems(kv_cache, lora, rope, block_n)
    if want and problems:
        raise ValueError("tma=True cannot read this cache: " + "; ".join(problems))
    return not problems


def cache_row_parts(kv_cache: torch.Tensor, lora: int) -> list[tuple]:
    """The cache viewed as rows [blocks * page, width], cut into its latent and rope
    columns: (view, shape, strides) of each, what a TMA descriptor of a part takes."""
    blocks, page, width = kv_cache.shape
    n, stride = blocks * page, kv_cache.stride(1)
    rows = kv_cache.as_strided((n, width), (stride, 1))
    return [(rows, [n, lora], [stride, 1]), (rows[:, lora:], [n, width - lora], [stride, 1])]


def _tma_descriptors(kv_cache: torch.Tensor, lora: int, block_n: int):
    """Descriptors of the latent and rope columns of the cache viewed as rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return [
        TensorDescriptor(part, shape, strides, [block_n, shape[1]])
        for part, shape, strides in cache_row_parts(kv_cache, lora)
    ]


def merge_block_dv(rows: int, splits: int, sms: int, dv: int = 512) -> int:
    """Output columns per merge program for `rows` (token, head) pairs. Fewer rows than
    half the SMs: programs narrowed, down to MERGE_MIN_DV, until they fill two waves
    (H200, 132 SMs, batch 1: 16 rows (16 heads) in 32-column programs 1.04-1.10x the
    rule before, 64 rows in 64-column ones 1.03x). From there the rule before: 128
    columns for fewer rows than SMs merging more than one pass of splits, else whole
    rows (128 rows, 128 heads at batch 1 and 64 splits, lost 2-5% in 128-column
    programs; docs/benchmarks.md)."""
    if rows < sms // 2:
        parts = next_power_of_2(cdiv(2 * sms, max(1, rows)))
        return max(min(dv, MERGE_MIN_DV), dv // parts)
    return min(dv, MERGE_CHUNKED_DV) if rows < sms and splits > MERGE_BLOCK_S else dv


# A program's fixed cost (query load, partial-result store, its share of the merge) in
# key tiles; fitted to the H200 split sweep in docs/benchmarks.md.
SPLIT_OVERHEAD_TILES = 3


@functools.lru_cache(maxsize=4096)
def best_num_splits(programs: int, tiles: int, slots: int, most: int = MAX_SPLITS) -> int:
    """The split count with the least waves x (tiles per split + fixed cost), fewer splits
    on ties, at most `most` (and at most `tiles`); a wave is `slots` programs (SMs x
    programs resident per SM). A count that
    leaves the last wave mostly empty loses to one that does not (the MHA rule, which
    aims at two waves, picked 5 splits at batch 32 where 2 run 1.3x faster)."""

    def cost(splits: int) -> int:
        return cdiv(programs * splits, slots) * (cdiv(tiles, splits) + SPLIT_OVERHEAD_TILES)

    return min(range(1, max(1, min(tiles, most)) + 1), key=cost)


def _run_triton_stage1(
    q, kv_cache, meta, T, kv_len, req, mid_o, mid_lse, kv_scale, scale, launch, kv_lora_rank
):
    """Stage 1 on the Triton kernel `launch` names ('packed' or 'per_token') for the
    step's first T query tokens."""
    H = q.shape[1]
    fp8 = launch.fp8_cache
    splits = launch.num_splits
    rope = kv_cache.shape[2] - kv_lora_rank
    block_table = meta.block_table
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit
    tma = _use_tma(launch.tma, kv_cache, kv_lora_rank, rope, launch.block_n)
    descs = (kv_cache, kv_cache)  # unused without tma
    if tma:
        descs = _tma_descriptors(kv_cache, kv_lora_rank, launch.block_n)
    # The two stage-1 kernels take the same arguments around their token indexing.
    head = (q, kv_cache, *descs, block_table)
    tail = (mid_o, mid_lse, kv_scale if fp8 else q, float(scale), H, splits)
    strides = (
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
    )
    constants = dict(
        PAGE=kv_cache.shape[1],
        LORA=kv_lora_rank,
        ROPE=rope,
        BLOCK_DV=next_power_of_2(kv_lora_rank),
        BLOCK_DPE=max(16, next_power_of_2(rope)),
        BLOCK_H=launch.block_h,
        BLOCK_N=launch.block_n,
        IS_FP8=fp8,
        PRECISION=precision,
        TMA=tma,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if launch.kernel == "per_token":
        _mla_decode_per_token[(launch.head_groups, splits, T)](
            *head, req, kv_len, *tail, *strides, **constants
        )
    else:
        _mla_decode_stage1[(launch.head_groups, splits, meta.num_reqs * launch.token_chunks)](
            *head,
            meta.query_start_loc,
            kv_len,
            *tail,
            launch.token_chunks,
            *strides,
            TOKENS=launch.tokens,
            FP16_MATH=launch.fp16_math,
            **constants,
        )


def mla_decode_triton(
    q,
    kv_cache,
    meta,
    *,
    scale,
    output,
    kv_lora_rank=512,
    kv_scale=None,
    token_kv_lens=None,
    num_splits: int | None = None,
    config: dict | None = None,
    plan=None,
) -> torch.Tensor:
    """Split-KV MLA decode; see `mla_reference.mla_decode_reference` for the semantics.
    `plan` is `mla_plan.plan_mla_decode`'s result when the caller (the metadata builder)
    built it once per step; without it the plan is built here from `token_kv_lens`,
    `num_splits` and `config`, which a plan already fixes."""
    check_mla_shapes(q, kv_cache, output, kv_lora_rank)
    T, H, _ = q.shape
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    fp8 = is_fp8(kv_cache.dtype)
    if fp8 and kv_scale is None:
        raise ValueError("an fp8 MLA cache needs kv_scale")
    if plan is None:
        plan = plan_mla_decode(
            meta,
            T,
            H,
            kernel_impl="triton",
            token_kv_lens=token_kv_lens,
            kv_dtype=kv_cache.dtype,
            config=config,
            num_splits=num_splits,
        )
    elif config is not None or num_splits is not None or token_kv_lens is not None:
        raise ValueError(
            "config, num_splits and token_kv_lens go to plan_mla_decode; a plan already fixes them"
        )
    launch = plan.launch
    if not isinstance(launch, TritonMLALaunch):
        raise ValueError(f"the plan carries no Triton launch (kernel path {plan.kernel_impl!r})")
    if launch.fp8_cache != fp8:
        raise ValueError(
            f"the plan was made for an {'fp8' if launch.fp8_cache else '16/32-bit'} cache, "
            f"the cache is {kv_cache.dtype}"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    req, kv_len = plan.token_req, plan.token_kv_len
    T = min(T, req.shape[0])  # tokens past the plan stay untouched
    splits = launch.num_splits
    if splits == 1:  # stage 1 writes the result itself: no partials, no merge
        mid_o, mid_lse = output.unsqueeze(2), lse.unsqueeze(2)
    else:
        mid_o = torch.empty((T, H, splits, kv_lora_rank), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    if launch.kernel == "gluon":
        from atom_plugin.backends import gluon_mla

        problems = _gluon_input_problems(q, kv_cache, kv_lora_rank, fp8)
        if problems:
            raise ValueError("the plan chose the gluon kernel, but: " + "; ".join(problems))
        gluon_mla.run_stage1(
            q,
            kv_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.num_reqs,
            kv_len,
            mid_o,
            mid_lse,
            kv_scale,
            scale,
            launch,
            kv_lora_rank,
        )
    else:
        _run_triton_stage1(
            q, kv_cache, meta, T, kv_len, req, mid_o, mid_lse, kv_scale, scale, launch, kv_lora_rank
        )
    if splits == 1:
        return lse
    dv = next_power_of_2(kv_lora_rank)
    one_chunk = splits <= MERGE_BLOCK_S  # all splits in one pass
    block_dv = min(dv, launch.merge_block_dv)
    _mla_decode_stage2[(H, T, dv // block_dv)](
        mid_o,
        mid_lse,
        req,
        output,
        lse,
        splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        output.stride(0),
        output.stride(1),
        lse.stride(0),
        LORA=kv_lora_rank,
        BLOCK_DV=block_dv,
        BLOCK_S=MERGE_BLOCK_S,  # one compile for every split count
        ONE_CHUNK=one_chunk,
    )
    return lse
