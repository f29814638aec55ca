"""The Triton MLA kernels (@triton.jit only): the latent cache write, decode stage 1 in
two forms and stage 2, the merge of the splits. `mla.triton` launches them with the
launch `mla.launch_plan` plans.

Stage 1 `_mla_decode_stage1` (the packed kernel) runs one program per (head group, KV
split, request and token chunk). All heads share the latent rows, so a program loads each
block of cached rows once and scores it against BLOCK_M query rows (BLOCK_H heads x the
request's query tokens packed together, so a 16-head request with 2 speculative tokens
reads its rows once, not twice) with two matmuls (latent part and rope part), then
accumulates P @ kv_c. Each query row masks the keys it may not see (causal rows of one
request see different counts). Head groups are the fastest-varying grid axis, so the
groups that read the same rows run next to each other and mostly hit L2.
`_mla_decode_per_token` runs one program per (head group, split, query token). Stage 2
merges the splits with their log-sum-exps, in chunks of splits; with one split, stage 1
writes the output itself, stage 2 does not run, and `_mla_fill_keyless` writes the rows
of the tokens that see no key. The stage-1 kernels read the query's
latent part (Q) and rope part (QPE) through strides of their own, as vLLM hands them over
(no concatenation a layer).

With TMA, whole tiles load through tensor descriptors of the cache viewed as rows
(`mla.cache_view`): a tile never crosses a page, so it is one box. The last, partial
tile of each split, and every tile without TMA, go through masked pointer loads. The
packed kernel widens an fp8 tile unscaled to fp16 or bf16 (FP16_MATH; e4m3 values are
exact in both) and folds the per-tensor scale into the score scale and the output; the
per-token kernel reads fp8 through pointer loads only and dequantizes in fp32.

The kernels keep their names: profiles (benchmarks/results/kernel-profiles-h200/) name them.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
    QPE,
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
    stride_pt,
    stride_ph,
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
    pe_row = QPE + t[:, None] * stride_pt + head[:, None] * stride_ph
    q_pe = tl.load(pe_row + offs_pe[None, :], mask=mask_m[:, None] & mask_pe[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if IS_FP8:
        kv_scale = tl.load(KV_SCALE)
        qk_scale = qk_scale * kv_scale  # the tiles are widened unscaled
        if FP16_MATH:
            # e4m3 -> fp16 is one instruction per pair (-> bf16 is several); the query
            # is clamped to fp16's range, the matmuls still accumulate in fp32
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
    # a split past the rows' keys leaves its partial unwritten: the merge reads only
    # splits whose lse is finite, and one split's partial is the output, zeroed first
    if start < end:
        tl.store(mid + offs_dv[None, :], out, mask=mask_m[:, None] & mask_dv[None, :])
    tl.store(MID_LSE + t * stride_lt + head * stride_lh + split, lse, mask=mask_m)


@triton.jit(do_not_specialize=_SPLIT_SHAPED)
def _mla_decode_per_token(
    Q,
    QPE,
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
    stride_pt,
    stride_ph,
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
    """Stage 1 with one program per head group, split and query token; fp8 tiles through
    pointer loads, dequantized in fp32. The plan runs it where it is faster than the
    packed kernel (`mla.launch_plan.choose_kernel`)."""
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
    pe_row = QPE + t.to(tl.int64) * stride_pt + offs_h[:, None] * stride_ph
    q_pe = tl.load(pe_row + offs_pe[None, :], mask=mask_h[:, None] & mask_pe[None, :], other=0.0)
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
    if start < end:  # as in the packed kernel
        tl.store(mid + offs_dv[None, :], out, mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(MID_LSE + t.to(tl.int64) * stride_lt + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _mla_fill_keyless(
    TOK_KV_LEN,
    OUT,
    LSE,
    H,
    stride_ot,
    stride_oh,
    stride_st,
    LORA: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """With one split stage 1 stores the output itself, and only for tokens that see a
    key: a token that sees none (a token of no request, or one whose rank holds none of
    its keys under decode context parallelism) gets zeros and lse -inf here. One program
    a token; a token with keys costs a load."""
    t = tl.program_id(0)
    if tl.load(TOK_KV_LEN + t) > 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + offs_h
        tl.store(
            OUT + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
            tl.zeros([BLOCK_H, BLOCK_DV], dtype=OUT.dtype.element_ty),
            mask=(heads < H)[:, None] & (offs_dv < LORA)[None, :],
        )
        tl.store(
            LSE + t.to(tl.int64) * stride_st + heads,
            tl.full([BLOCK_H], float("-inf"), dtype=tl.float32),
            mask=heads < H,
        )


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
    once when they fit in BLOCK_S (ONE_CHUNK), else BLOCK_S at a time with a running max.
    BLOCK_S is the plan's (`launch_plan.merge_block_s`): the split count's power of two,
    so a one-pass tile holds no more than twice the real rows. The column programs of a
    row each weigh its (few) splits; the first stores the row's lse. A token of no request
    gets zeros and lse -inf (stage 1 wrote no partials for it), so the caller's output
    needs no filling beforehand. A split whose lse is -inf (no key: a graph planned for a
    longer context than the step's leaves many such) weighs 0 and its partial, which
    stage 1 leaves unwritten, is not read."""
    h = tl.program_id(0)
    t = tl.program_id(1)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LORA
    if tl.load(TOK_REQ + t) < 0:
        tl.store(
            OUT + t.to(tl.int64) * stride_ot + h * stride_oh + offs_dv,
            tl.zeros([BLOCK_DV], dtype=OUT.dtype.element_ty),
            mask=mask_dv,
        )
        if tl.program_id(2) == 0:
            tl.store(LSE + t.to(tl.int64) * stride_st + h, float("-inf"))
        return
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
        w = w / tl.where(denom > 0, denom, 1.0)  # normalized per split, not per column
        keyed = lse > float("-inf")  # splits without keys (and past the count) weigh 0: not read
        parts = tl.load(
            mid + offs_s[:, None] * stride_ms + offs_dv[None, :],
            mask=keyed[:, None] & mask_dv[None, :],
            other=0.0,
        )
        out = tl.sum(w[:, None] * parts, 0)
        tl.store(
            OUT + t.to(tl.int64) * stride_ot + h * stride_oh + offs_dv,
            out.to(OUT.dtype.element_ty),
            mask=mask_dv,
        )
        if tl.program_id(2) == 0:
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
        keyed = lse > float("-inf")
        parts = tl.load(
            mid + offs_s[:, None] * stride_ms + offs_dv[None, :],
            mask=keyed[:, None] & mask_dv[None, :],
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
