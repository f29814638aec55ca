"""The MHA decode's split count, swept (issue 26): the plugin's split-KV decode at each
split count on each shape, on one GPU, so the step plan's rule (`choose_num_splits`)
can be set against the best count measured.

Every row runs the production kernel and config (`triton_decode.paged_decode`, config
None) with `num_splits` forced; its output is checked against the row with one split
(no partials, no reduction). Times are medians of CUDA-graph replays after an L2 flush.
Counts above the context's cap (`MIN_TOKENS_PER_SPLIT` keys a split) or MAX_SPLITS are
not run. The rule's own count is run too when `--splits` lacks it (it reads the occupancy
that the shape's first split launch measured, so it is known only after the listed counts).

    PYTHONPATH=$PWD python -m benchmarks.decode_splits --out decode_splits.md \
        [--shapes 32/8/128:8x16384,...] [--splits 1,2,4,...] [--iters 20]

Prints progress to stderr; one table per shape and a summary (the rule's pick against
the best count) to stdout and `--out`. Exit status 1 if any row failed.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.kernel_problems import Heads
from benchmarks.kernels_vs_vllm import parse_heads
from benchmarks.kernels_vs_vllm import parse_shapes as parse_sizes

DEFAULT_SHAPES = (
    "32/8/128:1x1024,32/8/128:1x16384,32/8/128:1x65536,32/8/128:8x4096,32/8/128:8x16384,"
    "32/8/128:8x65536,32/8/128:32x16384,32/4/128:1x1024,32/4/128:8x16384,32/4/128:8x65536,"
    "32/4/128:32x16384,32/4/128:256x4096"
)
DEFAULT_SPLITS = "1,2,3,4,5,6,8,9,10,12,16,24,32,33,48,64"


def parse_shapes(text: str) -> list[tuple[Heads, int, int]]:
    """'Q/KV/D:BxC,...' -> [(Heads, batch, context)] (kernels_vs_vllm's heads and
    BATCHxCONTEXT); ValueError names the bad item."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        try:
            heads_text, size = item.split(":")
            (heads,) = parse_heads(heads_text, "--shapes", head_sizes=None)
            ((batch, context),) = parse_sizes(size, "--shapes")
        except ValueError:
            raise ValueError(
                f"--shapes: bad item {item!r}; want Q/KV/D:BATCHxCONTEXT with Q a multiple "
                f"of KV, e.g. 32/8/128:8x16384"
            ) from None
        out.append((heads, batch, context))
    return out


def parse_splits(text: str) -> list[int]:
    try:
        splits = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        splits = []
    if not splits or splits[0] < 1:
        raise ValueError(f"--splits: {text!r}; want positive integers, e.g. 1,2,4,8")
    return splits


def runnable_splits(splits, context: int) -> list[int]:
    """The counts of `splits` the decode takes for this context (`split_cap`)."""
    from atom_plugin.attention.triton_common import split_cap

    return [s for s in splits if s <= split_cap(context)]


def summary(shape_rows: dict) -> str:
    """One line per shape: the best count, the rule's pick, and the pick's time over the
    best's (1.00: the rule picked as well as the sweep)."""
    lines = [
        "| heads | batch | context | best splits | best us | rule's splits | rule's us | "
        "rule / best |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (heads, batch, context), rows in shape_rows.items():
        ok = [r for r in rows if r["status"] == "ok"]
        if not ok:
            lines.append(f"| {heads} | {batch} | {context} | - | - | - | - | - |")
            continue
        best = min(ok, key=lambda r: r["us"])
        pick = next((r for r in ok if r["rule"]), None)
        rule = (
            f"{pick['splits']} | {pick['us']:.1f} | {pick['us'] / best['us']:.2f}"
            if pick
            else "- | - | -"
        )
        lines.append(
            f"| {heads} | {batch} | {context} | {best['splits']} | {best['us']:.1f} | {rule} |"
        )
    return "\n".join(lines)


def shape_table(rows: list[dict], copy_gbps: float | None) -> str:
    lines = [
        "| splits | programs | programs / SMs | us | GB/s | of copy | vs best | rule | status |",
        "|---:|---:|---:|---:|---:|---:|---:|:---|:---|",
    ]
    ok = [r["us"] for r in rows if r["status"] == "ok"]
    best = min(ok) if ok else None
    for r in rows:
        us = r.get("us") if r["status"] == "ok" else None
        gbps = r["bytes"] / (us * 1e-6) / 1e9 if us else None
        lines.append(
            f"| {r['splits']} | {r['programs']} | {r['per_sm']:.2f} | "
            f"{'-' if us is None else f'{us:.1f}'} | {'-' if gbps is None else f'{gbps:.0f}'} | "
            f"{'-' if gbps is None or not copy_gbps else f'{gbps / copy_gbps:.1%}'} | "
            f"{'-' if us is None else f'{us / best:.2f}'} | {'picked' if r['rule'] else ''} | "
            f"{r['status']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- GPU side

_T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def sweep_shape(heads: Heads, batch: int, context: int, splits, flush, iters, sms) -> list[dict]:
    import torch

    from atom_plugin.attention import triton_common
    from atom_plugin.attention.mha import triton_decode
    from atom_plugin.attention.mha.params import AttentionParams
    from benchmarks import attention
    from benchmarks import kernel_problems as kp
    from benchmarks._timing import time_us

    torch.manual_seed(1)
    pool = attention.KVPool(kp.mha_pool_tokens([(batch, context)], ()), 16, hkv=heads.kv, d=heads.d)
    meta = pool.meta([(1, context)] * batch, seed=batch * 7 + context)
    q = kp.peaked_mha_query(batch, heads=heads)
    params = AttentionParams(scale=heads.scale)
    nbytes = kp.mha_decode_bytes(batch, context, heads)
    rows, ref = [], {}  # ref: the first count's output, the one the others are checked against

    def measure(s: int) -> None:
        out = torch.empty_like(q)

        def call():
            triton_decode.paged_decode(
                q, pool.key_cache, pool.value_cache, meta, params, out, num_splits=s
            )
            return out

        programs = batch * heads.kv * s
        row = dict(splits=s, programs=programs, per_sm=programs / sms, bytes=nbytes)
        row.update(rule=False, status="ok")
        try:
            got = call().clone()
            torch.cuda.synchronize()
            if ref:
                kp.assert_close(got, ref["out"], f"{s} splits vs {ref['splits']}")
            else:
                ref.update(out=got, splits=s)
            row["us"] = time_us(call, flush=flush, iters=iters)
        except Exception as exc:
            row["status"] = f"FAILED: {kp.short_error(exc)}"
        progress(f"  {s} splits: {row.get('us', 0):.1f} us {row['status'][:80]}")
        rows.append(row)

    for s in runnable_splits(splits, context):
        measure(s)
    pick = triton_common.choose_num_splits(
        batch, heads.kv, context, sms, triton_decode.programs_per_sm(q.device)
    )
    if pick not in [r["splits"] for r in rows]:
        measure(pick)
        rows.sort(key=lambda r: r["splits"])
    for row in rows:
        row["rule"] = row["splits"] == pick
    return rows  # the caller empties the allocator cache once the pool is gone


def run(shapes, splits, iters) -> tuple[str, int]:
    import torch
    import triton

    from atom_plugin.attention.mha.triton_decode import programs_per_sm
    from atom_plugin.attention.triton_common import device_sm_count
    from benchmarks._timing import L2Flusher, copy_bandwidth_gbps

    sms = device_sm_count(torch.device("cuda"))
    copy = copy_bandwidth_gbps()
    progress(f"{torch.cuda.get_device_name()} ({sms} SMs); copy {copy:.0f} GB/s")
    flush = L2Flusher()
    shape_rows, sections = {}, []
    for heads, batch, context in shapes:
        progress(f"{heads} {batch} x {context}")
        rows = sweep_shape(heads, batch, context, splits, flush, iters, sms)
        torch.cuda.empty_cache()
        shape_rows[(heads, batch, context)] = rows
        sections.append(f"### {heads}, {batch} x {context}\n\n" + shape_table(rows, copy))
    bad = sum(r["status"] != "ok" for rows in shape_rows.values() for r in rows)
    per_sm = programs_per_sm(torch.device("cuda"))
    head = (
        f"{torch.cuda.get_device_name()}, {sms} SMs; torch {torch.__version__}, Triton "
        f"{triton.__version__}; the split kernel's programs an SM holds: {per_sm}; copy "
        f"{copy:.0f} GB/s (read + write) in this run. bf16 cache, block 16; bytes = K and V "
        "rows once + queries + outputs. `rule`: the count `choose_num_splits` picks.\n\n"
    )
    return head + summary(shape_rows) + "\n\n" + "\n\n".join(sections) + "\n", bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--splits", default=DEFAULT_SPLITS)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", help="also write the tables to this file")
    a = p.parse_args(argv)
    try:
        shapes, splits = parse_shapes(a.shapes), parse_splits(a.splits)
        if a.iters < 1:
            raise ValueError(f"--iters {a.iters}: must be at least 1")
    except ValueError as exc:
        p.error(str(exc))
    import torch

    if not torch.cuda.is_available():
        print("decode_splits needs a CUDA device", file=sys.stderr)
        return 2
    text, bad = run(shapes, splits, a.iters)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    progress(f"done; {bad} failed rows")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
