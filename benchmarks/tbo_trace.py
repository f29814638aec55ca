"""Kernel timeline of one decode step of the TBO test model (a diagnostic, not a benchmark).

Records the bucket's request graph (unsplit, or split with a hand-over schedule),
sets the stand-in communication to a fraction of the unsplit step as
benchmarks/tbo.py does, replays once under torch.profiler and prints every GPU
kernel: the stream it ran on, its start and duration in ms from the first
kernel, and its name. It shows what each collective (`spin_kernel`) and each
micro-batch's kernels wait behind. `--summary` prints instead how long the GPU
was busy (any kernel running) and the kernel time summed per kernel name. A
replayed graph runs on streams CUDA picks, so the stream numbers name lanes of
concurrent work, not the capture's streams.

    python -m benchmarks.tbo_trace --batch 256 --context 8192 --comm 0.3 \\
        --schedule staged --compute-streams 1 [--ep-ranks 8] [--summary]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.tbo import (
    MODEL,
    add_ep_ranks_option,
    calibrate_cycles_per_ms,
    comm_ms_at,
    set_stand_in,
    step_ms,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tbo_harness.batches import decode_blocks, uniform_decode_batch  # noqa: E402
from tbo_harness.graphed import GraphedDecoder  # noqa: E402
from tbo_harness.model import OVERLAP_SCHEDULES, KVCaches, LocalComm, TboTestModel  # noqa: E402

from atom_plugin.tbo import MicroBatchRunner, TboConfig  # noqa: E402
from atom_plugin.tbo.runner import COMPUTE_STREAM_CHOICES  # noqa: E402

SCHEDULES = ("unsplit", *OVERLAP_SCHEDULES)


def kernel_timeline(replay) -> list[tuple[int, float, float, str]]:
    """(stream index, start ms, duration ms, name) of each GPU kernel of one `replay()`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    if not kernels:
        raise SystemExit("the profiler recorded no GPU kernels")
    t0, streams = kernels[0].time_range.start, {}
    return [
        (
            streams.setdefault(e.device_resource_id, len(streams)),
            (e.time_range.start - t0) / 1e3,
            (e.time_range.end - e.time_range.start) / 1e3,
            e.name,
        )
        for e in kernels
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=8192, help="cached tokens per request")
    p.add_argument("--comm", type=float, default=0.3, help="stand-in comm, fraction of the step")
    p.add_argument("--schedule", choices=SCHEDULES, default="staged")
    p.add_argument("--compute-streams", type=int, choices=COMPUTE_STREAM_CHOICES, default=1)
    add_ep_ranks_option(p)
    p.add_argument(
        "--summary", action="store_true", help="busy time and kernel time per name, not each kernel"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/tbo_trace.py needs a CUDA device")
    if args.batch < 3:
        raise SystemExit(f"--batch must be >= 3 (smaller buckets never split), got {args.batch}")
    if not 0 <= args.comm < 1:
        raise SystemExit(f"--comm must be in [0, 1), got {args.comm}")
    torch.cuda.set_device(0)
    comm = LocalComm(world=args.ep_ranks)
    model = TboTestModel(MODEL, "cuda", comm=comm, seed=0)
    max_blocks = decode_blocks(args.context, MODEL.block_size)
    num_blocks = args.batch * max_blocks + 1
    caches = KVCaches.random(MODEL, num_blocks, "cuda", seed=1)
    batch = uniform_decode_batch(MODEL, args.batch, args.context, num_blocks, "cuda", seed=1)
    with MicroBatchRunner("cuda", compute_streams=args.compute_streams) as runner:
        unsplit = GraphedDecoder(
            model, caches, runner, [args.batch], TboConfig(decode=False), max_blocks
        )
        key = next(iter(unsplit.plan))
        unsplit.step(batch)
        compute_ms = step_ms(lambda: unsplit.graphs.replay(key), iters=20)
        comm_ms = comm_ms_at(args.comm, compute_ms)
        set_stand_in(comm, comm_ms, calibrate_cycles_per_ms(), args.batch)
        split = args.schedule != "unsplit"
        if split:
            model.overlap = args.schedule
        config = TboConfig(decode=split)
        decoder = GraphedDecoder(model, caches, runner, [args.batch], config, max_blocks)
        decoder.step(batch)
        timeline = kernel_timeline(lambda: decoder.graphs.replay(key))
    end = max(start + dur for _, start, dur, _ in timeline)
    print(
        f"# batch {args.batch} x context {args.context}, {args.schedule}, "
        f"{args.compute_streams} compute stream(s), one rank of {args.ep_ranks} expert-parallel: "
        f"unsplit compute {compute_ms:.3f} ms, "
        f"stand-in comm {comm_ms:.3f} ms per step; {len(timeline)} kernels over {end:.3f} ms"
    )
    if args.summary:
        print_summary(timeline, end)
        return 0
    print("stream  start ms  dur ms  kernel")
    for stream, start, dur, name in timeline:
        print(f"s{stream:<6} {start:8.3f} {dur:7.3f}  {short(name)}")
    return 0


def short(name: str) -> str:
    return name.removeprefix("void ")[:90]


def busy_ms(timeline) -> float:
    """Time at least one kernel ran: the union of the kernels' intervals."""
    total, reach = 0.0, 0.0
    for _, start, dur, _ in sorted(timeline, key=lambda k: k[1]):
        end = start + dur
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def print_summary(timeline, end: float) -> None:
    """GPU busy time over the step, then kernel time summed per kernel name."""
    per_name: dict[str, list[float]] = {}
    for _, _, dur, name in timeline:
        per_name.setdefault(short(name), []).append(dur)
    print(f"busy {busy_ms(timeline):.3f} ms of {end:.3f} ms; kernel time summed per name:")
    print("   total ms  count  kernel")
    for name, durs in sorted(per_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(durs):11.3f} {len(durs):6d}  {name}")


if __name__ == "__main__":
    raise SystemExit(main())
