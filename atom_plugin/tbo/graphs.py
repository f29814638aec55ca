"""Request graphs: each decode bucket recorded as one CUDA graph, split ones included.

A split bucket's graph holds both micro-batches: the step function calls the
`MicroBatchRunner`, whose workers issue onto the capture stream and a comm
stream forked from it, joined back before the step returns. A replay reads
static buffers, which the caller rewrites in place before it (the full batch's
and each micro-batch's metadata, cut at the bucket).
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from atom_plugin.tbo.mode import GraphKey

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (restored as it was).

    A collection that runs during a capture (from any thread that allocates) may free
    cyclic garbage holding an older `torch.cuda.CUDAGraph`; destroying a graph is not
    permitted while a stream captures, so the capture is invalidated (the next launch
    fails, e.g. CUBLAS_STATUS_INTERNAL_ERROR, then cudaErrorStreamCaptureInvalidated at
    the end). `torch.cuda.graph` no longer collects before a capture, so whether this
    happens depends on when the collector's thresholds trip: on allocations anywhere.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RecordedSteps:
    """What a step recorded under each `GraphKey`: the bookkeeping `RequestGraphs` and
    its CPU stand-in (`tests/tbo_harness/rerun_graphs.py`) share."""

    def __init__(self) -> None:
        self._recorded: dict[GraphKey, Any] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._recorded

    def keys(self) -> list[GraphKey]:
        return list(self._recorded)

    def _check_new(self, key: GraphKey) -> None:
        if key in self._recorded:
            raise ValueError(f"graph {key} is already captured")

    def _recording(self, key: GraphKey) -> Any:
        try:
            return self._recorded[key]
        except KeyError:
            raise KeyError(f"no graph captured for {key}; captured: {self.keys()}") from None


class RequestGraphs(RecordedSteps):
    """CUDA graphs keyed by (bucket, query length), sharing one memory pool.

    `capture(key, step)` warms `step` up on a side stream, then records it;
    `replay(key)` replays and returns the static outputs of the capture
    (overwritten by the next replay of that graph). `pool`: a graph memory pool
    to share (vLLM's global one inside vLLM); a new one by default.
    """

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        capture_error_mode: str = "thread_local",
        warmup_steps: int = 2,
        pool: Any = None,
    ):
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode {capture_error_mode!r} is not one of "
                f"{', '.join(CAPTURE_ERROR_MODES)}"
            )
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (compiles kernels), got {warmup_steps}")
        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"request graphs need a CUDA device, got {self.device}")
        self.capture_error_mode = capture_error_mode
        self.warmup_steps = warmup_steps
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool

    def capture(self, key: GraphKey, step: Callable[[], Any]) -> Any:
        """Record `step` (which must only read static buffers) as the graph of `key`.
        The cyclic garbage collector is paused during the capture (`gc_paused`)."""
        self._check_new(key)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_steps):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with (
            gc_paused(),
            torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode),
        ):
            outputs = step()
        self._recorded[key] = (graph, outputs)
        return outputs

    def replay(self, key: GraphKey) -> Any:
        graph, outputs = self._recording(key)
        graph.replay()
        return outputs


class BucketGraphs:
    """The decode buckets' request graphs, each recorded on the first step that replays it.

    `graphs` is a `RequestGraphs` (or a stand-in with its `capture`, `replay`
    and `in`, as the CPU tests use); `planned` is `plan_request_graphs`' answer.
    `keys` are every bucket, for `ForwardMode.decide` (which picks the bucket a
    step pads to and whether its replay splits); `split_buckets` those recorded
    split.
    """

    def __init__(self, graphs: RequestGraphs, planned: Sequence[tuple[GraphKey, bool]]):
        self.graphs = graphs
        self.keys: list[GraphKey] = [key for key, _ in planned]
        self.split_buckets: list[int] = [key.bucket for key, split in planned if split]

    def recorded(self, key: GraphKey) -> bool:
        return key in self.graphs

    def run(self, key: GraphKey, step: Callable[[], Any] | None, steps: Counter) -> Any:
        """Replay `key`'s graph, recording `step` first on the bucket's first step (`step`
        may be None once `recorded(key)`); counts `steps["captured"]` and `steps["replayed"]`."""
        if key not in self.keys:
            raise KeyError(f"{key} is not a planned bucket: {self.keys}")
        if key not in self.graphs:
            if step is None:
                raise ValueError(f"{key} is not recorded yet and no step was given to record")
            self.graphs.capture(key, step)
            steps["captured"] += 1
        steps["replayed"] += 1
        return self.graphs.replay(key)
