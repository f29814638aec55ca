"""Per-call timings of a small step function, as the K3 logits benchmark reports them: device
time from a CUDA graph of back-to-back calls, eager wall time with the host's launch
overhead, and how many kernels one call launches. `args` carries the counts (graph_calls,
replays, trials; benchmarks/k3_logits.py's flags).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks._timing import graphed, time_us


def device_time_us(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Device microseconds per call: a CUDA graph of back-to-back calls, replayed."""
    replay = graphed(lambda: [fn() for _ in range(args.graph_calls)])

    def replays() -> None:
        for _ in range(args.replays):
            replay()

    us = time_us(replays, iters=args.trials, warmup=1, graph=False)
    return us / (args.replays * args.graph_calls)


def eager_time_us(fn: Callable[[], object], args: argparse.Namespace, device) -> float:
    """Wall microseconds per eager call, host launch overhead included."""
    calls = args.replays * 4
    fn()
    trials = []
    for _ in range(args.trials):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        trials.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(trials)


def launches(fn: Callable[[], object], device) -> str:
    """How many device kernels/copies one call runs, from the torch profiler."""
    if device.type != "cuda":
        return "n/a (cpu)"
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as err:  # profiler without CUPTI: say so rather than guess
        return f"n/a ({type(err).__name__})"
    device_type = torch.autograd.DeviceType.CUDA
    return str(sum(1 for e in prof.events() if e.device_type == device_type))


def host_us(call: Callable[[], object]) -> float:
    """Host microseconds of one call made with the GPU idle."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def host_us_spread(call: Callable[[], object], calls: int = 200) -> tuple[float, float]:
    """(median, 90th percentile) of `host_us` over `calls` calls."""
    times = sorted(host_us(call) for _ in range(calls))
    return statistics.median(times), times[min(calls - 1, int(0.9 * calls))]


def host_profile(call: Callable[[], object], top: int, calls: int = 300) -> str:
    """The `top` functions of most host time (own, then with callees) in a cProfile of
    `calls` calls, each made with the GPU idle."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        profile.enable()
        call()
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
