"""The idle time between the kernels of each CUDA graph launch in torch profiler traces
(the Chrome traces the engine benchmark's `--profile` writes, `*.json.gz`).

A kernel launched by a graph carries the correlation id of the host's `cudaGraphLaunch`
call; the gap before a kernel is its start less the end of the kernel before it in the
same launch (negative where programmatic dependent launch overlaps them).

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


def trace_gaps(path: str) -> dict:
    """Graph launches, nodes, the median gap and the idle microseconds per launch."""
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        events = json.load(f)["traceEvents"]
    launches = {
        e["args"]["correlation"]
        for e in events
        if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch" and "args" in e
    }
    nodes = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES:
            correlation = e.get("args", {}).get("correlation")
            if correlation in launches:
                nodes[correlation].append((e["ts"], e["ts"] + e["dur"]))
    gaps = graph_gaps_us(list(nodes.values()))
    count = max(1, len(nodes))
    return {
        "launches": len(nodes),
        "nodes": sum(len(v) for v in nodes.values()),
        "median_gap_us": statistics.median(gaps) if gaps else None,
        "idle_us_per_launch": sum(g for g in gaps if g > 0) / count,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    args = p.parse_args(argv)
    print("| trace | graph launches | nodes | median gap us | idle us a launch |")
    print("|---|---|---|---|---|")
    for path in args.traces:
        r = trace_gaps(path)
        median = "-" if r["median_gap_us"] is None else f"{r['median_gap_us']:.3f}"
        print(
            f"| {path.rsplit('/', 1)[-1]} | {r['launches']} | {r['nodes']} | {median} | "
            f"{r['idle_us_per_launch']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
