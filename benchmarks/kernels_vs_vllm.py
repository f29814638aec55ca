"""The plugin's attention kernels beside vLLM's strongest ones, on the same inputs in one run.

Three families, each timed beside a vLLM kernel called as vLLM's backend calls it:

* MLA decode: `mla_ops.mla_decode` with the per-step plan `plan_mla_decode` builds (as the
  ATOM_AITER_MLA backend runs it) against FlashMLA (`flash_mla_with_kvcache`, as vLLM's
  FLASHMLA backend calls it: q [B, q_len, H, 576], cache [blocks, 64, 1, 576], causal,
  head_dim_v 512; the tile-scheduler metadata is filled by one call before timing, as the
  first layer of a step fills it for the others). bf16 cache, block size 64.
* MHA decode and causal fresh prefill: `ops.paged_attention` (the ATOM_AITER backend's
  entry) against FA3 `flash_attn_varlen_func(..., block_table=..., scheduler_metadata=...,
  fa_version=3)` as vLLM's FLASH_ATTN backend calls it, on one vLLM-layout cache
  ([blocks, Hkv, block_size, 2 * D] split into K/V views), block size 16, 32 query and
  8 KV heads, head size 128, bf16. The scheduler metadata is `get_scheduler_metadata`'s,
  made before timing as vLLM's metadata builder makes it once a step; decode uses the
  split cap vLLM sets under full CUDA graphs (32), prefill FA3's own heuristic (0).
* Physical anchors measured in the same run: device-to-device copy (GB/s, read + write)
  and a dense bf16 8192^3 matmul (TFLOP/s).

Every case checks the outputs first, by assertion (|a - b| <= atol + rtol * |b| on every
element, all finite): the plugin against vLLM, and both against the float32 torch
reference (`mla_reference.py`, `reference.py`) where the case is small enough. Queries
are scaled so the logits have a standard deviation of LOGIT_STD: attention is peaked,
so a dropped or misread block moves some row's output by far more than bf16 rounding.
A mismatch is a FAILED row; any other error (an API mismatch, an unsupported shape) is
an ERROR row with its message; the other cases still run. Exit status: 0 all ok,
1 some row FAILED, 3 some row ERROR (and none FAILED), 2 bad flags or no CUDA.

Timing: the median of 20 CUDA-graph replays timed with CUDA events, L2 flushed before
each (benchmarks/_timing.py); a kernel whose capture fails is timed eagerly and its row
says so. Progress goes to stderr; the tables to stdout and --out.

    python -m benchmarks.kernels_vs_vllm --out kernels_vs_vllm.md \\
        [--only mla,mha-decode,prefill,anchors] [--mla-heads 16,64,128] [--mla-qlens 1,2] \\
        [--mla-shapes 1x16K,8x4K,32x8K,128x4K] [--mha-shapes 1x32K,...] [--prefill 1x8K,4x2K]
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks import attention, attention_mla
from benchmarks._timing import L2Flusher, copy_bandwidth_gbps, graphed, matmul_tflops, time_us

LORA, ROPE, MLA_PAGE = attention_mla.LORA, attention_mla.ROPE, attention_mla.PAGE
HQ, HKV, D, DTYPE = attention.HQ, attention.HKV, attention.D, attention.DTYPE
MHA_SCALE = attention.SCALE
MHA_BLOCK_SIZE = 16  # vLLM's default block size with the plugin's MHA backend

FAMILIES = ("anchors", "mla", "mha-decode", "prefill")
MLA_HEADS = (16, 64, 128)
MLA_QLENS = (1, 2)
MLA_SHAPES = "1x16K,8x4K,32x8K,128x4K"
MHA_SHAPES = "1x32K,8x8K,32x4K,32x16K,128x1K,128x8K"
PREFILL_SHAPES = "1x8K,4x2K"  # requests x fresh tokens, causal
MAX_BATCH = 256
MAX_CONTEXT = 131072

LOGIT_STD = 3.0  # logits' standard deviation: a few keys carry most of each row's weight
ATOL, RTOL = 3e-2, 2e-2  # bf16 outputs of kernels that round P to bf16
REFERENCE_MAX_KEYS = 65536  # float32 reference checks where batch * context is at most this
REFERENCE_MAX_LOGITS = 1 << 28  # ... and one request's logits fit in 1 GiB of float32
FA3_DECODE_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph default


# ---------------------------------------------------------------- flags


def parse_size(token: str, flag: str) -> int:
    """A positive count: '4096', or with a K suffix '4K' (x 1024)."""
    text = token.strip()
    mult = 1
    if text[-1:] in ("k", "K"):
        text, mult = text[:-1], 1024
    if not text.isdigit() or int(text) * mult <= 0:
        raise ValueError(f"{flag}: {token!r} is not a positive count (e.g. 4096 or 4K)")
    return int(text) * mult


def parse_shapes(
    text: str, flag: str, *, max_batch: int = MAX_BATCH, max_context: int = MAX_CONTEXT
) -> tuple[tuple[int, int], ...]:
    """'8x4K,32x16384' -> ((8, 4096), (32, 16384)): batch x context (or x fresh tokens)."""
    shapes = []
    for token in text.split(","):
        parts = token.strip().lower().split("x")
        try:
            if len(parts) != 2:
                raise ValueError("two counts")
            batch, context = parse_size(parts[0], flag), parse_size(parts[1], flag)
        except ValueError:
            raise ValueError(
                f"{flag}: {token!r} is not BATCHxCONTEXT, two positive counts (e.g. 8x4K)"
            ) from None
        if batch > max_batch:
            raise ValueError(f"{flag}: batch {batch} in {token!r} exceeds {max_batch}")
        if context > max_context:
            raise ValueError(f"{flag}: context {context} in {token!r} exceeds {max_context}")
        shapes.append((batch, context))
    return tuple(shapes)


def parse_choices(text: str, flag: str, choices: tuple) -> tuple:
    """A comma list, each item one of `choices` (ints when the choices are ints)."""
    picked = []
    for token in text.split(","):
        token = token.strip()
        value: object = token
        if choices and isinstance(choices[0], int):
            value = int(token) if token.lstrip("-").isdigit() else token
        if value not in choices:
            names = ", ".join(str(c) for c in choices)
            raise ValueError(f"{flag}: {token!r} is not one of {names}")
        if value not in picked:
            picked.append(value)
    return tuple(picked)


@dataclass(frozen=True)
class Config:
    out: str | None
    families: tuple[str, ...]
    mla_heads: tuple[int, ...]
    mla_qlens: tuple[int, ...]
    mla_shapes: tuple[tuple[int, int], ...]
    mha_shapes: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int], ...]
    iters: int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels_vs_vllm", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {FAMILIES}")
    p.add_argument("--mla-heads", default=",".join(map(str, MLA_HEADS)), help="16, 64, 128")
    p.add_argument("--mla-qlens", default=",".join(map(str, MLA_QLENS)), help="1, 2")
    p.add_argument("--mla-shapes", default=MLA_SHAPES, help="BATCHxCONTEXT list (K = 1024)")
    p.add_argument("--mha-shapes", default=MHA_SHAPES, help="BATCHxCONTEXT list (decode)")
    p.add_argument("--prefill", default=PREFILL_SHAPES, help="REQUESTSxTOKENS list (fresh)")
    p.add_argument("--iters", type=int, default=20, help="timed replays per kernel (median)")
    return p


def parse_args(argv=None) -> Config:
    """The run's configuration; a bad value exits with argparse's usage error naming it."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        if a.iters < 1:
            raise ValueError(f"--iters: {a.iters} must be at least 1")
        cfg = Config(
            out=a.out,
            families=parse_choices(a.only, "--only", FAMILIES),
            mla_heads=parse_choices(a.mla_heads, "--mla-heads", MLA_HEADS),
            mla_qlens=parse_choices(a.mla_qlens, "--mla-qlens", MLA_QLENS),
            mla_shapes=parse_shapes(a.mla_shapes, "--mla-shapes"),
            mha_shapes=parse_shapes(a.mha_shapes, "--mha-shapes"),
            prefill=parse_shapes(a.prefill, "--prefill", max_batch=64, max_context=32768),
            iters=a.iters,
        )
    except ValueError as exc:
        p.error(str(exc))
    return cfg


# ---------------------------------------------------------------- accounting


def mla_flops(batch: int, context: int, heads: int, q_len: int) -> int:
    """2 * query tokens per request * sum of contexts * heads * (576 + 512)."""
    return 2 * q_len * batch * context * heads * ((LORA + ROPE) + LORA)


def mla_bytes(batch: int, context: int, heads: int, q_len: int, elem: int = 2) -> int:
    """Latent rows read once per request, plus the queries read and the outputs written."""
    kv = batch * context * (LORA + ROPE)
    q = batch * q_len * heads * (LORA + ROPE)
    o = batch * q_len * heads * LORA
    return (kv + q + o) * elem


def mha_decode_flops(batch: int, context: int) -> int:
    """q.k and p.v: 4 * query heads * head size per key, one query token per request."""
    return 4 * HQ * D * batch * context


def mha_decode_bytes(batch: int, context: int, elem: int = 2) -> int:
    """K and V rows read once per request, plus the queries read and the outputs written."""
    return (2 * batch * context * HKV * D + 2 * batch * HQ * D) * elem


def prefill_reqs(requests: int, tokens: int) -> list[tuple[int, int]]:
    """`requests` fresh prompts of `tokens` each, as (query_len, seq_len) pairs."""
    return [(tokens, tokens)] * requests


def causal_pairs(reqs) -> int:
    """(query, key) pairs a causal pass computes: query j of q_len new tokens over a
    context s sees s - q_len + j + 1 keys."""
    return sum(ql * (s - ql) + ql * (ql + 1) // 2 for ql, s in reqs)


def prefill_flops(reqs) -> int:
    return 4 * HQ * D * causal_pairs(reqs)


def rate(amount: float, us: float | None, unit: float) -> float | None:
    """amount per second in `unit`s (1e9: GB/s, 1e12: TFLOP/s) for a call of `us`."""
    return None if not us else amount / (us * 1e-6) / unit


# ---------------------------------------------------------------- inputs


def peaked_std(dim: int, scale: float, logit_std: float = LOGIT_STD) -> float:
    """Query standard deviation giving logits (q.k * scale, keys N(0, 1) over `dim`)
    the standard deviation `logit_std`."""
    return logit_std / (math.sqrt(dim) * scale)


def make_mla_shape(batch, context, heads, q_len, device="cuda", seed=0):
    """attention_mla.Shape (bf16 cache, block 64, shuffled tables) with peaked queries."""
    torch.manual_seed(seed)
    shape = attention_mla.Shape(batch, context, heads, q_len, "bf16", device)
    std = peaked_std(LORA + ROPE, shape.scale)
    shape.q = (torch.randn(shape.q.shape, device=device) * std).to(shape.q.dtype)
    return shape


def flashmla_kwargs(shape) -> dict:
    """flash_mla_with_kvcache's arguments as vLLM's FlashMLAImpl.forward_mqa passes them
    (bf16 cache), less the scheduler metadata: the query as [B, q_len, H, 576]
    (reshape_query_for_spec_decode), the cache with its head axis ([blocks, 64, 1, 576]),
    the request block table and seq_lens (int32), causal."""
    b, ql, h = shape.batch, shape.q_len, shape.heads
    return dict(
        q=shape.q.view(b, ql, h, LORA + ROPE),
        k_cache=shape.kv.unsqueeze(-2),
        block_table=shape.meta.block_table,
        cache_seqlens=shape.meta.seq_lens,
        head_dim_v=LORA,
        softmax_scale=shape.scale,
        causal=True,
        is_fp8_kvcache=False,
    )


def mha_pool_tokens(decode_shapes, prefill_shapes, block_size=MHA_BLOCK_SIZE) -> int:
    """Cache rows one pool needs to hold the largest case's blocks."""
    need = [b * -(-c // block_size) for b, c in (*decode_shapes, *prefill_shapes)]
    return max(need, default=1) * block_size


def peaked_mha_query(tokens: int, device="cuda") -> torch.Tensor:
    std = peaked_std(D, MHA_SCALE)
    return (torch.randn(tokens, HQ, D, device=device) * std).to(DTYPE)


def fa3_kwargs(pool, meta, q, out, num_splits: int) -> dict:
    """flash_attn_varlen_func's arguments as vLLM's FlashAttentionImpl.forward passes them
    (bf16 cache, no window, no softcap, no sinks), less scheduler_metadata. The descales
    vLLM passes are left out: FA3 reads them for fp8 inputs only."""
    return dict(
        q=q,
        k=pool.key_cache,
        v=pool.value_cache,
        out=out,
        cu_seqlens_q=meta.query_start_loc,
        max_seqlen_q=meta.max_query_len,
        seqused_k=meta.seq_lens,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=MHA_SCALE,
        causal=True,
        alibi_slopes=None,
        window_size=[-1, -1],
        block_table=meta.block_table,
        softcap=0,
        fa_version=3,
        num_splits=num_splits,
        s_aux=None,
    )


def fa3_scheduler_kwargs(pool, meta, num_splits: int) -> dict:
    """get_scheduler_metadata's arguments as vLLM's FlashAttentionMetadataBuilder passes
    them (`_get_scheduler_metadata`)."""
    return dict(
        batch_size=meta.num_reqs,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        num_heads_q=HQ,
        num_heads_kv=HKV,
        headdim=D,
        cache_seqlens=meta.seq_lens,
        qkv_dtype=DTYPE,
        cu_seqlens_q=meta.query_start_loc,
        page_size=pool.block_size,
        causal=True,
        window_size=(-1, -1),
        num_splits=num_splits,
    )


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


def _short(exc: BaseException, n: int = 240) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("|", "/").replace("\n", " ")
    return text[:n]


# ---------------------------------------------------------------- running


_T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def timed(fn, flush, iters: int = 20) -> tuple[float, str]:
    """Median us of `fn` replayed from a CUDA graph (eagerly when capture fails)."""
    run = graphed(fn)
    mode = "graph" if run is not fn else "eager (capture failed)"
    return time_us(run, flush=flush, iters=iters, graph=False), mode


def _side(row: dict, name: str, fn, flush, iters) -> torch.Tensor | None:
    """Run `fn` (returns its output), then time it; errors land in row[name + '_error']."""
    try:
        out = fn().clone()
        torch.cuda.synchronize()
    except Exception as exc:
        row[f"{name}_error"] = _short(exc)
        progress(f"  {name} error: {row[f'{name}_error']}")
        return None
    try:
        row[f"{name}_us"], row[f"{name}_timing"] = timed(fn, flush, iters)
    except Exception as exc:  # ran, but timing failed: still compare the output
        row[f"{name}_error"] = f"timing: {_short(exc)}"
        progress(f"  {name} timing error: {row[f'{name}_error']}")
    return out


def max_abs_diff(a, b) -> float | None:
    if tuple(a.shape) != tuple(b.shape) or a.numel() == 0:
        return None
    return (a.float() - b.float()).abs().max().item()


def _judge(row: dict, plugin_out, vllm_out, vllm_name: str, ref_fn=None) -> None:
    """Assert the two outputs close, and each close to the reference where one is
    computed; every check runs, so a FAILED row says which side is off. Sets
    row['status']: 'ok', 'FAILED: <each mismatch>' or 'ERROR: <each error>'."""
    sides = {"plugin": "plugin", "vllm": vllm_name}
    errors = [f"{name}: {row[f'{k}_error']}" for k, name in sides.items() if f"{k}_error" in row]
    pairs = []
    if plugin_out is not None and vllm_out is not None:
        pairs.append((plugin_out, vllm_out, f"plugin vs {vllm_name}"))
        row["maxdiff"] = max_abs_diff(plugin_out, vllm_out)
    if ref_fn is not None and (plugin_out is not None or vllm_out is not None):
        try:
            ref = ref_fn()
        except Exception as exc:  # the reference itself failed
            errors.append(f"reference: {_short(exc)}")
        else:
            outs = [
                (o, n) for o, n in ((plugin_out, "plugin"), (vllm_out, vllm_name)) if o is not None
            ]
            diffs = [max_abs_diff(o, ref) for o, _ in outs]
            row["ref_maxdiff"] = max((d for d in diffs if d is not None), default=None)
            pairs += [(o, ref, f"{n} vs fp32 reference") for o, n in outs]
    failures = []
    for got, want, what in pairs:
        try:
            assert_close(got, want, what)
        except OutputMismatch as exc:
            failures.append(str(exc))
    if failures:
        row["status"] = "FAILED: " + "; ".join(failures)
    elif errors:
        row["status"] = "ERROR: " + "; ".join(errors)
    else:
        row["status"] = "ok"


def mla_case(batch, context, heads, q_len, flush, iters=20) -> dict:
    from atom_plugin.backends import mla_ops

    row = {"heads": heads, "q_len": q_len, "batch": batch, "context": context}
    row["flops"] = mla_flops(batch, context, heads, q_len)
    row["bytes"] = mla_bytes(batch, context, heads, q_len)
    shape = make_mla_shape(batch, context, heads, q_len, seed=batch * 131 + heads + q_len)
    out = shape.new_out()
    plan = None
    try:
        plan = shape.plan()
        row["kernel"] = attention_mla.kernel_name(plan.launch)
    except Exception as exc:
        row["plugin_error"] = f"plan: {_short(exc)}"

    def plugin():
        mla_ops.mla_decode(
            shape.q,
            shape.kv,
            shape.meta,
            scale=shape.scale,
            output=out,
            kv_lora_rank=LORA,
            plan=plan,
        )
        return out

    plugin_out = _side(row, "plugin", plugin, flush, iters) if plan is not None else None

    def vllm_side():
        from vllm.v1.attention.ops.flashmla import (
            flash_mla_with_kvcache,
            get_mla_metadata,
            is_flashmla_dense_supported,
        )

        ok, why = is_flashmla_dense_supported()
        if not ok:
            raise RuntimeError(f"FlashMLA dense unsupported: {why}")
        kw = flashmla_kwargs(shape)
        # vLLM's FlashMLAMetadataBuilder._build_decode; the first call below fills it
        sched, _ = get_mla_metadata(shape.meta.seq_lens, q_len * heads, 1, is_fp8_kvcache=False)

        def call():
            o, _lse = flash_mla_with_kvcache(tile_scheduler_metadata=sched, **kw)
            return o.reshape(batch * q_len, heads, LORA)  # [B, q_len, H, 512] -> tokens

        return call

    vllm_out = None
    try:
        call = vllm_side()
    except Exception as exc:
        row["vllm_error"] = _short(exc)
        progress(f"  FlashMLA error: {row['vllm_error']}")
    else:
        vllm_out = _side(row, "vllm", call, flush, iters)

    ref_fn = None
    if batch * context <= REFERENCE_MAX_KEYS:

        def ref_fn():
            from atom_plugin.backends.mla_reference import mla_decode_reference

            ref = torch.zeros(
                batch * q_len, heads, LORA, dtype=torch.float32, device=shape.q.device
            )
            mla_decode_reference(
                shape.q, shape.kv, shape.meta, scale=shape.scale, output=ref, kv_lora_rank=LORA
            )
            return ref

    _judge(row, plugin_out, vllm_out, "FlashMLA", ref_fn)
    return row  # the caller empties the allocator cache once the inputs are gone


def _fa3_call(pool, meta, q, num_splits):
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    # vLLM's FlashAttentionMetadataBuilder: once a step, before the layers run
    sched = get_scheduler_metadata(**fa3_scheduler_kwargs(pool, meta, num_splits))
    out = torch.empty_like(q)
    kw = fa3_kwargs(pool, meta, q, out, num_splits)

    def call():
        flash_attn_varlen_func(scheduler_metadata=sched, **kw)
        return out

    return call


def mha_case(pool, reqs, flush, iters=20, num_splits=FA3_DECODE_SPLITS, seed=0) -> dict:
    """One MHA case over `reqs` [(query_len, seq_len)]: the plugin's paged_attention and
    FA3 on the same query and cache."""
    from atom_plugin.backends import ops

    row = {}
    torch.manual_seed(seed)
    meta = pool.meta(reqs, seed=seed)
    q = peaked_mha_query(meta.num_actual_tokens)
    out = torch.empty_like(q)

    def plugin():
        ops.paged_attention(q, pool.key_cache, pool.value_cache, meta, scale=MHA_SCALE, output=out)
        return out

    plugin_out = _side(row, "plugin", plugin, flush, iters)
    vllm_out = None
    try:
        call = _fa3_call(pool, meta, q, num_splits)
    except Exception as exc:
        row["vllm_error"] = _short(exc)
        progress(f"  FA3 error: {row['vllm_error']}")
    else:
        vllm_out = _side(row, "vllm", call, flush, iters)

    ref_fn = None
    biggest = max(ql * s for ql, s in reqs) * HQ
    if sum(s for _, s in reqs) <= REFERENCE_MAX_KEYS and biggest <= REFERENCE_MAX_LOGITS:

        def ref_fn():
            from atom_plugin.backends import reference

            ref = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            reference.paged_attention(
                q, pool.key_cache, pool.value_cache, meta, scale=MHA_SCALE, output=ref
            )
            return ref

    _judge(row, plugin_out, vllm_out, "FA3", ref_fn)
    return row  # the caller empties the allocator cache once the inputs are gone


# ---------------------------------------------------------------- tables


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _status_cell(r: dict) -> str:
    return r.get("status", "ERROR: not run").replace("|", "/")


def _timing_cell(r: dict) -> str:
    modes = {r.get("plugin_timing"), r.get("vllm_timing")} - {None}
    return " / ".join(sorted(modes)) or "-"


def _us_cell(r: dict, side: str) -> str:
    if f"{side}_us" in r:
        return f"{r[f'{side}_us']:.1f}"
    return "error" if f"{side}_error" in r else "-"


def _ratio(r: dict) -> float | None:
    if r.get("plugin_us") and r.get("vllm_us"):
        return r["plugin_us"] / r["vllm_us"]
    return None


def _diff_cells(r: dict) -> str:
    return f"{_fmt(r.get('maxdiff'), '.2e')} | {_fmt(r.get('ref_maxdiff'), '.2e')}"


def mla_table(rows, copy_gbps: float | None) -> str:
    lines = [
        "| heads | q/req | batch | context | plugin kernel | plugin us | FlashMLA us "
        "| plugin/FlashMLA | plugin TFLOP/s | FlashMLA TFLOP/s | plugin GB/s | FlashMLA GB/s "
        "| plugin of copy | max abs diff | vs fp32 ref | timing | status |",
        "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in rows:
        pg = rate(r["bytes"], r.get("plugin_us"), 1e9)
        vg = rate(r["bytes"], r.get("vllm_us"), 1e9)
        frac = pg / copy_gbps if pg and copy_gbps else None
        lines.append(
            f"| {r['heads']} | {r['q_len']} | {r['batch']} | {r['context']} | "
            f"{r.get('kernel', '-')} | {_us_cell(r, 'plugin')} | {_us_cell(r, 'vllm')} | "
            f"{_fmt(_ratio(r), '.2f')} | {_fmt(rate(r['flops'], r.get('plugin_us'), 1e12), '.0f')}"
            f" | {_fmt(rate(r['flops'], r.get('vllm_us'), 1e12), '.0f')} | {_fmt(pg, '.0f')} | "
            f"{_fmt(vg, '.0f')} | {_fmt(frac, '.1%')} | {_diff_cells(r)} | {_timing_cell(r)} | "
            f"{_status_cell(r)} |"
        )
    return "\n".join(lines)


def mha_decode_table(rows, copy_gbps: float | None) -> str:
    lines = [
        "| batch | context | plugin us | FA3 us | plugin/FA3 | plugin GB/s | FA3 GB/s "
        "| plugin of copy | FA3 of copy | plugin TFLOP/s | FA3 TFLOP/s | max abs diff "
        "| vs fp32 ref | timing | status |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in rows:
        pg = rate(r["bytes"], r.get("plugin_us"), 1e9)
        vg = rate(r["bytes"], r.get("vllm_us"), 1e9)
        pf = pg / copy_gbps if pg and copy_gbps else None
        vf = vg / copy_gbps if vg and copy_gbps else None
        lines.append(
            f"| {r['batch']} | {r['context']} | {_us_cell(r, 'plugin')} | {_us_cell(r, 'vllm')}"
            f" | {_fmt(_ratio(r), '.2f')} | {_fmt(pg, '.0f')} | {_fmt(vg, '.0f')} | "
            f"{_fmt(pf, '.1%')} | {_fmt(vf, '.1%')} | "
            f"{_fmt(rate(r['flops'], r.get('plugin_us'), 1e12), '.1f')} | "
            f"{_fmt(rate(r['flops'], r.get('vllm_us'), 1e12), '.1f')} | {_diff_cells(r)} | "
            f"{_timing_cell(r)} | {_status_cell(r)} |"
        )
    return "\n".join(lines)


def prefill_table(rows, matmul_rate: float | None) -> str:
    lines = [
        "| case | tokens | plugin us | FA3 us | plugin/FA3 | plugin TFLOP/s | FA3 TFLOP/s "
        "| plugin of matmul | FA3 of matmul | max abs diff | vs fp32 ref | timing | status |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for r in rows:
        pt = rate(r["flops"], r.get("plugin_us"), 1e12)
        vt = rate(r["flops"], r.get("vllm_us"), 1e12)
        pf = pt / matmul_rate if pt and matmul_rate else None
        vf = vt / matmul_rate if vt and matmul_rate else None
        lines.append(
            f"| {r['case']} | {r['tokens']} | {_us_cell(r, 'plugin')} | {_us_cell(r, 'vllm')} | "
            f"{_fmt(_ratio(r), '.2f')} | {_fmt(pt, '.0f')} | {_fmt(vt, '.0f')} | "
            f"{_fmt(pf, '.1%')} | {_fmt(vf, '.1%')} | {_diff_cells(r)} | {_timing_cell(r)} | "
            f"{_status_cell(r)} |"
        )
    return "\n".join(lines)


def anchors_table(anchors: dict) -> str:
    return "\n".join(
        [
            "| anchor | value | timing |",
            "|:---|---:|:---|",
            f"| device-to-device copy, 2 GiB (read + write) | "
            f"{_fmt(anchors.get('copy_gbps'), '.0f')} GB/s | CUDA events, eager, median of 10 |",
            f"| dense bf16 matmul 8192^3 | {_fmt(anchors.get('matmul_tflops'), '.0f')} TFLOP/s "
            f"| CUDA events, eager, median of 10 |",
        ]
        + [f"| {k} | error | {v} |" for k, v in anchors.get("errors", {}).items()]
    )


def exit_status(rows) -> int:
    """1 when some row FAILED its output check, else 3 when some row has an ERROR, else 0."""
    statuses = [r.get("status", "ERROR") for r in rows]
    if any(s.startswith("FAILED") for s in statuses):
        return 1
    if any(s != "ok" for s in statuses):
        return 3
    return 0


# ---------------------------------------------------------------- main


def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for mod in ("triton", "vllm"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception as exc:
            parts.append(f"{mod} unavailable ({_short(exc, 60)})")
    return ", ".join(parts)


def run(cfg: Config) -> tuple[str, int]:
    flush = L2Flusher()
    anchors: dict = {"errors": {}}
    progress(f"{torch.cuda.get_device_name()}; {_versions()}")
    for key, fn in (("copy_gbps", copy_bandwidth_gbps), ("matmul_tflops", matmul_tflops)):
        if "anchors" in cfg.families or key == "copy_gbps":
            try:
                anchors[key] = fn()
            except Exception as exc:
                anchors["errors"][key] = _short(exc)
    progress(
        f"anchors: copy {_fmt(anchors.get('copy_gbps'), '.0f')} GB/s, "
        f"matmul {_fmt(anchors.get('matmul_tflops'), '.0f')} TFLOP/s"
    )
    copy_gbps, mm = anchors.get("copy_gbps"), anchors.get("matmul_tflops")
    all_rows: list[dict] = [{"status": f"ERROR: {k}: {v}"} for k, v in anchors["errors"].items()]
    sections = []
    if "anchors" in cfg.families:
        sections.append("## Physical anchors (same run)\n\n" + anchors_table(anchors))

    if "mla" in cfg.families:
        cases = [
            (b, c, h, ql) for h in cfg.mla_heads for ql in cfg.mla_qlens for b, c in cfg.mla_shapes
        ]
        rows = []
        for i, (b, c, h, ql) in enumerate(cases, 1):
            progress(f"MLA [{i}/{len(cases)}] H={h} q/req={ql} B={b} ctx={c}")
            try:
                r = mla_case(b, c, h, ql, flush, cfg.iters)
            except Exception as exc:  # building the inputs failed
                r = {"heads": h, "q_len": ql, "batch": b, "context": c, "status": "ERROR: "}
                r.update(flops=mla_flops(b, c, h, ql), bytes=mla_bytes(b, c, h, ql))
                r["status"] += _short(exc)
            torch.cuda.empty_cache()
            progress(f"  -> {_line(r)}")
            rows.append(r)
        all_rows += rows
        sections.append(
            f"## MLA decode: plugin (mla_ops.mla_decode) vs FlashMLA (FLASHMLA backend)\n\n"
            f"bf16 cache, block {MLA_PAGE}, latent {LORA} + rope {ROPE}, softmax scale 192^-0.5, "
            f"causal over the request's last q/req positions. FLOP = 2 * q/req * sum(ctx) * "
            f"heads * (576 + 512); bytes = latent rows once + queries + outputs.\n\n"
            + mla_table(rows, copy_gbps)
        )

    pool = None
    want_mha = {"mha-decode", "prefill"} & set(cfg.families)
    if want_mha:
        dec = cfg.mha_shapes if "mha-decode" in cfg.families else ()
        pre = cfg.prefill if "prefill" in cfg.families else ()
        try:
            torch.manual_seed(1)
            pool = attention.KVPool(mha_pool_tokens(dec, pre), MHA_BLOCK_SIZE)
        except Exception as exc:
            sections.append(f"## MHA\n\nERROR building the KV pool: {_short(exc)}")
            all_rows.append({"status": "ERROR: KV pool"})
    if pool is not None and "mha-decode" in cfg.families:
        rows = []
        for i, (b, c) in enumerate(cfg.mha_shapes, 1):
            progress(f"MHA decode [{i}/{len(cfg.mha_shapes)}] B={b} ctx={c}")
            try:
                r = mha_case(pool, [(1, c)] * b, flush, cfg.iters, FA3_DECODE_SPLITS, b * 7 + c)
            except Exception as exc:
                r = {"status": f"ERROR: {_short(exc)}"}
            torch.cuda.empty_cache()
            r.update(batch=b, context=c, flops=mha_decode_flops(b, c), bytes=mha_decode_bytes(b, c))
            progress(f"  -> {_line(r)}")
            rows.append(r)
        all_rows += rows
        sections.append(
            f"## MHA decode: plugin (ops.paged_attention) vs FA3 (FLASH_ATTN backend)\n\n"
            f"{HQ} query / {HKV} KV heads, head {D}, bf16, block {MHA_BLOCK_SIZE}, shuffled "
            f"tables; FA3 with scheduler metadata and num_splits={FA3_DECODE_SPLITS} (vLLM "
            f"under full CUDA graphs). Bytes = K and V rows once + queries + outputs.\n\n"
            + mha_decode_table(rows, copy_gbps)
        )
    if pool is not None and "prefill" in cfg.families:
        rows = []
        for i, (n, t) in enumerate(cfg.prefill, 1):
            name = f"{n} x {t} fresh"
            progress(f"prefill [{i}/{len(cfg.prefill)}] {name}")
            reqs = prefill_reqs(n, t)
            try:
                r = mha_case(pool, reqs, flush, cfg.iters, 0, n * 13 + t)
            except Exception as exc:
                r = {"status": f"ERROR: {_short(exc)}"}
            torch.cuda.empty_cache()
            r.update(case=name, tokens=n * t, flops=prefill_flops(reqs))
            progress(f"  -> {_line(r)}")
            rows.append(r)
        all_rows += rows
        sections.append(
            f"## Causal prefill: plugin (ops.paged_attention) vs FA3 (FLASH_ATTN backend)\n\n"
            f"{HQ} query / {HKV} KV heads, head {D}, bf16, block {MHA_BLOCK_SIZE}; K/V read "
            f"from the paged cache; FA3 num_splits=0 (its heuristic, as vLLM runs batches "
            f"above the CUDA-graph sizes). FLOP = 4 * {HQ} * {D} * causal (q, k) pairs.\n\n"
            + prefill_table(rows, mm)
        )
    del pool
    torch.cuda.empty_cache()

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"# Plugin kernels vs vLLM kernels\n\n{torch.cuda.get_device_name()}; {when}; "
        f"{_versions()}. Times: median of {cfg.iters} CUDA-graph replays (CUDA events, L2 "
        f"flushed before each); ratio > 1: the plugin is slower. Outputs asserted on every "
        f"row: |a - b| <= {ATOL:g} + {RTOL:g}*|b| (plugin vs vLLM, and vs the float32 torch "
        f"reference where batch * context <= {REFERENCE_MAX_KEYS}); queries scaled to logit "
        f"std {LOGIT_STD:g} (peaked attention)."
    )
    status = exit_status(all_rows)
    verdict = {0: "all rows ok", 1: "some rows FAILED", 3: "some rows hit errors"}[status]
    return head + "\n\n" + "\n\n".join(sections) + f"\n\nResult: {verdict}.\n", status


def _line(r: dict) -> str:
    ratio = _ratio(r)
    return (
        f"plugin {_us_cell(r, 'plugin')} us, vLLM {_us_cell(r, 'vllm')} us"
        f"{f', ratio {ratio:.2f}' if ratio else ''}, {r.get('status', '?')}"
    )


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    text, status = run(cfg)
    print(text)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.write(text)
        progress(f"wrote {cfg.out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
