"""The idle time between the kernels of each CUDA graph launch in torch profiler traces
(the Chrome traces the engine benchmark's `--profile` writes, `*.json.gz`).

A kernel launched by a graph carries the correlation id of the host's `cudaGraphLaunch`
call; the gap before a kernel is its start less the end of the kernel before it in the
same launch (negative where programmatic dependent launch overlaps them). Per launch
also: how long the host's `cudaGraphLaunch` call took, when the graph's first node
started after the call began (on an H100 with vLLM 0.34, 2026-12-06, when the call
returned: the GPU waits for the whole launch), and how long the GPU had been idle before
that first node.

    python -m benchmarks graph_gaps TRACE.json.gz [TRACE.json.gz ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

from benchmarks.engine_probe import graph_gaps_us

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def trace_gaps(path: str) -> dict:
    """Graph launches, nodes, the median gap and the idle microseconds per launch, and
    the medians over launches of the host's launch call, of its first node's start after
    the call began, and of the GPU's idle time before that node."""
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        events = json.load(f)["traceEvents"]
    calls = {
        e["args"]["correlation"]: (e["ts"], e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch" and "args" in e
    }
    nodes = defaultdict(list)
    gpu = []  # every GPU interval, graph nodes or not: (start, end, launch or None)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES:
            correlation = e.get("args", {}).get("correlation")
            span = (e["ts"], e["ts"] + e["dur"])
            gpu.append((*span, correlation if correlation in calls else None))
            if correlation in calls:
                nodes[correlation].append(span)
    gaps = graph_gaps_us(list(nodes.values()))
    count = max(1, len(nodes))
    idle_before, seen, busy_until = [], set(), None
    for start, end, launch in sorted(gpu, key=lambda g: g[:2]):
        if launch is not None and launch not in seen:
            seen.add(launch)
            if busy_until is not None:
                idle_before.append(start - busy_until)
        busy_until = end if busy_until is None else max(busy_until, end)
    return {
        "launches": len(nodes),
        "nodes": sum(len(v) for v in nodes.values()),
        "median_gap_us": _median(gaps),
        "idle_us_per_launch": sum(g for g in gaps if g > 0) / count,
        "launch_call_us": _median([calls[c][1] for c in nodes]),
        "first_node_after_call_us": _median([min(nodes[c])[0] - calls[c][0] for c in nodes]),
        "idle_before_launch_us": _median(idle_before),
    }


def replay_gaps(graph, replays: int = 1) -> dict:
    """`trace_gaps` of `replays` replays of a CUDA graph under torch's profiler (CPU and
    CUDA activities, as the engine benchmark's profiles)."""
    import tempfile
    from pathlib import Path

    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "trace.json")
        prof.export_chrome_trace(path)
        return trace_gaps(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    args = p.parse_args(argv)
    print(
        "| trace | graph launches | nodes | median gap us | idle us a launch "
        "| launch call us | first node after the call began, us | GPU idle before it, us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for path in args.traces:
        r = trace_gaps(path)
        median = "-" if r["median_gap_us"] is None else f"{r['median_gap_us']:.3f}"
        launch = [
            "-" if r[k] is None else f"{r[k]:.0f}"
            for k in ("launch_call_us", "first_node_after_call_us", "idle_before_launch_us")
        ]
        print(
            f"| {path.rsplit('/', 1)[-1]} | {r['launches']} | {r['nodes']} | {median} | "
            f"{r['idle_us_per_launch']:.1f} | " + " | ".join(launch) + " |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
