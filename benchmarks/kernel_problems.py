"""The problems `benchmarks.kernels_vs_vllm` poses to the plugin's kernels and to vLLM's:
how their work is counted (FLOP, bytes), the inputs and the arguments each side is called
with (as vLLM's backends call FlashMLA, FA3, FA3 with q_v for MLA and vLLM's Triton
kernel), and the output check every row must pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from benchmarks import attention, attention_mla

LORA, ROPE, MLA_PAGE = attention_mla.LORA, attention_mla.ROPE, attention_mla.PAGE
HQ, HKV, D, DTYPE = attention.HQ, attention.HKV, attention.D, attention.DTYPE
MHA_SCALE = attention.SCALE
MHA_BLOCK_SIZE = 16  # vLLM's default block size with the plugin's MHA backend

LOGIT_STD = 3.0  # logits' standard deviation: a few keys carry most of each row's weight
Q_FP8_SCALE = 0.5  # the query's per-tensor scale on fp8 rows: a power of two, exact in bf16
ATOL, RTOL = 3e-2, 2e-2  # bf16 outputs of kernels that round P to bf16
GIB = 1 << 30


@dataclass(frozen=True)
class Heads:
    """An MHA head configuration: query heads, KV heads, head size."""

    q: int
    kv: int
    d: int

    @property
    def scale(self) -> float:
        return self.d**-0.5

    def __str__(self) -> str:
        return f"{self.q}/{self.kv}/{self.d}"


DEFAULT_HEADS = Heads(HQ, HKV, D)


@dataclass(frozen=True)
class PrefillCase:
    """`requests` prompts of `new` tokens each, appended to `cached` tokens already in
    the cache (0: a fresh prompt); causal, aligned at the end."""

    requests: int
    new: int
    cached: int = 0

    @property
    def seq_len(self) -> int:
        return self.new + self.cached

    @property
    def tokens(self) -> int:
        return self.requests * self.new

    def reqs(self) -> list[tuple[int, int]]:
        return [(self.new, self.seq_len)] * self.requests

    def __str__(self) -> str:
        if self.cached:
            return f"{self.requests} x {self.new} over {self.cached} cached"
        return f"{self.requests} x {self.new} fresh"


# ---------------------------------------------------------------- accounting


def mla_flops(batch: int, context: int, heads: int, q_len: int) -> int:
    """2 * query tokens per request * sum of contexts * heads * (576 + 512)."""
    return 2 * q_len * batch * context * heads * ((LORA + ROPE) + LORA)


def mla_bytes(batch: int, context: int, heads: int, q_len: int, kv_elem: int = 2) -> int:
    """Latent rows read once per request (`kv_elem` bytes each: 1 for fp8), plus the bf16
    queries read and outputs written."""
    kv = batch * context * (LORA + ROPE)
    q = batch * q_len * heads * (LORA + ROPE)
    o = batch * q_len * heads * LORA
    return kv * kv_elem + (q + o) * 2


def limit_us(flops: int, nbytes: int, copy_gbps: float | None, mm_tflops: float | None):
    """The physical limit of a call: the larger of its time at the matmul rate and at the
    copy bandwidth (None without both anchors)."""
    if not copy_gbps or not mm_tflops:
        return None
    return max(flops / (mm_tflops * 1e6), nbytes / (copy_gbps * 1e3))


def mha_decode_flops(batch: int, context: int, heads: Heads = DEFAULT_HEADS) -> int:
    """q.k and p.v: 4 * query heads * head size per key, one query token per request."""
    return 4 * heads.q * heads.d * batch * context


def mha_decode_bytes(batch: int, context: int, heads: Heads = DEFAULT_HEADS, elem=2) -> int:
    """K and V rows read once per request, plus the queries read and the outputs written."""
    return (2 * batch * context * heads.kv * heads.d + 2 * batch * heads.q * heads.d) * elem


def mha_cache_bytes(batch: int, context: int, heads: Heads, block_size=MHA_BLOCK_SIZE) -> int:
    """The bf16 K and V blocks `batch` requests of `context` tokens occupy."""
    return batch * -(-context // block_size) * block_size * 2 * heads.kv * heads.d * 2


def prefill_reqs(requests: int, tokens: int) -> list[tuple[int, int]]:
    """`requests` fresh prompts of `tokens` each, as (query_len, seq_len) pairs."""
    return [(tokens, tokens)] * requests


def causal_pairs(reqs) -> int:
    """(query, key) pairs a causal pass computes: query j of q_len new tokens over a
    context s sees s - q_len + j + 1 keys."""
    return sum(ql * (s - ql) + ql * (ql + 1) // 2 for ql, s in reqs)


def prefill_flops(reqs, heads: Heads = DEFAULT_HEADS) -> int:
    return 4 * heads.q * heads.d * causal_pairs(reqs)


def rate(amount: float, us: float | None, unit: float) -> float | None:
    """amount per second in `unit`s (1e9: GB/s, 1e12: TFLOP/s) for a call of `us`."""
    return None if not us else amount / (us * 1e-6) / unit


# ---------------------------------------------------------------- inputs


def peaked_std(dim: int, scale: float, logit_std: float = LOGIT_STD) -> float:
    """Query standard deviation giving logits (q.k * scale, keys N(0, 1) over `dim`)
    the standard deviation `logit_std`."""
    return logit_std / (math.sqrt(dim) * scale)


def make_mla_shape(batch, context, heads, q_len, device="cuda", seed=0, cache="bf16", shared=False):
    """attention_mla.Shape (bf16 or fp8 e4m3 cache with a per-tensor scale, block 64,
    shuffled tables; `shared`: one context every request reads) with peaked queries; with
    an fp8 cache the query lies on the e4m3 grid at Q_FP8_SCALE (`on_fp8_grid`), so that
    FlashMLA's fp8 path, which takes the query quantized, and the plugin, which takes it
    in bf16, get the same values."""
    torch.manual_seed(seed)
    shape = attention_mla.Shape(batch, context, heads, q_len, cache, device, shared)
    std = peaked_std(LORA + ROPE, shape.scale)
    q = torch.randn(shape.q.shape, device=device) * std
    shape.q = (on_fp8_grid(q, Q_FP8_SCALE) if cache == "fp8" else q).to(shape.q.dtype)
    return shape


def to_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` quantized to e4m3 with the per-tensor `scale` (x / scale, rounded)."""
    return (x.float() / scale).to(torch.float8_e4m3fn)


def on_fp8_grid(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` (float32) rounded to e4m3 at `scale` and back: exact in bf16 where `scale` is a
    power of two."""
    return to_e4m3(x, scale).float() * scale


def bf16_latents(shape) -> torch.Tensor:
    """The shape's cache as bf16 (an fp8 cache dequantized with its scale)."""
    if shape.kv_scale is None:
        return shape.kv
    return (shape.kv.float() * shape.kv_scale).to(torch.bfloat16)


def flashmla_kwargs(shape, kv: torch.Tensor | None = None) -> dict:
    """flash_mla_with_kvcache's arguments as vLLM's FlashMLAImpl.forward_mqa passes them
    (bf16 cache: `kv`, by default the shape's), less the scheduler metadata: the query
    as [B, q_len, H, 576] (reshape_query_for_spec_decode), the cache with its head axis
    ([blocks, 64, 1, 576]), the request block table and seq_lens (int32), causal."""
    b, ql, h = shape.batch, shape.q_len, shape.heads
    return dict(
        q=shape.q.view(b, ql, h, LORA + ROPE),
        k_cache=(shape.kv if kv is None else kv).unsqueeze(-2),
        block_table=shape.meta.block_table,
        cache_seqlens=shape.meta.seq_lens,
        head_dim_v=LORA,
        softmax_scale=shape.scale,
        causal=True,
        is_fp8_kvcache=False,
    )


def flashmla_fp8_kwargs(shape) -> dict:
    """flash_mla_with_kvcache_fp8's arguments as vLLM's FlashMLAImpl.forward_mqa passes them
    for an fp8 cache, less the scheduler metadata and split counts: the query quantized to
    e4m3 at Q_FP8_SCALE (as vLLM quantizes it with the layer's q scale; exact here, the
    shape's query lies on that grid), the fp8 cache with its head axis, and descale_q /
    descale_k, the query's and the cache's scales as one-element float32 tensors."""
    b, ql, h = shape.batch, shape.q_len, shape.heads
    return dict(
        q=to_e4m3(shape.q, Q_FP8_SCALE).view(b, ql, h, LORA + ROPE),
        k_cache=shape.kv.unsqueeze(-2),
        block_table=shape.meta.block_table,
        cache_seqlens=shape.meta.seq_lens,
        head_dim_v=LORA,
        softmax_scale=shape.scale,
        causal=True,
        descale_q=torch.full((1,), Q_FP8_SCALE, dtype=torch.float32, device=shape.q.device),
        descale_k=shape.kv_scale.reshape(1).float(),
    )


def fa3_mla_kwargs(shape, num_splits: int) -> dict:
    """flash_attn_varlen_func's arguments as vLLM's FlashAttnMLAImpl.forward_mqa passes them
    (bf16 cache, no decode context parallelism), less scheduler_metadata: the rope part of
    the query as q [T, H, 64] (a view, as vLLM splits it off the wider query) and the latent
    part as q_v [T, H, 512] (contiguous, as vLLM's W_UK bmm writes it); k and v the rope and
    latent columns of the cache with a head axis of 1 ([blocks, 64, 1, 64] and
    [blocks, 64, 1, 512] views); causal, no LSE; `num_splits` the builder's split cap.
    cp_world_size, cp_rank and cp_tot_seqused_k keep their defaults (1, 0, None), what vLLM
    passes without decode context parallelism."""
    meta = shape.meta
    return dict(
        q=shape.q[..., LORA:],
        k=shape.kv[..., LORA:].unsqueeze(-2),
        v=shape.kv[..., :LORA].unsqueeze(-2),
        q_v=shape.q[..., :LORA].contiguous(),
        max_seqlen_q=max(meta.max_query_len, 1),
        cu_seqlens_q=meta.query_start_loc,
        max_seqlen_k=meta.max_seq_len,
        seqused_k=meta.seq_lens,
        block_table=meta.block_table,
        softmax_scale=shape.scale,
        causal=True,
        return_softmax_lse=False,
        fa_version=3,
        num_splits=num_splits,
    )


def fa3_mla_scheduler_kwargs(shape, num_splits: int) -> dict:
    """get_scheduler_metadata's arguments as vLLM's FlashAttnMLAMetadataBuilder passes them
    (`_schedule_decode`): one KV head, head size the rope width (64), value head size the
    latent width (512), the cache's dtype and block size, causal, `num_splits` the split cap
    (`flash_attn_max_num_splits_for_cuda_graph` for batches under full CUDA graphs)."""
    meta = shape.meta
    return dict(
        batch_size=meta.num_reqs,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        num_heads_q=shape.heads,
        num_heads_kv=1,
        headdim=ROPE,
        cache_seqlens=meta.seq_lens,
        qkv_dtype=shape.kv.dtype,
        headdim_v=LORA,
        page_size=shape.kv.shape[1],
        cu_seqlens_q=meta.query_start_loc,
        causal=True,
        num_splits=num_splits,
    )


def mha_pool_tokens(decode_shapes, prefill_shapes, block_size=MHA_BLOCK_SIZE) -> int:
    """Cache rows one pool needs to hold the largest case's blocks."""
    need = [b * -(-c // block_size) for b, c in (*decode_shapes, *prefill_shapes)]
    return max(need, default=1) * block_size


def pool_tokens(cases, block_size=MHA_BLOCK_SIZE) -> int:
    """Cache rows one pool needs for the largest of `cases` (decode (batch, context)
    pairs and PrefillCases)."""
    pairs = [(c.requests, c.seq_len) if isinstance(c, PrefillCase) else c for c in cases]
    return mha_pool_tokens(pairs, (), block_size)


def peaked_mha_query(tokens: int, device="cuda", heads: Heads = DEFAULT_HEADS) -> torch.Tensor:
    std = peaked_std(heads.d, heads.scale)
    return (torch.randn(tokens, heads.q, heads.d, device=device) * std).to(DTYPE)


def varlen_args(pool, meta, q, out) -> dict:
    """The arguments FA3's and vLLM's Triton varlen calls share: the paged bf16 cache, the
    step's lengths and table, causal, softmax scale head_size^-0.5, no alibi, no softcap."""
    return dict(
        q=q,
        k=pool.key_cache,
        v=pool.value_cache,
        out=out,
        cu_seqlens_q=meta.query_start_loc,
        max_seqlen_q=meta.max_query_len,
        seqused_k=meta.seq_lens,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=q.shape[-1] ** -0.5,
        causal=True,
        alibi_slopes=None,
        block_table=meta.block_table,
        softcap=0,
    )


def fa3_kwargs(pool, meta, q, out, num_splits: int) -> dict:
    """flash_attn_varlen_func's arguments as vLLM's FlashAttentionImpl.forward passes them
    (bf16 cache, no window, no softcap, no sinks), less scheduler_metadata; softmax scale
    head_size^-0.5. A chunked prefill is the same call: cu_seqlens_q counts the new
    tokens, seqused_k the full lengths. The descales vLLM passes are left out: FA3 reads
    them for fp8 inputs only."""
    return dict(
        varlen_args(pool, meta, q, out),
        window_size=[-1, -1],
        fa_version=3,
        num_splits=num_splits,
        s_aux=None,
    )


def fa3_scheduler_kwargs(pool, meta, num_splits: int, num_heads_q: int = HQ) -> dict:
    """get_scheduler_metadata's arguments as vLLM's FlashAttentionMetadataBuilder passes
    them (`_get_scheduler_metadata`)."""
    return dict(
        batch_size=meta.num_reqs,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        num_heads_q=num_heads_q,
        num_heads_kv=pool.hkv,
        headdim=pool.d,
        cache_seqlens=meta.seq_lens,
        qkv_dtype=DTYPE,
        cu_seqlens_q=meta.query_start_loc,
        page_size=pool.block_size,
        causal=True,
        window_size=(-1, -1),
        num_splits=num_splits,
    )


def triton_scratch(num_heads_q, pool, min_grid_2d: int, segments: int, device) -> dict:
    """The 3D-kernel scratch and threshold vLLM's TritonAttentionMetadataBuilder makes
    once (vllm/v1/attention/backends/triton_attn.py): threshold MIN_LAUNCH_GRID_SIZE_2D //
    KV heads (16 at 8 KV heads, 32 at 4: both CUDA-graph capture sizes, so the snap to
    the nearest capture size under full graphs keeps it), NUM_PAR_SOFTMAX_SEGMENTS
    segments, float32 buffers of that many tokens."""
    rows = min_grid_2d // pool.hkv
    padded = 1 << (pool.d - 1).bit_length()
    f32 = dict(dtype=torch.float32, device=device)
    return dict(
        seq_threshold_3D=rows,
        num_par_softmax_segments=segments,
        softmax_segm_output=torch.empty(rows, num_heads_q, segments, padded, **f32),
        softmax_segm_max=torch.empty(rows, num_heads_q, segments, **f32),
        softmax_segm_expsum=torch.empty(rows, num_heads_q, segments, **f32),
    )


def triton_kwargs(pool, meta, q, out, scratch: dict) -> dict:
    """vLLM's `unified_attention` arguments as TritonAttentionImpl.forward passes them
    (bf16 cache, no window: sliding_window (-1, -1), softcap 0, no alibi, sinks or
    output scale; k/v descales: the layer's unit scales expanded to [requests, KV heads],
    read only for fp8 caches); the 3D split path runs for decode batches up to the
    threshold in `scratch`."""
    descale = torch.ones(1, dtype=torch.float32, device=q.device).expand(meta.num_reqs, pool.hkv)
    return dict(
        varlen_args(pool, meta, q, out),
        window_size=(-1, -1),
        q_descale=None,
        k_descale=descale,
        v_descale=descale,
        sinks=None,
        output_scale=None,
        **scratch,
    )


# ---------------------------------------------------------------- calls


def plugin_mla_call(shape, plan, out):
    """The plugin's MLA decode on `shape` (as the ATOM_AITER_MLA backend runs it, with the
    step's `plan`); the call returns `out`."""
    from atom_plugin.attention.mla import ops as mla_ops

    def call():
        mla_ops.mla_decode(
            shape.q,
            shape.kv,
            shape.meta,
            scale=shape.scale,
            output=out,
            kv_lora_rank=LORA,
            plan=plan,
            kv_scale=shape.kv_scale,
        )
        return out

    return call


def _require_flashmla_dense() -> None:
    """Raises where vLLM's build has no dense FlashMLA (its reason in the message)."""
    from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

    ok, why = is_flashmla_dense_supported()
    if not ok:
        raise RuntimeError(f"FlashMLA dense unsupported: {why}")


def flashmla_call(shape, kv: torch.Tensor | None = None):
    """FlashMLA on `shape` (over `kv`, a bf16 cache, when given) as vLLM's FLASHMLA
    backend calls it; the call returns the output as [tokens, heads, 512]. The
    tile-scheduler metadata is vLLM's FlashMLAMetadataBuilder._build_decode's; the first
    call fills it."""
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    _require_flashmla_dense()
    b, ql, h = shape.batch, shape.q_len, shape.heads
    kw = flashmla_kwargs(shape, kv)
    sched, _ = get_mla_metadata(shape.meta.seq_lens, ql * h, 1, is_fp8_kvcache=False)

    def call():
        o, _lse = flash_mla_with_kvcache(tile_scheduler_metadata=sched, **kw)
        return o.reshape(b * ql, h, LORA)  # [B, q_len, H, 512] -> tokens

    return call


def flashmla_fp8_call(shape):
    """FlashMLA's fp8 path on `shape` (an fp8 cache) as vLLM's FLASHMLA backend calls it
    for an fp8 KV cache: the dense fp8 tile-scheduler metadata and split counts made once
    (as its metadata builder makes them a step); the call returns [tokens, heads, 512]."""
    if shape.kv_scale is None:
        raise ValueError(f"FlashMLA's fp8 path takes an fp8 cache, not {shape.kv.dtype}")
    from vllm.v1.attention.ops.flashmla import (
        flash_mla_with_kvcache_fp8,
        get_mla_metadata_dense_fp8,
    )

    _require_flashmla_dense()
    b, ql, h = shape.batch, shape.q_len, shape.heads
    kw = flashmla_fp8_kwargs(shape)
    sched, splits = get_mla_metadata_dense_fp8(shape.meta.seq_lens, ql * h, 1)

    def call():
        o, _lse = flash_mla_with_kvcache_fp8(tile_scheduler_metadata=sched, num_splits=splits, **kw)
        return o.reshape(b * ql, h, LORA)

    return call


def fa3_mla_call(shape, num_splits: int):
    """FA3 with q_v on `shape` (a bf16 cache) as vLLM's FLASH_ATTN_MLA backend calls it,
    with the scheduler metadata its metadata builder makes once a step (made here, before
    any call); the call returns the output as [tokens, heads, 512]."""
    if shape.kv.dtype != torch.bfloat16:
        raise ValueError(f"FA3 MLA takes a bf16 cache here, not {shape.kv.dtype}")
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    sched = get_scheduler_metadata(**fa3_mla_scheduler_kwargs(shape, num_splits))
    kw = fa3_mla_kwargs(shape, num_splits)
    return lambda: flash_attn_varlen_func(scheduler_metadata=sched, **kw)


def mha_meta(pool, reqs, seed: int = 0):
    """`pool.meta(reqs)` with the step's MHA plan, made as the metadata builder makes it
    (once per step, before the layers run)."""
    from atom_plugin.attention.mha.planner import plan_for_caches

    meta = pool.meta(reqs, seed=seed)
    meta.plan = plan_for_caches(meta, pool.key_cache)
    return meta


def plugin_mha_call(pool, meta, q, out):
    """The plugin's ops.paged_attention (the ATOM_AITER backend's entry) over a `meta`
    made by `mha_meta`; returns `out`."""
    from atom_plugin.attention.mha import ops
    from atom_plugin.attention.mha.params import AttentionParams

    params = AttentionParams(scale=q.shape[-1] ** -0.5)

    def call():
        ops.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, out)
        return out

    return call


def fa3_call(pool, meta, q, num_splits: int):
    """FA3 as vLLM's FLASH_ATTN backend calls it, with the scheduler metadata its metadata
    builder makes once a step (made here, before any call); the call returns its output."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    sched = get_scheduler_metadata(**fa3_scheduler_kwargs(pool, meta, num_splits, q.shape[1]))
    out = torch.empty_like(q)
    kw = fa3_kwargs(pool, meta, q, out, num_splits)

    def call():
        flash_attn_varlen_func(scheduler_metadata=sched, **kw)
        return out

    return call


def triton_call(pool, meta, q):
    """vLLM's Triton kernel (`unified_attention`, the TRITON_ATTN backend's) with the
    scratch its metadata builder makes once; the call returns its output."""
    from vllm.v1.attention.backends.triton_attn import (
        MIN_LAUNCH_GRID_SIZE_2D,
        NUM_PAR_SOFTMAX_SEGMENTS,
    )
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    scratch = triton_scratch(
        q.shape[1], pool, MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS, q.device
    )
    out = torch.empty_like(q)
    kw = triton_kwargs(pool, meta, q, out, scratch)

    def call():
        unified_attention(**kw)
        return out

    return call


# ---------------------------------------------------------------- checks


class OutputMismatch(AssertionError):
    pass


def assert_close(got, want, what: str, atol: float = ATOL, rtol: float = RTOL) -> float:
    """Raise OutputMismatch unless every element is finite and |got - want| <= atol +
    rtol * |want|; returns the largest absolute difference."""
    if tuple(got.shape) != tuple(want.shape):
        raise OutputMismatch(f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}")
    g, w = got.float(), want.float()
    if not (torch.isfinite(g).all() and torch.isfinite(w).all()):
        raise OutputMismatch(f"{what}: non-finite values")
    diff = (g - w).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    bad = int((diff > atol + rtol * w.abs()).sum())
    if bad:
        raise OutputMismatch(
            f"{what}: {bad} of {diff.numel()} elements beyond {atol:g} + {rtol:g}*abs(ref) "
            f"(max abs diff {worst:.3g})"
        )
    return worst


def short_error(exc: BaseException, n: int = 240) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("|", "/").replace("\n", " ")
    return text[:n]
