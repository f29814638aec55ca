"""The Hopper Gluon MHA prefill prototype (`mha.gluon_prefill`) beside the plugin's
Triton prefill (through `ops.paged_attention`, as the backend runs it) and FA3 (as
vLLM's FLASH_ATTN backend calls it, num_splits=0) on issue 26's problems: 32 query /
8 kv heads, head 128, bf16, vLLM-layout cache of 16-token pages, shuffled tables.

Every output is checked against FA3's (or the Triton kernel's where FA3 fails); a
side that fails to compile, launch or match gets an ERROR cell and the run goes on.
The Gluon kernel is timed in the configurations of GLUON ('gluon' is its default; 'seq'
without the S / P V overlap; 'n64' with 64-key tiles, 3 stages; 'ws' warp-specialized),
after the Triton kernel and FA3 (a fault in an untried kernel cannot hide their
numbers); gluon/fa3 and gluon/triton compare the default. Timing: the median of 20
CUDA-graph replays after an L2 flush. Progress goes to stderr, the markdown table to
stdout (and `--out`).

    python -m benchmarks.gluon_prefill [--out table.md] [--config '{"BLOCK_N": 64}']
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks._timing import L2Flusher, time_us
from benchmarks.attention import KVPool
from benchmarks.kernel_problems import (
    MHA_BLOCK_SIZE,
    MHA_SCALE,
    assert_close,
    fa3_call,
    mha_meta,
    mha_pool_tokens,
    peaked_mha_query,
    plugin_mha_call,
    prefill_flops,
    prefill_reqs,
    rate,
    short_error,
)

CASES = (
    ("1x8K fresh", prefill_reqs(1, 8192)),
    ("1x16K fresh", prefill_reqs(1, 16384)),
    ("4x2K fresh", prefill_reqs(4, 2048)),
    ("4x2K over 6K", [(2048, 8192)] * 4),
)
# the Gluon kernel's configurations timed (`gluon_prefill.CONFIG` is the first)
GLUON = {
    "gluon": {},
    "gluon seq": {"OVERLAP": False},
    "gluon n64": {"BLOCK_N": 64, "STAGES": 3},
    "gluon ws": {"WS": True},
}
_T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def gluon_call(pool, meta, q, config):
    from atom_plugin.attention.mha.gluon_prefill import gluon_paged_prefill
    from atom_plugin.attention.mha.params import AttentionParams

    out = torch.empty_like(q)
    params = AttentionParams(scale=MHA_SCALE)

    def call():
        gluon_paged_prefill(q, pool.key_cache, pool.value_cache, meta, params, out, config=config)
        return out

    return call


def run_case(pool, name, reqs, flush, configs) -> dict:
    meta = mha_meta(pool, reqs)
    q = peaked_mha_query(meta.num_actual_tokens)
    makers = {
        "triton": lambda: plugin_mha_call(pool, meta, q, torch.empty_like(q)),
        "fa3": lambda: fa3_call(pool, meta, q, 0),
    }
    for side, c in configs.items():
        makers[side] = lambda c=c: gluon_call(pool, meta, q, c)
    row, outs = {"case": name}, {}
    flops = prefill_flops(reqs)
    for side in makers:
        try:
            call = makers[side]()
            outs[side] = call().clone()  # compile and check before timing
            torch.cuda.synchronize()
            us = time_us(call, flush=flush)
            row[side] = f"{us:.0f} us, {rate(flops, us, 1e12):.0f} TF/s"
            row[side + "_us"] = us
        except Exception as exc:  # noqa: BLE001 - an ERROR cell, the run goes on
            row[side] = "ERROR " + short_error(exc, 160)
            torch.cuda.synchronize()
        progress(f"{name} {side}: {row[side]}")
    want = outs.get("fa3", outs.get("triton"))
    for side in (*configs, "triton"):
        if side in outs and want is not None and outs[side] is not want:
            try:
                diff = assert_close(outs[side], want, f"{side} vs fa3/triton")
                row[side + "_check"] = f"ok ({diff:.3g})"
            except AssertionError as exc:
                row[side + "_check"] = "MISMATCH " + short_error(exc, 160)
            progress(f"{name} {side} check: {row[side + '_check']}")
    g, f = row.get("gluon_us"), row.get("fa3_us")
    row["gluon/fa3"] = f"{g / f:.2f}x" if g and f else "-"
    t = row.get("triton_us")
    row["gluon/triton"] = f"{g / t:.2f}x" if g and t else "-"
    return row


def table(rows, configs) -> str:
    cols = ("case", *(c + k for c in configs for k in ("", "_check")), "triton", "triton_check")
    cols += ("fa3", "gluon/fa3", "gluon/triton")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the table here")
    p.add_argument(
        "--config", type=json.loads, help="time only this Gluon config (JSON), as 'gluon'"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    progress(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    shapes = [(len(reqs), max(s for _, s in reqs)) for _, reqs in CASES]
    pool = KVPool(mha_pool_tokens([], shapes), MHA_BLOCK_SIZE)
    flush = L2Flusher()
    configs = {"gluon": args.config} if args.config is not None else GLUON
    rows = []
    for name, reqs in CASES:
        try:
            rows.append(run_case(pool, name, reqs, flush, configs))
        except Exception as exc:  # noqa: BLE001 - the row says what failed
            rows.append({"case": name, "gluon": "ERROR " + short_error(exc, 160)})
            progress(f"{name}: ERROR {short_error(exc)}")
        torch.cuda.empty_cache()
    text = table(rows, configs)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
