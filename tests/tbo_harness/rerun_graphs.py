"""`RerunGraphs`, the CPU stand-in for CUDA request graphs, and the vLLM runner's choice on it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from atom_plugin.tbo.graphs import BucketGraphs, RecordedSteps
from atom_plugin.tbo.mode import GraphKey
from atom_plugin.vllm.tbo.decode_graphs import plan_bucket_graphs, split_decode_graphs


class RerunGraphs(RecordedSteps):
    """`RequestGraphs`' stand-in on CPU: a 'replay' re-runs the recorded step.

    The step reads what it captured (its static buffers and metadata objects),
    as a replayed graph does, so a step whose inputs do not reach those buffers
    gives stale results here too. The CPU tests run the split-replay paths on it.
    """

    def capture(self, key: GraphKey, step: Callable[[], Any]) -> Any:
        self._check_new(key)
        self._recorded[key] = step
        return step()

    def replay(self, key: GraphKey) -> Any:
        return self._recording(key)()


def split_decode_rerun_graphs(
    buckets: Sequence[int],
) -> Callable[..., tuple[BucketGraphs | None, str]]:
    """`split_decode_graphs` for the CPU build: `buckets` recorded on `RerunGraphs`.

    Takes the runner's arguments, bound as `split_decode_graphs` takes them: `buckets`
    stand for vLLM's capture sizes, and the device and CUDA-graph setting are not
    asked; backends, `max_num_reqs` and the split threshold decide as on a GPU.
    """

    def choose(*args, **kwargs) -> tuple[BucketGraphs | None, str]:
        runner = inspect.signature(split_decode_graphs).bind(*args, **kwargs).arguments
        config, max_num_reqs = runner["config"], runner["max_num_reqs"]
        return plan_bucket_graphs(config, buckets, max_num_reqs, runner["backends"], RerunGraphs)

    return choose
