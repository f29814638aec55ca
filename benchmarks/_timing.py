"""Timing helpers shared by the benchmarks: CUDA-event timing and the physical references.

Every speed claim is set against a limit measured in the same run: the
device-to-device copy bandwidth (bytes read + bytes written per second) for
memory-bound kernels, the dense bf16 matmul rate for compute-bound ones.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 512 << 20  # well above the L2 of current GPUs (H200: 60 MiB)


class L2Flusher:
    """Overwrites a buffer larger than L2 so a timed call reads its inputs from HBM."""

    def __init__(self, device="cuda", nbytes: int = L2_FLUSH_BYTES):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buf.fill_(1)


def _no_flush() -> None:
    pass


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph (its launches replayed), or `fn` when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # report eager timing rather than nothing
        print(f"# graph capture failed ({exc!r:.120}); timing eagerly", file=sys.stderr)
        return fn
    return graph.replay


def time_us(
    fn: Callable[[], object],
    *,
    flush: Callable[[], None] | None = None,
    iters: int = 20,
    warmup: int = 3,
    graph: bool = True,
) -> float:
    """Median microseconds of one call, timed with CUDA events after `warmup` calls.

    `flush` runs before each timed call, outside the timed interval.
    """
    run = graphed(fn) if graph else fn
    flush = flush or _no_flush
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(iters):
        flush()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbps(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=10, graph=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def matmul_tflops(device="cuda", n: int = 8192, dtype=torch.bfloat16) -> float:
    """Dense n x n x n matmul rate in TFLOP/s (2 n^3 flops per call)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    us = time_us(lambda: a @ b, iters=10, graph=False)
    return 2 * n**3 / (us * 1e-6) / 1e12
