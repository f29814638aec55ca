"""`RerunGraphs`, the CPU stand-in for CUDA request graphs, and the vLLM runner's choice on it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from atom_plugin.tbo.graphs import BucketGraphs
from atom_plugin.tbo.mode import GraphKey, TboConfig
from atom_plugin.vllm.tbo.graphs import plan_bucket_graphs


class RerunGraphs:
    """`RequestGraphs`' stand-in on CPU: a 'replay' re-runs the recorded step.

    The step reads what it captured (its static buffers and metadata objects),
    as a replayed graph does, so a step whose inputs do not reach those buffers
    gives stale results here too. The CPU tests run the split-replay paths on it.
    """

    def __init__(self):
        self._steps: dict[GraphKey, Callable[[], Any]] = {}

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._steps

    def keys(self) -> list[GraphKey]:
        return list(self._steps)

    def capture(self, key: GraphKey, step: Callable[[], Any]) -> Any:
        if key in self._steps:
            raise ValueError(f"graph {key} is already captured")
        self._steps[key] = step
        return step()

    def replay(self, key: GraphKey) -> Any:
        try:
            step = self._steps[key]
        except KeyError:
            raise KeyError(f"no graph captured for {key}; captured: {self.keys()}") from None
        return step()


def split_decode_rerun_graphs(
    buckets: Sequence[int],
) -> Callable[..., tuple[BucketGraphs | None, str]]:
    """`split_decode_graphs` for the CPU build: `buckets` recorded on `RerunGraphs`.

    Takes the runner's arguments: `buckets` stand for vLLM's capture sizes, and the
    device and CUDA-graph setting are not asked; backends, `max_num_reqs` and the
    split threshold decide as on a GPU.
    """

    def choose(
        config: TboConfig,
        device_type: str,
        graphs_on: bool,
        capture_sizes: Sequence[int],
        max_num_reqs: int,
        backends: Sequence[str],
        graph_pool: Callable[[], Any],
    ) -> tuple[BucketGraphs | None, str]:
        return plan_bucket_graphs(config, buckets, max_num_reqs, backends, RerunGraphs)

    return choose
