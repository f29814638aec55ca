"""One row of `benchmarks.kernels_vs_vllm`: each side run once (its output kept), then
timed from a CUDA graph; the outputs asserted against each other and against the float32
reference where the case is small enough."""

from __future__ import annotations

import torch

from benchmarks._report import progress
from benchmarks._timing import graphed, time_us
from benchmarks.kernel_problems import (
    ATOL,
    LORA,
    RTOL,
    Heads,
    OutputMismatch,
    assert_close,
    bf16_latents,
    fa3_call,
    fa3_mla_call,
    flashmla_call,
    flashmla_fp8_call,
    make_mla_shape,
    mha_meta,
    peaked_mha_query,
    plugin_mha_call,
    plugin_mla_call,
    short_error,
    triton_call,
)

REFERENCE_MAX_KEYS = 65536  # float32 reference checks where batch * context is at most this
REFERENCE_MAX_LOGITS = 1 << 28  # ... and one request's logits fit in 1 GiB of float32
FA3_DECODE_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph default
# FlashMLA's fp8 path takes the query in e4m3 and multiplies in fp8; an fp8 P @ V rounds
# P to e4m3 (up to 6.25% of a weight), so its check is looser. Peaked attention keeps it
# a check: a misread block moves some output by far more.
FLASHMLA_FP8_TOL = (0.06, 0.08)


def timed(fn, flush, iters: int = 20) -> tuple[float, str]:
    """Median us of `fn` replayed from a CUDA graph (eagerly when capture fails)."""
    run = graphed(fn)
    mode = "graph" if run is not fn else "eager (capture failed)"
    return time_us(run, flush=flush, iters=iters, graph=False), mode


def _output(row: dict, key: str, fn) -> torch.Tensor | None:
    """`fn`'s output (a copy); an error lands in row[key + '_error']."""
    try:
        out = fn().clone()
        torch.cuda.synchronize()
    except Exception as exc:
        row[f"{key}_error"] = short_error(exc)
        progress(f"  {key} error: {row[f'{key}_error']}")
        return None
    return out


def _side(row: dict, key: str, fn, flush, iters) -> torch.Tensor | None:
    """Run `fn` (returns its output), then time it into row[key + '_us']."""
    out = _output(row, key, fn)
    if out is None:
        return None
    try:
        row[f"{key}_us"], row[f"{key}_timing"] = timed(fn, flush, iters)
    except Exception as exc:  # ran, but timing failed: still compare the output
        row[f"{key}_error"] = f"timing: {short_error(exc)}"
        progress(f"  {key} timing error: {row[f'{key}_error']}")
    return out


def _built(row: dict, key: str, build):
    """`build()` (a side's call, made before any run), or None with row[key + '_error']."""
    try:
        return build()
    except Exception as exc:
        row[f"{key}_error"] = short_error(exc)
        progress(f"  {key} error: {row[f'{key}_error']}")
        return None


def max_abs_diff(a, b) -> float | None:
    if tuple(a.shape) != tuple(b.shape) or a.numel() == 0:
        return None
    return (a.float() - b.float()).abs().max().item()


def judge(row: dict, outs: dict, ref_fn=None, tolerances: dict | None = None) -> None:
    """Assert the plugin's output close to each other side's, and every output close to
    the reference where one is computed; every check runs, so a FAILED row says which
    side is off. `outs`: row key -> (name, output or None), the plugin's first;
    `tolerances`: row key -> (atol, rtol) for the checks of that side (default ATOL, RTOL).
    Sets row['status']: 'ok', 'FAILED: <each mismatch>' or 'ERROR: <each error>'."""
    errors = [
        f"{name}: {row[f'{k}_error']}" for k, (name, _) in outs.items() if f"{k}_error" in row
    ]
    tol = {k: (tolerances or {}).get(k, (ATOL, RTOL)) for k in outs}
    (_, (_, plugin_out)), *others = outs.items()
    pairs, diffs = [], []
    for key, (name, out) in others:
        if plugin_out is not None and out is not None:
            pairs.append((plugin_out, out, f"plugin vs {name}", tol[key]))
            diffs.append(max_abs_diff(plugin_out, out))
    if diffs:
        row["maxdiff"] = max((d for d in diffs if d is not None), default=None)
    ran = [(o, n, tol[k]) for k, (n, o) in outs.items() if o is not None]
    if ref_fn is not None and ran:
        try:
            ref = ref_fn()
        except Exception as exc:  # the reference itself failed
            errors.append(f"reference: {short_error(exc)}")
        else:
            ref_diffs = [max_abs_diff(o, ref) for o, _, _ in ran]
            row["ref_maxdiff"] = max((d for d in ref_diffs if d is not None), default=None)
            pairs += [(o, ref, f"{n} vs fp32 reference", t) for o, n, t in ran]
    failures = []
    for got, want, what, (atol, rtol) in pairs:
        try:
            assert_close(got, want, what, atol, rtol)
        except OutputMismatch as exc:
            failures.append(str(exc))
    if failures:
        row["status"] = "FAILED: " + "; ".join(failures)
    elif errors:
        row["status"] = "ERROR: " + "; ".join(errors)
    else:
        row["status"] = "ok"


def mla_case(batch, context, heads, q_len, flush, iters=20, cache="bf16", shared=False) -> dict:
    """One MLA decode row. bf16: the plugin, FlashMLA and FA3 with q_v (vLLM's
    FLASH_ATTN_MLA backend, split cap FA3_DECODE_SPLITS as under full CUDA graphs), all
    timed. fp8: the plugin and FlashMLA's fp8 path (vLLM's FLASHMLA backend on an fp8
    cache) timed, the latter checked within FLASHMLA_FP8_TOL; FlashMLA over the cache
    dequantized to bf16 run once as a second check (FLASH_ATTN_MLA takes no fp8 cache:
    not run). `shared`: every request reads one context's blocks."""
    row = {"heads": heads, "q_len": q_len, "batch": batch, "context": context, "cache": cache}
    seed = batch * 131 + heads + q_len
    shape = make_mla_shape(batch, context, heads, q_len, seed=seed, cache=cache, shared=shared)
    out = shape.new_out()
    plan = None
    try:
        plan = shape.plan()
        row["kernel"] = plan.launch.name
    except Exception as exc:
        row["plugin_error"] = f"plan: {short_error(exc)}"

    plugin = plugin_mla_call(shape, plan, out)
    plugin_out = _side(row, "plugin", plugin, flush, iters) if plan is not None else None

    outs = {"plugin": ("plugin", plugin_out)}
    if cache == "bf16":
        call = _built(row, "vllm", lambda: flashmla_call(shape))
        outs["vllm"] = ("FlashMLA", _side(row, "vllm", call, flush, iters) if call else None)
        call = _built(row, "fa3_mla", lambda: fa3_mla_call(shape, FA3_DECODE_SPLITS))
        outs["fa3_mla"] = ("FA3-MLA", _side(row, "fa3_mla", call, flush, iters) if call else None)
    else:
        call = _built(row, "vllm", lambda: flashmla_fp8_call(shape))
        outs["vllm"] = ("FlashMLA fp8", _side(row, "vllm", call, flush, iters) if call else None)
        call = _built(row, "check", lambda: flashmla_call(shape, bf16_latents(shape)))
        check_out = _output(row, "check", call) if call else None
        outs["check"] = ("FlashMLA (dequantized bf16 cache)", check_out)

    ref_fn = None
    if batch * context <= REFERENCE_MAX_KEYS:

        def ref_fn():
            from atom_plugin.attention.mla.reference import mla_decode_reference

            ref = torch.zeros(
                batch * q_len, heads, LORA, dtype=torch.float32, device=shape.q.device
            )
            mla_decode_reference(
                shape.q,
                shape.kv,
                shape.meta,
                scale=shape.scale,
                output=ref,
                kv_lora_rank=LORA,
                kv_scale=shape.kv_scale,
            )
            return ref

    judge(row, outs, ref_fn, {"vllm": FLASHMLA_FP8_TOL} if cache == "fp8" else None)
    return row  # the caller empties the allocator cache once the inputs are gone


def mha_case(
    pool, reqs, flush, iters=20, num_splits=FA3_DECODE_SPLITS, seed=0, *, hq, triton=False
) -> dict:
    """One MHA row over `reqs` [(query_len, seq_len)] with `hq` query heads on `pool`:
    the plugin's paged_attention, FA3 and (`triton`) vLLM's Triton kernel on the same
    query and cache."""
    from atom_plugin.attention.mha.params import AttentionParams

    row: dict = {}
    heads = Heads(hq, pool.hkv, pool.d)
    torch.manual_seed(seed)
    meta = mha_meta(pool, reqs, seed)
    q = peaked_mha_query(meta.num_actual_tokens, heads=heads)
    out = torch.empty_like(q)

    plugin_out = _side(row, "plugin", plugin_mha_call(pool, meta, q, out), flush, iters)
    outs = {"plugin": ("plugin", plugin_out)}
    call = _built(row, "vllm", lambda: fa3_call(pool, meta, q, num_splits))
    outs["vllm"] = ("FA3", _side(row, "vllm", call, flush, iters) if call else None)
    if triton:
        call = _built(row, "triton", lambda: triton_call(pool, meta, q))
        outs["triton"] = ("vLLM Triton", _side(row, "triton", call, flush, iters) if call else None)

    ref_fn = None
    biggest = max(ql * s for ql, s in reqs) * hq
    if sum(s for _, s in reqs) <= REFERENCE_MAX_KEYS and biggest <= REFERENCE_MAX_LOGITS:

        def ref_fn():
            from atom_plugin.attention.mha import reference

            ref = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            params = AttentionParams(scale=heads.scale)
            reference.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, ref)
            return ref

    judge(row, outs, ref_fn)
    return row  # the caller empties the allocator cache once the inputs are gone
