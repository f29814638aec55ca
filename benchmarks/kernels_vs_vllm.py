"""The plugin's attention kernels beside vLLM's strongest ones, on the same inputs in one run.

Three families, each timed beside a vLLM kernel called as vLLM's backend calls it:

* MLA decode: `mla.ops.mla_decode` with the per-step plan `plan_mla_decode` builds (as the
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
reference (`mla.reference.py`, `reference.py`) where the case is small enough. Queries
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
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks import attention, attention_mla
from benchmarks._timing import L2Flusher, copy_bandwidth_gbps, graphed, matmul_tflops, time_us
from benchmarks.kernel_problems import (
    ATOL,
    HKV,
    HQ,
    LOGIT_STD,
    LORA,
    MHA_BLOCK_SIZE,
    MHA_SCALE,
    MLA_PAGE,
    ROPE,
    RTOL,
    D,
    OutputMismatch,
    assert_close,
    fa3_call,
    flashmla_call,
    make_mla_shape,
    mha_decode_bytes,
    mha_decode_flops,
    mha_meta,
    mha_pool_tokens,
    mla_bytes,
    mla_flops,
    peaked_mha_query,
    plugin_mha_call,
    plugin_mla_call,
    prefill_flops,
    prefill_reqs,
    short_error,
)
from benchmarks.kernel_tables import (
    anchors_table,
    exit_status,
    fmt,
    mha_decode_table,
    mla_table,
    prefill_table,
    ratio,
    us_cell,
)

FAMILIES = ("anchors", "mla", "mha-decode", "prefill")
MLA_HEADS = (16, 64, 128)
MLA_QLENS = (1, 2)
MLA_SHAPES = "1x16K,8x4K,32x8K,128x4K"
MHA_SHAPES = "1x32K,8x8K,32x4K,32x16K,128x1K,128x8K"
PREFILL_SHAPES = "1x8K,4x2K"  # requests x fresh tokens, causal
MAX_BATCH = 256
MAX_CONTEXT = 131072

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
        row[f"{name}_error"] = short_error(exc)
        progress(f"  {name} error: {row[f'{name}_error']}")
        return None
    try:
        row[f"{name}_us"], row[f"{name}_timing"] = timed(fn, flush, iters)
    except Exception as exc:  # ran, but timing failed: still compare the output
        row[f"{name}_error"] = f"timing: {short_error(exc)}"
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
            errors.append(f"reference: {short_error(exc)}")
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
        row["plugin_error"] = f"plan: {short_error(exc)}"

    plugin = plugin_mla_call(shape, plan, out)
    plugin_out = _side(row, "plugin", plugin, flush, iters) if plan is not None else None

    vllm_out = None
    try:
        call = flashmla_call(shape)
    except Exception as exc:
        row["vllm_error"] = short_error(exc)
        progress(f"  FlashMLA error: {row['vllm_error']}")
    else:
        vllm_out = _side(row, "vllm", call, flush, iters)

    ref_fn = None
    if batch * context <= REFERENCE_MAX_KEYS:

        def ref_fn():
            from atom_plugin.attention.mla.reference import mla_decode_reference

            ref = torch.zeros(
                batch * q_len, heads, LORA, dtype=torch.float32, device=shape.q.device
            )
            mla_decode_reference(
                shape.q, shape.kv, shape.meta, scale=shape.scale, output=ref, kv_lora_rank=LORA
            )
            return ref

    _judge(row, plugin_out, vllm_out, "FlashMLA", ref_fn)
    return row  # the caller empties the allocator cache once the inputs are gone


def mha_case(pool, reqs, flush, iters=20, num_splits=FA3_DECODE_SPLITS, seed=0) -> dict:
    """One MHA case over `reqs` [(query_len, seq_len)]: the plugin's paged_attention and
    FA3 on the same query and cache."""
    from atom_plugin.attention.mha.params import AttentionParams

    row = {}
    torch.manual_seed(seed)
    meta = mha_meta(pool, reqs, seed)
    params = AttentionParams(scale=MHA_SCALE)
    q = peaked_mha_query(meta.num_actual_tokens)
    out = torch.empty_like(q)

    plugin_out = _side(row, "plugin", plugin_mha_call(pool, meta, q, out), flush, iters)
    vllm_out = None
    try:
        call = fa3_call(pool, meta, q, num_splits)
    except Exception as exc:
        row["vllm_error"] = short_error(exc)
        progress(f"  FA3 error: {row['vllm_error']}")
    else:
        vllm_out = _side(row, "vllm", call, flush, iters)

    ref_fn = None
    biggest = max(ql * s for ql, s in reqs) * HQ
    if sum(s for _, s in reqs) <= REFERENCE_MAX_KEYS and biggest <= REFERENCE_MAX_LOGITS:

        def ref_fn():
            from atom_plugin.attention.mha import reference

            ref = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            reference.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, ref)
            return ref

    _judge(row, plugin_out, vllm_out, "FA3", ref_fn)
    return row  # the caller empties the allocator cache once the inputs are gone


# ---------------------------------------------------------------- main


def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for mod in ("triton", "vllm"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception as exc:
            parts.append(f"{mod} unavailable ({short_error(exc, 60)})")
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
                anchors["errors"][key] = short_error(exc)
    progress(
        f"anchors: copy {fmt(anchors.get('copy_gbps'), '.0f')} GB/s, "
        f"matmul {fmt(anchors.get('matmul_tflops'), '.0f')} TFLOP/s"
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
                r["status"] += short_error(exc)
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
            sections.append(f"## MHA\n\nERROR building the KV pool: {short_error(exc)}")
            all_rows.append({"status": "ERROR: KV pool"})
    if pool is not None and "mha-decode" in cfg.families:
        rows = []
        for i, (b, c) in enumerate(cfg.mha_shapes, 1):
            progress(f"MHA decode [{i}/{len(cfg.mha_shapes)}] B={b} ctx={c}")
            try:
                r = mha_case(pool, [(1, c)] * b, flush, cfg.iters, FA3_DECODE_SPLITS, b * 7 + c)
            except Exception as exc:
                r = {"status": f"ERROR: {short_error(exc)}"}
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
                r = {"status": f"ERROR: {short_error(exc)}"}
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
    time_ratio = ratio(r)
    return (
        f"plugin {us_cell(r, 'plugin')} us, vLLM {us_cell(r, 'vllm')} us"
        f"{f', ratio {time_ratio:.2f}' if time_ratio else ''}, {r.get('status', '?')}"
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
