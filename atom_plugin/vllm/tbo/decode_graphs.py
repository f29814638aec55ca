"""Split decode buckets inside vLLM's runner: one request graph each, recorded on first use.

A decode step that `ForwardMode.decide` replays split (a bucket of vLLM's
CUDA-graph capture sizes, at or above `tbo_decode_min_requests`) runs both
micro-batches inside one graph of the plugin's `RequestGraphs`, the class the
TBO harness records and replays on a GPU (`tests/tbo_harness/graphed.py`).
Steps no bucket covers split eagerly; buckets below the threshold keep
vLLM's own graphs.

What a replay needs, and where it comes from:
- the step's inputs in the buffers the graph was recorded with: vLLM's
  persistent input ids, positions, sequence lengths, block tables and slot
  mappings, sliced at the bucket's fixed halves;
- micro-batch metadata with the same layout on every replay: the plugin's
  backends keep their plans in persistent buffers, and a replayed step's
  padding rows own one token each (`pad_rows_one_token_each`), so the
  micro-batches' rebased `query_start_loc` (fresh tensors vLLM's split makes)
  hold the same values every time;
- launch sizes good for any context: the recording step builds its metadata
  as vLLM's own capture does (`for_cudagraph_capture`: the longest context).

Only the plugin's backends (`GRAPH_BACKENDS`) are known to keep that contract;
with any other backend in the model, split decode steps run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from atom_plugin.tbo.graphs import BucketGraphs, RequestGraphs
from atom_plugin.tbo.mode import TboConfig, plan_request_graphs

GRAPH_BACKENDS = ("ATOM_AITER", "ATOM_AITER_MLA")

logger = init_logger("vllm.atom_plugin")


def split_decode_graphs(
    config: TboConfig,
    device_type: str,
    graphs_on: bool,
    capture_sizes: Sequence[int],
    max_num_reqs: int,
    backends: Sequence[str],
    graph_pool: Callable[[], Any],
) -> tuple[BucketGraphs | None, str]:
    """The runner's split decode graphs, or None and why split decode steps run eagerly.

    `graphs_on`: vLLM records CUDA graphs (not --enforce-eager); `capture_sizes`:
    its uniform-decode sizes (tokens = requests at one token each); `graph_pool`
    gives the memory pool to share with vLLM's graphs.
    """
    if not config.decode:
        return None, "decode steps do not split"
    if device_type != "cuda":
        return None, f"no CUDA graphs on {device_type}"
    if not graphs_on:
        return None, "vLLM records no CUDA graphs here (--enforce-eager or cudagraph_mode NONE)"
    return plan_bucket_graphs(
        config,
        capture_sizes,
        max_num_reqs,
        backends,
        lambda: RequestGraphs("cuda", pool=graph_pool()),
    )


def plan_bucket_graphs(
    config: TboConfig,
    buckets: Sequence[int],
    max_num_reqs: int,
    backends: Sequence[str],
    new_graphs: Callable[[], RequestGraphs],
) -> tuple[BucketGraphs | None, str]:
    """`buckets`' graphs on `new_graphs()` (made only when one splits), or None and why."""
    others = sorted(set(backends) - set(GRAPH_BACKENDS))
    if others:
        return None, (
            f"attention backend {', '.join(others)} is not one of {', '.join(GRAPH_BACKENDS)}, "
            "whose micro-batch metadata a replay is known to read correctly"
        )
    buckets = [b for b in buckets if b <= max_num_reqs]
    if not buckets:
        return None, "vLLM records no one-token decode graphs here (no FULL decode capture size)"
    planned = plan_request_graphs(buckets, 1, config)
    if not any(split for _, split in planned):
        return None, (
            f"no capture size of {buckets} reaches tbo_decode_min_requests="
            f"{config.decode_min_requests}"
        )
    return BucketGraphs(new_graphs(), planned), ""


def announce_split_decode_graphs(
    graphs: BucketGraphs | None, why_not: str, config: TboConfig, device_type: str
) -> None:
    """Log `split_decode_graphs`' answer: the buckets that replay, or why split decode steps
    run eagerly (a warning, but only information on a CPU, which records no graphs)."""
    if graphs is not None:
        logger.info(
            "atom-plugin: split decode buckets %s replay split request graphs "
            "(each recorded on its first step)",
            graphs.split_buckets,
        )
    elif config.decode:
        log = logger.warning if device_type != "cpu" else logger.info
        log("atom-plugin: split decode steps run eagerly: %s", why_not)


def pad_rows_one_token_each(
    qsl_np: np.ndarray, qsl: torch.Tensor, num_reqs: int, bucket: int
) -> None:
    """Give the padding rows of a replayed one-token decode step one token each.

    `qsl_np` and `qsl` are the step's query offsets on the host and on the device, whose
    padding rows vLLM leaves empty (flat at the real token count). With one token each,
    every replay of a bucket cuts its micro-batches into the same offsets `[0, 1, ...,
    half]`, the layout the split graph was recorded with, as the harness's padded rows
    (`tests/tbo_harness/graph_buffers.py`); their sequence length stays 0 (vLLM pads it
    so), so they read and write nothing.
    """
    if qsl_np[num_reqs] != num_reqs:
        raise ValueError(
            f"{num_reqs} one-token decode requests cannot end at token {qsl_np[num_reqs]}"
        )
    if bucket > num_reqs:
        rows = slice(num_reqs + 1, bucket + 1)
        qsl_np[rows] = np.arange(num_reqs + 1, bucket + 1, dtype=qsl_np.dtype)
        # Filled in place: one kernel, no temporary tensor to copy from.
        torch.arange(num_reqs + 1, bucket + 1, dtype=qsl.dtype, out=qsl[rows])
