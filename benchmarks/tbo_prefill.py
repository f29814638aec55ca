"""Two-batch-overlap benchmark: time per prefill step of the TBO test model (eager).

The prefill counterpart of `benchmarks/tbo.py` (decode), for the threshold
below which a prefill step stays unsplit (`TboConfig.prefill_min_tokens`).
Prefill steps are not recorded as graphs, so every column is an eager step.

For total new tokens {256, ..., 16384} the step holds four requests of mixed
lengths (3/16, 1/16, 7/16 and 5/16 of the tokens; two of them continue a
cached prefix, as chunked prefill does) and the token midpoint falls inside the
third, so one request straddles the cut. With the stand-in communication off or
at a fraction of the unsplit step it times:
- unsplit: the step in one forward (TBO off);
- split: the two micro-batches of `atom_plugin.tbo` (`prefill_ubatch_ranges`:
  the token midpoint, the straddling request as cached prefix plus new tokens;
  `prepare_ubatch_prefill` cuts the attention metadata at the same ranges) on
  the runner's threads, with one compute stream (the runner's default) and with
  one per micro-batch, each for the model's `per_comm` and `staged` hand-overs.
References in the same run: the runner alone (a split step with the model's
hand-overs and no kernels: the threads' share of the split's fixed cost), the
unsplit step's GPU time without communication
(the step recorded as a graph, so the launches cost nothing: the compute), the
stand-in communication alone, and the ideal overlap max(compute, comm alone).
Where the eager unsplit step takes longer than its GPU time, the host's
launches set the pace and a split (twice the launches, plus the hand-overs
between the runner's threads) cannot pay.

The stand-in is `benchmarks/tbo.py`'s: `torch.cuda._sleep` on the comm stream,
proportional to the token rows moved, sized to f of the unsplit step
(f / (1 - f) x its GPU time without communication). `--ep-ranks W` makes the
GPU one rank of W expert-parallel ranks, as there.

Before timing, every split column's hidden states and KV caches are checked
against the unsplit step's (relative max error reported; above 5% it aborts).

    python -m benchmarks.tbo_prefill [--tokens 256 512 ... 16384] [--comm 0 0.3 0.5]
                                     [--ep-ranks 1|2|4|8] [--out table.md] [--json rows.json]
    python -m benchmarks.tbo_prefill --device cpu --model tiny --tokens 16 32 --comm 0  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch

from benchmarks._timing import graphed
from benchmarks.tbo import (
    add_ep_ranks_option,
    calibrate_cycles_per_ms,
    comm_alone_ms,
    comm_ms_at,
    markdown,
    publish,
    set_stand_in,
)
from benchmarks.tbo_dp import MODELS, median_ms, rel_error

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tbo_harness.batches import blocks_needed, make_batch, run_step, run_unsplit  # noqa: E402
from tbo_harness.model import KVCaches, LocalComm, TboTestModel  # noqa: E402

import atom_plugin.tbo as tbo  # noqa: E402
from atom_plugin.tbo import BatchShape, ForwardMode, MicroBatchRunner, TboConfig  # noqa: E402
from atom_plugin.tbo.split import prefill_ubatch_ranges  # noqa: E402

TOKENS = (256, 512, 1024, 2048, 4096, 8192, 12288, 16384)
SHARES = (3, 1, 7, 5)  # sixteenths of the step's new tokens per request: the cut falls in the 3rd
PREFIX = (0, 512, 256, 0)  # cached tokens per request before this step
MIN_TOKENS = sum(SHARES)  # the smallest step in which every request gets a token
MAX_REL_ERROR = 0.05
# (column, compute streams, hand-over schedule) of each split
SPLITS = (
    ("split", 1, "per_comm"),
    ("split2s", 2, "per_comm"),
    ("staged", 1, "staged"),
    ("staged2s", 2, "staged"),
)


def prefill_query_lens(tokens: int) -> list[int]:
    """New tokens per request for a step of `tokens` (SHARES of it; the rest to the last)."""
    if tokens < MIN_TOKENS:
        raise ValueError(f"a prefill step of {tokens} tokens cannot hold {len(SHARES)} requests")
    lens = [tokens * s // sum(SHARES) for s in SHARES]
    lens[-1] += tokens - sum(lens)
    return lens


def straddling_request(query_lens: list[int]) -> int | None:
    """The request whose new tokens cross the token midpoint (in both micro-batches), if any."""
    (_, end0), (start1, _) = prefill_ubatch_ranges(query_lens).requests
    return start1 if end0 - 1 == start1 else None


def prefill_batch(cfg, tokens: int, device):
    """The step of `tokens` new tokens and random KV caches holding its requests' blocks."""
    lens = prefill_query_lens(tokens)
    if straddling_request(lens) is None:  # the shares guarantee it; the benchmark relies on it
        raise AssertionError(f"no request straddles the cut of {lens}")
    seq_lens = [p + q for p, q in zip(PREFIX, lens, strict=True)]
    max_blocks = blocks_needed([max(seq_lens)], cfg.block_size)
    num_blocks = blocks_needed(seq_lens, cfg.block_size) + 1
    batch = make_batch(cfg, lens, list(PREFIX), max_blocks, num_blocks, device, seed=tokens)
    return batch, KVCaches.random(cfg, num_blocks, device, seed=1)


def gpu_ms(fn, iters: int, device: torch.device) -> tuple[float, bool]:
    """The step's device time and whether it was recorded as a graph (on CUDA, so that the
    launches cost nothing); eager where it cannot be recorded, and on CPU."""
    run = graphed(fn) if device.type == "cuda" else fn
    return median_ms(run, iters, device), run is not fn


def split_errors(model, runners, batch, caches, mode) -> dict[str, float]:
    """Relative max error of each split column against the unsplit step (hidden + KV)."""
    ref_caches = caches.clone()
    ref = run_unsplit(model, batch, ref_caches).float()
    errs = {}
    for name, streams, overlap in SPLITS:
        model.overlap = overlap
        out_caches = caches.clone()
        out = run_step(model, runners[streams], batch, out_caches, mode).float()
        kv = max(rel_error(a, b) for a, b in zip(out_caches.raw, ref_caches.raw, strict=True))
        errs[name] = max(rel_error(out, ref), kv)
    model.overlap = "per_comm"
    return errs


def measure(batch, caches, comm_fraction, compute_ms, rate_per_ms, model, runners, iters):
    """One row: the unsplit step and each split, the stand-in at `comm_fraction` of the
    unsplit step whose GPU time without communication is `compute_ms`."""
    tokens, device = batch.meta.num_actual_tokens, caches.raw[0].device
    mode = ForwardMode.decide(
        [BatchShape.from_query_lens(batch.query_lens)], 0, TboConfig(decode=False), ()
    )
    if not (mode.split and mode.kind == "prefill"):
        raise AssertionError(f"{tokens} tokens: expected a split prefill step, got {mode}")
    comm, layers = model.comm, model.cfg.layers
    set_stand_in(comm, comm_ms_at(comm_fraction, compute_ms), rate_per_ms, tokens, layers)
    row = dict(tokens=tokens, comm_fraction=comm_fraction, query_lens=batch.query_lens)
    row["straddling_request"] = straddling_request(batch.query_lens)
    row["ubatch_num_tokens"] = list(mode.ubatch_num_tokens)
    row["compute_ms"] = compute_ms
    row["comm_alone_ms"] = comm_alone_ms(comm, tokens, layers) if comm_fraction else 0.0
    row["ideal_overlap_ms"] = max(compute_ms, row["comm_alone_ms"])
    errs = split_errors(model, runners, batch, caches, mode)
    row["split_vs_unsplit_rel_err"] = err = max(errs.values())
    if not err <= MAX_REL_ERROR:
        raise SystemExit(f"{tokens} tokens: a split step differs from unsplit by {errs}")
    row["unsplit_ms"] = median_ms(lambda: run_unsplit(model, batch, caches), iters, device)
    for name, streams, overlap in SPLITS:
        model.overlap = overlap
        row[f"{name}_ms"] = median_ms(
            lambda s=streams: run_step(model, runners[s], batch, caches, mode), iters, device
        )
        row[f"unsplit_over_{name}"] = row["unsplit_ms"] / row[f"{name}_ms"]
    model.overlap = "per_comm"
    set_stand_in(comm, 0.0, rate_per_ms, tokens, layers)
    return row


def runner_alone_ms(runner: MicroBatchRunner, layers: int, iters: int, device) -> float:
    """One split step of the runner with the model's `per_comm` hand-overs (two
    communication steps per layer, each a switch to the comm stream and a yield back to
    compute) and no kernels: the split's fixed cost on the host."""

    def ubatch(ctx):
        for _ in range(2 * layers):
            tbo.switch_to_comm()
            tbo.yield_and_switch_to_compute()

    return median_ms(lambda: runner.run(ubatch, [None, None]), iters, device)


def measure_size(tokens, args, model, rate_per_ms, runners, device) -> list[dict]:
    """The rows of one step size, one per communication fraction."""
    batch, caches = prefill_batch(model.cfg, tokens, device)
    compute_ms, graphed_ok = gpu_ms(lambda: run_unsplit(model, batch, caches), args.iters, device)
    return [
        dict(
            measure(batch, caches, f, compute_ms, rate_per_ms, model, runners, args.iters),
            compute_graphed=graphed_ok,
            ep_ranks=args.ep_ranks,
        )
        for f in args.comm
    ]


COLUMNS = [
    ("tokens", "new tokens", "{}"),
    ("comm_fraction", "comm", "{:.0%}"),
    ("unsplit_ms", "unsplit ms", "{:.3f}"),
    ("split_ms", "split ms", "{:.3f}"),
    ("split2s_ms", "split 2 streams ms", "{:.3f}"),
    ("staged_ms", "staged ms", "{:.3f}"),
    ("staged2s_ms", "staged 2 streams ms", "{:.3f}"),
    ("compute_ms", "unsplit GPU ms (no comm)", "{:.3f}"),
    ("comm_alone_ms", "comm alone ms", "{:.3f}"),
    ("ideal_overlap_ms", "ideal overlap ms", "{:.3f}"),
    ("unsplit_over_split", "unsplit / split", "{:.2f}x"),
    ("unsplit_over_split2s", "unsplit / split 2 streams", "{:.2f}x"),
    ("unsplit_over_staged", "unsplit / staged", "{:.2f}x"),
    ("unsplit_over_staged2s", "unsplit / staged 2 streams", "{:.2f}x"),
    ("split_vs_unsplit_rel_err", "rel err", "{:.1e}"),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--comm", type=float, nargs="+", default=[0.0, 0.3, 0.5])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="bench")
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--json", help="write the rows as JSON here")
    add_ep_ranks_option(p)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (a CPU smoke run: --device cpu --model tiny)")
    bad = [f for f in args.comm if not 0 <= f < 1]
    if bad:
        p.error(f"--comm fractions must be in [0, 1), got {bad}")
    if args.device == "cpu" and any(args.comm):
        p.error(f"--comm {args.comm}: the stand-in communication is a CUDA kernel; use 0 on CPU")
    small = [t for t in args.tokens if t < MIN_TOKENS]
    if small:
        p.error(
            f"--tokens must be >= {MIN_TOKENS} (four requests, one straddling the cut), got {small}"
        )
    if MODELS[args.model].experts % args.ep_ranks:
        p.error(f"--ep-ranks {args.ep_ranks} does not divide the {args.model} model's experts")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = MODELS[args.model]
    if device.type == "cuda":
        torch.cuda.set_device(0)
        rate_per_ms = calibrate_cycles_per_ms()
    else:
        rate_per_ms = 0.0
    model = TboTestModel(cfg, device, comm=LocalComm(world=args.ep_ranks), seed=0)
    rows = []
    with (
        MicroBatchRunner(device.type, timeout_s=300) as one_stream,
        MicroBatchRunner(device.type, timeout_s=300, compute_streams=2) as two_streams,
    ):
        runners = {1: one_stream, 2: two_streams}
        alone = {s: runner_alone_ms(r, cfg.layers, args.iters, device) for s, r in runners.items()}
        for t in args.tokens:
            for row in measure_size(t, args, model, rate_per_ms, runners, device):
                row.update(runner_alone_ms=alone[1], runner_alone_2s_ms=alone[2])
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            gc.collect()  # the step's caches and graph pool before the next size
            if device.type == "cuda":
                torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.timezone.utc)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = [
        f"# TBO prefill step (eager), {name} ({now:%Y-%m-%d %H:%M} UTC), torch {torch.__version__}",
        f"model {args.model}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} "
        f"heads x {cfg.head_dim}, {cfg.experts} experts x ffn {cfg.ffn} (dense-masked), "
        f"{str(cfg.dtype).removeprefix('torch.')}; requests: {'/'.join(map(str, SHARES))} "
        f"sixteenths of the new tokens after {'/'.join(map(str, PREFIX))} cached, the 3rd "
        f"straddling the cut; stand-in comm: spin, {rate_per_ms:.3g} cycles/ms; expert "
        f"parallel: one rank of {args.ep_ranks}; median of {args.iters} steps",
        f"the runner alone (these hand-overs, no kernels): {alone[1]:.3f} ms on one compute "
        f"stream, {alone[2]:.3f} ms on two",
    ]
    publish(markdown(rows, header, COLUMNS), rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
