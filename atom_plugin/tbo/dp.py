"""Data-parallel agreement: one all_gather over a CPU group, then the same decision everywhere.

Each rank contributes its batch shape and its TBO settings; every rank then
runs `ForwardMode.decide` on the same gathered table. So all ranks split or
none does, they agree on each micro-batch's token count (each pads to it), and
no rank enters a per-micro-batch collective that another rank skips.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist

from atom_plugin.tbo.mode import BatchShape, ForwardMode, GraphKey, TboConfig

# num_reqs, num_tokens, decode_query_len (0 = none), splittable, then the config:
# decode, prefill, prefill_min_tokens, decode_min_requests
_FIELDS = 8


def _encode(shape: BatchShape, config: TboConfig) -> torch.Tensor:
    return torch.tensor(
        [
            shape.num_reqs,
            shape.num_tokens,
            shape.decode_query_len or 0,
            int(shape.splittable),
            int(config.decode),
            int(config.prefill),
            config.prefill_min_tokens,
            config.decode_min_requests,
        ],
        dtype=torch.int64,
    )


def _decode_row(row: list[int]) -> tuple[BatchShape, tuple[int, ...]]:
    num_reqs, num_tokens, qlen, splittable, *cfg = row
    return BatchShape(num_reqs, num_tokens, qlen or None, bool(splittable)), tuple(cfg)


def gather_batch_shapes(
    shape: BatchShape, config: TboConfig, group: dist.ProcessGroup | None = None
) -> list[BatchShape]:
    """Every rank's batch shape, in rank order (the step's one agreement collective).

    `group` must be a CPU (gloo) group. Raises on every rank alike when the
    ranks run different TBO settings.
    """
    backend = dist.get_backend(group)
    if backend != "gloo":
        raise ValueError(
            f"the TBO agreement needs a CPU (gloo) group, got a {backend!r} group; "
            "pass dist.new_group(backend='gloo')"
        )
    world = dist.get_world_size(group)
    mine = _encode(shape, config)
    rows = [torch.empty(_FIELDS, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    decoded = [_decode_row(r.tolist()) for r in rows]
    settings = {cfg for _, cfg in decoded}
    if len(settings) != 1:
        raise ValueError(
            "data-parallel ranks run different TBO settings (decode, prefill, "
            f"prefill_min_tokens, decode_min_requests per rank: {[cfg for _, cfg in decoded]})"
        )
    return [s for s, _ in decoded]


def decide_across_dp(
    shape: BatchShape,
    config: TboConfig,
    graph_keys: Collection[GraphKey] = (),
    group: dist.ProcessGroup | None = None,
) -> ForwardMode:
    """This rank's `ForwardMode`, agreed with every rank of `group` through one all_gather."""
    shapes = gather_batch_shapes(shape, config, group)
    return ForwardMode.decide(shapes, dist.get_rank(group), config, graph_keys)
