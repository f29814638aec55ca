"""The MHA kernels' opt-in variants and config candidates beside FA3 on one GPU (issue 26).

Every prefill and decode candidate below runs on the same query and paged cache as FA3
(called as vLLM's FLASH_ATTN backend calls it); each output is asserted against FA3's,
and each time is the median of CUDA-graph replays after an L2 flush. A candidate that
fails to compile or launch is an ERROR row; past `--budget` seconds no new row starts.

    PYTHONPATH=$PWD python -m benchmarks.mha_variants --out mha_variants.md

Prints progress to stderr and one markdown table per family to stdout (and `--out`).
"""

from __future__ import annotations

import argparse
import sys
import time

from atom_plugin.attention.mha import triton_decode, triton_prefill

PREFILL_BASE = dict(BLOCK_Q=64, BLOCK_N=64, num_warps=16, num_stages=5)  # CUDA: the 2nd pick
BQ32 = dict(PREFILL_BASE, BLOCK_Q=32, num_warps=8)  # 128 rows, 8 warps
DECODE_BASE = dict(BLOCK_N=64, num_warps=4, num_stages=2)  # the production config until 0ac1006
GLUON = {"kernel": "gluon"}  # the Gluon Hopper prefill (mha.gluon_prefill), no Triton config

# (name, config); None: the production path (ops.paged_attention with the step's plan)
PREFILL_CANDIDATES = [
    ("default", None),
    ("base", PREFILL_BASE),
    # 128-row CTAs capped at 128 registers: two per SM, one's softmax beside the other's MMAs
    # (at 4 query heads per kv head, the Triton prefill's first CUDA config: the ops run it
    # where the Gluon one cannot)
    ("bq32 w8 s3 r128", dict(BQ32, num_stages=3, maxnreg=128)),
    ("gluon", GLUON),  # launched directly: what "default" runs on Hopper where a layer fits
]
DECODE_CANDIDATES = [
    ("default", None),
    ("base s3", dict(DECODE_BASE, num_stages=3)),
    ("table_blocks", dict(DECODE_BASE, table_blocks=True)),
    ("s3 table_blocks", dict(DECODE_BASE, num_stages=3, table_blocks=True)),
    ("bn128 table_blocks", dict(DECODE_BASE, BLOCK_N=128, table_blocks=True)),
    ("bn128 w8 table_blocks", dict(DECODE_BASE, BLOCK_N=128, num_warps=8, table_blocks=True)),
    ("bn32 w2 s4 table_blocks", dict(BLOCK_N=32, num_warps=2, num_stages=4, table_blocks=True)),
]
# name -> [(query_len, seq_len)] per request
PREFILL_CASES = {
    "1 x 8K fresh": [(8192, 8192)],
    "1 x 16K fresh": [(16384, 16384)],
    "4 x 2K fresh": [(2048, 2048)] * 4,
    "4 x 2K chunked over 6K": [(2048, 8192)] * 4,
}
DECODE_CASES = {
    "8 x 16K": [(1, 16384)] * 8,
    "32 x 4K": [(1, 4096)] * 32,
    "128 x 1K": [(1, 1024)] * 128,
    "1 x 32K": [(1, 32768)],
}
FA3_DECODE_SPLITS = 32  # vLLM's cap under full CUDA graphs (kernels_vs_vllm)
DOC_HEAD = (
    "Median of CUDA-graph replays, L2 flushed before each; `vs FA3` / `vs default`: time "
    "over FA3's / over the production path's (> 1 slower). Outputs asserted against FA3's."
)


def validate(candidates, valid_keys: tuple, required: tuple) -> None:
    """Raise ValueError unless names are unique, the first is the production path (None)
    and every other config has the `required` keys and only `valid_keys`."""
    names = [n for n, _ in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate candidate names in {names}")
    if not candidates or candidates[0][1] is not None:
        raise ValueError("the first candidate must be the production path (config None)")
    for name, cfg in candidates[1:]:
        if cfg is GLUON:
            continue
        missing = [k for k in required if k not in cfg]
        unknown = set(cfg) - set(valid_keys)
        if missing or unknown or cfg is None:
            raise ValueError(f"{name}: missing {missing}, unknown {sorted(unknown)}")


def validate_all() -> None:
    validate(PREFILL_CANDIDATES, triton_prefill.CONFIG_KEYS, tuple(PREFILL_BASE))
    validate(DECODE_CANDIDATES, triton_decode.CONFIG_KEYS, tuple(DECODE_BASE))


def pick(table: dict | list, text: str | None, flag: str):
    """The entries of `table` (a dict of cases or a candidate list) named in the
    comma-separated `text` (all when None), in the table's order."""
    names = list(table) if isinstance(table, dict) else [n for n, _ in table]
    if text is None:
        return table
    want = [t.strip() for t in text.split(",") if t.strip()]
    bad = [w for w in want if w not in names]
    if bad or not want:
        raise ValueError(f"{flag}: unknown {bad or text!r}; choose from {names}")
    if isinstance(table, dict):
        return {k: v for k, v in table.items() if k in want}
    return [c for c in table if c[0] in want or c[1] is None]  # always the default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the tables to this file")
    p.add_argument("--budget", type=float, default=240.0, help="seconds; no new row after")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--families", default="prefill,decode")
    p.add_argument("--prefill-cases", help="comma-separated PREFILL_CASES names")
    p.add_argument("--decode-cases", help="comma-separated DECODE_CASES names")
    p.add_argument("--prefill-variants", help="comma-separated candidate names")
    p.add_argument("--decode-variants", help="comma-separated candidate names")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        fams = [f.strip() for f in a.families.split(",") if f.strip()]
        if not fams or set(fams) - {"prefill", "decode"}:
            raise ValueError(f"--families: {a.families!r}; choose from prefill,decode")
        if a.budget <= 0 or a.iters < 1:
            raise ValueError("--budget and --iters must be positive")
        a.families = fams
        a.prefill_cases = pick(PREFILL_CASES, a.prefill_cases, "--prefill-cases")
        a.decode_cases = pick(DECODE_CASES, a.decode_cases, "--decode-cases")
        a.prefill_variants = pick(PREFILL_CANDIDATES, a.prefill_variants, "--prefill-variants")
        a.decode_variants = pick(DECODE_CANDIDATES, a.decode_variants, "--decode-variants")
    except ValueError as exc:
        p.error(str(exc))
    return a


# ---------------------------------------------------------------- GPU side

_T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def variant_call(pool, meta, q, out, cfg: dict | None, decode: bool):
    """The plugin kernel with `cfg` (None: ops.paged_attention as the backend runs it)."""
    from benchmarks.kernel_problems import MHA_SCALE, plugin_mha_call

    if cfg is None:
        return plugin_mha_call(pool, meta, q, out)
    from atom_plugin.attention.mha.params import AttentionParams

    params = AttentionParams(scale=MHA_SCALE)
    kc, vc = pool.key_cache, pool.value_cache
    if decode:
        from atom_plugin.attention.mha.planner import plan_for_caches

        splits = plan_for_caches(meta, kc, "triton").num_splits

        def call():
            triton_decode.paged_decode(q, kc, vc, meta, params, out, num_splits=splits, config=cfg)
            return out
    elif cfg is GLUON:
        from atom_plugin.attention.mha import gluon_prefill_launch as gpl

        problems = gpl.gluon_prefill_problems(q, kc, vc, params)
        if problems:
            raise ValueError("gluon prefill: " + "; ".join(problems))
        counters = gpl.work_counters(q.device)  # made ahead: `call` may run under capture

        def call():
            gpl.gluon_prefill(q, kc, vc, meta, params, out, meta.num_decodes, counters)
            return out
    else:

        def call():
            triton_prefill.paged_prefill(q, kc, vc, meta, params, out, config=cfg)
            return out

    return call


def run_case(pool, reqs, candidates, decode: bool, flush, iters, deadline, seed) -> list[dict]:
    """FA3, then each candidate on one case; rows carry us or an ERROR / FAILED status."""
    import torch

    from benchmarks import kernel_problems as kp
    from benchmarks._timing import time_us

    torch.manual_seed(seed)
    meta = kp.mha_meta(pool, reqs, seed)
    q = kp.peaked_mha_query(meta.num_actual_tokens)
    rows = []

    def timed(name, cfg, fn):
        row = {"variant": name, "config": cfg, "status": "ok"}
        rows.append(row)
        if time.monotonic() > deadline:
            row["status"] = "SKIPPED: budget spent"
            return None
        try:
            got = fn().clone()
            torch.cuda.synchronize()
            row["us"] = time_us(fn, flush=flush, iters=iters)
        except Exception as exc:
            row["status"] = f"ERROR: {kp.short_error(exc)}"
            return None
        return got

    splits = FA3_DECODE_SPLITS if decode else 0  # prefill: FA3's heuristic, as kernels_vs_vllm
    want = timed("FA3", None, kp.fa3_call(pool, meta, q, splits))
    for name, cfg in candidates:
        out = torch.empty_like(q)
        got = timed(name, cfg, variant_call(pool, meta, q, out, cfg, decode))
        if got is not None and want is None:
            rows[-1]["status"] = "ok (unchecked: FA3 failed)"
        elif got is not None:
            try:
                rows[-1]["maxdiff"] = kp.assert_close(got, want, f"{name} vs FA3")
            except kp.OutputMismatch as exc:
                rows[-1]["status"] = f"FAILED: {kp.short_error(exc)}"
        progress(f"  {name}: {_cell(rows[-1].get('us'))} us {rows[-1]['status'][:80]}")
    return rows


def _cell(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(case_rows: dict, amount, unit: str) -> str:
    """Markdown: one row per (case, candidate), its rate and its time over FA3's and over
    the default's (> 1: slower)."""
    lines = [
        f"| case | variant | config | us | {unit} | vs FA3 | vs default | status |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for case, rows in case_rows.items():
        base = {r["variant"]: r.get("us") for r in rows if r["status"].startswith("ok")}
        for r in rows:
            us = r.get("us") if r["status"].startswith("ok") else None
            rate = amount(case) / (us * 1e-6) / 1e12 if us else None
            fa3 = us / base["FA3"] if us and base.get("FA3") else None
            dflt = us / base["default"] if us and base.get("default") else None
            cfg = "-" if r["config"] is None else _fmt_cfg(r["config"])
            lines.append(
                f"| {case} | {r['variant']} | {cfg} | {_cell(us)} | {_cell(rate, '.0f')} | "
                f"{_cell(fa3, '.2f')} | {_cell(dflt, '.2f')} | {r['status']} |"
            )
    return "\n".join(lines)


def _fmt_cfg(cfg: dict) -> str:
    short = {"BLOCK_Q": "q", "BLOCK_N": "n", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short[k]}{v}" if k in short else k for k, v in cfg.items() if v)


def run(a) -> tuple[str, int]:
    import torch

    from benchmarks import attention
    from benchmarks import kernel_problems as kp
    from benchmarks._timing import L2Flusher

    end = time.monotonic() + a.budget
    progress(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    flush = L2Flusher()
    dec = list(a.decode_cases.values()) if "decode" in a.families else []
    pre = list(a.prefill_cases.values()) if "prefill" in a.families else []
    shapes = [(len(r), max(s for _, s in r)) for r in dec + pre]
    torch.manual_seed(1)
    pool = attention.KVPool(kp.mha_pool_tokens(shapes, ()), kp.MHA_BLOCK_SIZE)
    sections, bad = [], 0
    plans = (
        ("prefill", a.prefill_cases, a.prefill_variants, False, "TFLOP/s"),
        ("decode", a.decode_cases, a.decode_variants, True, "TB/s"),
    )
    plans = [p for p in plans if p[0] in a.families]
    for k, (fam, cases, cands, decode, unit) in enumerate(plans):
        share = (end - time.monotonic()) / (len(plans) - k)  # the rest, split over the families
        deadline = time.monotonic() + share
        case_rows = {}
        for i, (name, reqs) in enumerate(cases.items()):
            progress(f"{fam} {name}")
            try:
                case_rows[name] = run_case(
                    pool, reqs, cands, decode, flush, a.iters, deadline, seed=7 + i
                )
            except Exception as exc:  # building the inputs failed
                case_rows[name] = [{"variant": "-", "config": None}]
                case_rows[name][0]["status"] = f"ERROR: {kp.short_error(exc)}"
            torch.cuda.empty_cache()
            rows = case_rows[name]
            bad += sum(r["status"].startswith(("ERROR", "FAILED")) for r in rows)

        def amount(case, decode=decode, cases=cases):
            reqs = cases[case]
            if decode:
                return kp.mha_decode_bytes(len(reqs), reqs[0][1])
            return kp.prefill_flops(reqs)

        sections.append(
            f"## {fam}: {kp.HQ} q / {kp.HKV} kv heads, head {kp.D}, bf16, block "
            f"{kp.MHA_BLOCK_SIZE}; FA3 as vLLM's FLASH_ATTN backend\n\n"
            + table(case_rows, amount, unit)
        )
    return DOC_HEAD + "\n\n" + "\n\n".join(sections) + "\n", bad


def main(argv=None) -> int:
    a = parse_args(argv)
    validate_all()
    import torch

    if not torch.cuda.is_available():
        print("mha_variants needs a CUDA device", file=sys.stderr)
        return 2
    text, bad = run(a)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    progress(f"done; {bad} ERROR / FAILED rows")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
