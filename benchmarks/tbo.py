"""Two-batch-overlap benchmark: time per decode step of the TBO test model on one GPU.

For batch {8, 32, 128, 256} and the stand-in communication off or at a
fraction (default 30%) of the unsplit step, it times one decode step as:
- unsplit graph: the bucket's request graph recorded without micro-batches;
- split replay: the bucket's graph recorded as two micro-batches (TBO on),
  both computing on one stream (`MicroBatchRunner(compute_streams=1)`);
- split replay, 2 streams: the same with each micro-batch computing on its own
  stream (`compute_streams=2`), so their kernels may run side by side;
- staged split replay, 1 and 2 streams: the model's `overlap="staged"`: three
  segments per layer (the attention cut in two by KV-head halves) with
  micro-batch 1 one segment behind, so every collective has half an attention of
  the other micro-batch to hide behind (the columns above hand over after each
  communication step, `overlap="per_comm"`);
- eager split: the two micro-batches run eagerly on the runner's threads;
- eager unsplit: the plain eager step, for reference.
A step is "refresh the static buffers in place + replay"; the replay-only
times are reported beside it. The physical references measured in the same
run: the stand-in communication alone (its own graph), and the ideal overlap
bound max(compute, communication alone), compute being the unsplit replay with
the stand-in off - no schedule can beat it; the serial sum is the unsplit graph.
"Split bound" is the most any of the split columns could gain: the unsplit
graph over max(the fastest split graph with the stand-in off, communication
alone) - a split step with communication is never faster than the same split
without it, so where the bound is below a target no overlap reaches it.
"Chain bound" holds for any schedule: a micro-batch's own kernels and
collectives depend on each other in turn, so the split step takes at least the
larger micro-batch's compute alone (the unsplit graph of that many requests,
"half batch graph", stand-in off) plus its own share of the communication.
Where halving the batch barely shortens its compute (small, latency-bound
kernels), this bound is low.

The stand-in is `torch.cuda._sleep` on the comm stream, its duration
proportional to the tokens moved (so two micro-batches wait as long as one
unsplit batch), calibrated against the unsplit replay measured with it off:
comm = f / (1 - f) x compute, i.e. f of the unsplit step with comm.
`--stand-in copy` replaces the kernel by a device-to-host copy of as many bytes
per token row (`CopyComm`): the copy engine moves them, so the stand-in takes no
SM from the compute, as a NIC reading GPU memory for RDMA would not.
`--ep-ranks W` makes the GPU one rank of a W-rank expert-parallel job: it holds
8/W of the 8 experts, and its experts see W ranks' tokens (copies of its own,
`OneRankComm`); attention and its weights stay whole on the rank, as with
data-parallel attention. The stand-in still scales with the rank's own tokens.

Before timing, each condition checks that the split replay's hidden states
equal the unsplit graph's (bf16; relative max error reported, > 5% aborts).

    python -m benchmarks.tbo [--batches 8 32 128 256] [--comm 0 0.3] [--stand-in spin|copy]
                             [--ep-ranks 1|2|4|8] [--context 1024] [--out table.md]
                             [--json rows.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch

from benchmarks._timing import time_us

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tbo_harness.batches import (  # noqa: E402
    decode_blocks,
    run_step,
    run_unsplit,
    uniform_decode_batch,
)
from tbo_harness.graphed import GraphedDecoder  # noqa: E402
from tbo_harness.model import (  # noqa: E402
    CopyComm,
    KVCaches,
    LocalComm,
    ModelConfig,
    TboTestModel,
)

from atom_plugin.tbo import BatchShape, ForwardMode, MicroBatchRunner, TboConfig  # noqa: E402

MODEL = ModelConfig(
    vocab=4096,
    hidden=2048,
    layers=4,
    heads=16,
    kv_heads=4,
    head_dim=128,
    experts=8,
    ffn=1024,
    block_size=16,
    dtype=torch.bfloat16,
)
MAX_REL_ERROR = 0.05
# (column, TBO config, compute streams, hand-over schedule) of each recorded decoder
DECODERS = (
    ("unsplit", TboConfig(decode=False), 1, "per_comm"),
    ("split", TboConfig(), 1, "per_comm"),
    ("split2s", TboConfig(), 2, "per_comm"),
    ("staged", TboConfig(), 1, "staged"),
    ("staged2s", TboConfig(), 2, "staged"),
)
SPLITS = [name for name, *_ in DECODERS if name != "unsplit"]


def calibrate_cycles_per_ms() -> float:
    """GPU cycles `torch.cuda._sleep` spins per millisecond on this device."""
    cycles = 2_000_000
    ms = time_us(lambda: torch.cuda._sleep(cycles), iters=5, graph=False) / 1e3
    return cycles / ms


def comm_ms_at(fraction: float, compute_ms: float) -> float:
    """The stand-in communication per unsplit step that makes it `fraction` of the step."""
    return fraction / (1 - fraction) * compute_ms


def set_stand_in(
    comm: LocalComm | CopyComm,
    comm_ms: float,
    rate_per_ms: float,
    batch: int,
    layers: int = MODEL.layers,
) -> None:
    """Size `comm`'s stand-in so one unsplit step of `batch` requests through `layers`
    layers waits `comm_ms` in all (2 calls per layer, each as long as the token rows it
    moves). `rate_per_ms`: GPU cycles per ms for `LocalComm`'s spin, bytes per ms for
    `CopyComm`'s copy."""
    per_token = comm_ms * rate_per_ms / (layers * 2 * batch)
    if isinstance(comm, CopyComm):
        comm.bytes_per_token = int(per_token)
    else:
        comm.cycles_per_token = per_token


def calibrate_copy_bytes_per_ms(comm: CopyComm) -> float:
    """Bytes per millisecond of `comm`'s device-to-host copy (8 MB, graphed)."""
    x = torch.empty(1, 1, device="cuda")
    comm.bytes_per_token = 8 << 20
    ms = time_us(lambda: comm.stand_in(x), iters=20, graph=True) / 1e3
    comm.bytes_per_token = 0
    return (8 << 20) / ms


def comm_alone_ms(comm: LocalComm | CopyComm, batch: int, layers: int = MODEL.layers) -> float:
    """The stand-in communication of one unsplit step through `layers` layers alone (2
    calls per layer), as a graph."""
    x = torch.empty(batch, 1, device="cuda")

    def calls():
        for _ in range(layers * 2):
            comm.stand_in(x)

    return time_us(calls, iters=20, graph=True) / 1e3


def add_ep_ranks_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ep-ranks",
        type=int,
        choices=[w for w in range(1, MODEL.experts + 1) if MODEL.experts % w == 0],
        default=1,
        help="the GPU is one rank of this many expert-parallel ranks (default 1: all experts)",
    )


def half_batch_ms(requests, model, caches, runner, ctx_len, iters) -> float:
    """Step time of the unsplit graph of `requests` requests (a micro-batch's compute alone,
    when the model's stand-in is off)."""
    max_blocks = decode_blocks(ctx_len, MODEL.block_size)
    batch = uniform_decode_batch(MODEL, requests, ctx_len, caches.raw[0].shape[0], "cuda", seed=1)
    decoder = GraphedDecoder(model, caches, runner, [requests], TboConfig(decode=False), max_blocks)
    return step_ms(lambda: decoder.step(batch), iters)


def step_ms(fn, iters: int) -> float:
    return time_us(fn, iters=iters, warmup=3, graph=False) / 1e3


def measure(batch_size, comm_ms, rate_per_ms, model, comm, caches, runners, ctx_len, iters):
    """One condition's row: comm_ms is the stand-in communication per unsplit step (0 = off).

    `runners` maps a compute-stream count (1, 2) to its `MicroBatchRunner`.
    """
    max_blocks = decode_blocks(ctx_len, MODEL.block_size)
    batch = uniform_decode_batch(MODEL, batch_size, ctx_len, caches.raw[0].shape[0], "cuda", seed=1)
    set_stand_in(comm, comm_ms, rate_per_ms, batch_size)
    row = dict(batch=batch_size)
    row["comm_alone_ms"] = comm_alone_ms(comm, batch_size) if comm_ms else 0.0

    decoders = {}
    for name, config, streams, overlap in DECODERS:
        model.overlap = overlap  # read while the graph is captured
        decoders[name] = GraphedDecoder(
            model, caches, runners[streams], [batch_size], config, max_blocks
        )
    model.overlap = "per_comm"
    out_unsplit = decoders["unsplit"].step(batch).float().clone()
    errs = []
    for name in SPLITS:
        out_split = decoders[name].step(batch).float().clone()
        errs.append(float((out_split - out_unsplit).abs().max() / out_unsplit.abs().max()))
    row["split_vs_unsplit_rel_err"] = err = max(errs)
    if err > MAX_REL_ERROR:
        raise SystemExit(f"batch {batch_size}: split replay differs from unsplit by {err:.3g}")
    for name, dec in decoders.items():
        key = next(iter(dec.plan))
        assert dec.plan[key] == (name != "unsplit"), (name, dec.plan)
        row[f"{name}_graph_ms"] = step_ms(lambda dec=dec: dec.step(batch), iters)
        row[f"{name}_replay_only_ms"] = step_ms(lambda dec=dec, k=key: dec.graphs.replay(k), iters)

    eager_split = ForwardMode.decide([BatchShape(batch_size, batch_size, 1)], 0, TboConfig(), ())
    row["eager_split_ms"] = step_ms(
        lambda: run_step(model, runners[1], batch, caches, eager_split), max(3, iters // 5)
    )
    row["eager_unsplit_ms"] = step_ms(lambda: run_unsplit(model, batch, caches), max(3, iters // 5))
    for name in SPLITS:
        row[f"unsplit_over_{name}"] = row["unsplit_graph_ms"] / row[f"{name}_graph_ms"]
    del decoders
    gc.collect()
    torch.cuda.empty_cache()
    return row


COLUMNS = [
    ("batch", "batch", "{}"),
    ("comm_fraction", "comm", "{:.0%}"),
    ("unsplit_graph_ms", "unsplit graph ms", "{:.3f}"),
    ("split_graph_ms", "split replay ms", "{:.3f}"),
    ("split2s_graph_ms", "split replay 2 streams ms", "{:.3f}"),
    ("staged_graph_ms", "staged replay ms", "{:.3f}"),
    ("staged2s_graph_ms", "staged replay 2 streams ms", "{:.3f}"),
    ("eager_split_ms", "eager split ms", "{:.3f}"),
    ("eager_unsplit_ms", "eager unsplit ms", "{:.3f}"),
    ("unsplit_replay_only_ms", "unsplit replay-only ms", "{:.3f}"),
    ("split_replay_only_ms", "split replay-only ms", "{:.3f}"),
    ("split2s_replay_only_ms", "split 2 streams replay-only ms", "{:.3f}"),
    ("staged_replay_only_ms", "staged replay-only ms", "{:.3f}"),
    ("staged2s_replay_only_ms", "staged 2 streams replay-only ms", "{:.3f}"),
    ("comm_alone_ms", "comm alone ms", "{:.3f}"),
    ("ideal_overlap_ms", "ideal overlap ms", "{:.3f}"),
    ("unsplit_over_split", "unsplit / split", "{:.2f}x"),
    ("unsplit_over_split2s", "unsplit / split 2 streams", "{:.2f}x"),
    ("unsplit_over_staged", "unsplit / staged", "{:.2f}x"),
    ("unsplit_over_staged2s", "unsplit / staged 2 streams", "{:.2f}x"),
    ("split_bound", "split bound", "{:.2f}x"),
    ("half_batch_graph_ms", "half batch graph ms", "{:.3f}"),
    ("chain_bound", "chain bound", "{:.2f}x"),
    ("split_vs_unsplit_rel_err", "rel err", "{:.1e}"),
]


def publish(table: str, report, args: argparse.Namespace) -> None:
    """Print `table`; write it to `--out` and `report` (JSON) to `--json` where given."""
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def markdown(rows, header_lines, columns=COLUMNS) -> str:
    """The header lines, then one table row per result; `columns` are (key, title, format)."""
    lines = [*header_lines, ""]
    lines.append("| " + " | ".join(title for _, title, _ in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[k]) for k, _, fmt in columns) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 256])
    p.add_argument("--comm", type=float, nargs="+", default=[0.0, 0.3])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument(
        "--stand-in",
        choices=("spin", "copy"),
        default="spin",
        help="comm stand-in: a spin kernel (default), or a device-to-host copy (no SM)",
    )
    add_ep_ranks_option(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tbo.py needs a CUDA device")
    bad = [f for f in args.comm if not 0 <= f < 1]
    if bad:
        raise SystemExit(f"--comm fractions must be in [0, 1), got {bad}")
    if any(b < 3 for b in args.batches):
        raise SystemExit(f"--batches must be >= 3 (smaller buckets never split): {args.batches}")
    torch.cuda.set_device(0)
    if args.stand_in == "copy":
        comm = CopyComm(256 << 20, world=args.ep_ranks)
        rate_per_ms = calibrate_copy_bytes_per_ms(comm)
    else:
        comm = LocalComm(world=args.ep_ranks)
        rate_per_ms = calibrate_cycles_per_ms()
    model = TboTestModel(MODEL, "cuda", comm=comm, seed=0)
    max_blocks = decode_blocks(args.context, MODEL.block_size)
    caches = KVCaches.random(MODEL, max(args.batches) * max_blocks + 1, "cuda", seed=1)
    rows = []
    with (
        MicroBatchRunner("cuda", timeout_s=300) as one_stream,
        MicroBatchRunner("cuda", timeout_s=300, compute_streams=2) as two_streams,
    ):
        runners = {1: one_stream, 2: two_streams}
        for b in args.batches:
            common = (rate_per_ms, model, comm, caches, runners, args.context, args.iters)
            base = measure(b, 0.0, *common)
            compute_ms = base["unsplit_replay_only_ms"]  # GPU time of a step without comm
            best_split_ms = min(base[f"{name}_graph_ms"] for name in SPLITS)
            larger_half = b - b // 2
            half_ms = half_batch_ms(
                larger_half, model, caches, one_stream, args.context, args.iters
            )
            for f in args.comm:
                row = base if f == 0 else measure(b, comm_ms_at(f, compute_ms), *common)
                row = dict(row, comm_fraction=f, ep_ranks=args.ep_ranks)
                unsplit_ms, comm_alone = row["unsplit_graph_ms"], row["comm_alone_ms"]
                own_comm_ms = comm_alone * larger_half / b
                row["ideal_overlap_ms"] = max(compute_ms, comm_alone)
                row["split_bound"] = unsplit_ms / max(best_split_ms, comm_alone)
                row["half_batch_graph_ms"] = half_ms
                row["chain_bound"] = unsplit_ms / max(half_ms + own_comm_ms, comm_alone)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    header = [
        f"# TBO decode step, {torch.cuda.get_device_name()} ({now:%Y-%m-%d %H:%M} UTC), "
        f"torch {torch.__version__}",
        f"model: {MODEL.layers} layers, hidden {MODEL.hidden}, {MODEL.heads}/{MODEL.kv_heads} "
        f"heads x {MODEL.head_dim}, {MODEL.experts} experts x ffn {MODEL.ffn} (dense-masked), "
        f"bf16; context {args.context} tokens/request; stand-in comm: {args.stand_in}, "
        f"{rate_per_ms:.3g} {'bytes' if args.stand_in == 'copy' else 'cycles'}/ms; "
        f"expert parallel: one rank of {args.ep_ranks} "
        f"({MODEL.experts // args.ep_ranks} experts, {args.ep_ranks}x tokens into them)",
    ]
    publish(markdown(rows, header), rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
