"""The step's TBO mode agreed over vLLM's DP group, as both model runners ask for it."""

from __future__ import annotations

from collections.abc import Collection

from atom_plugin.tbo.mode import BatchShape, ForwardMode, GraphKey, TboConfig


def agree_across_dp(
    shape: BatchShape, config: TboConfig, graph_keys: Collection[GraphKey]
) -> ForwardMode:
    """This rank's mode, agreed over vLLM's DP CPU group in one all_gather.

    Where vLLM runs a step without coordinating its DP ranks (`skip_dp_coordination`,
    e.g. elastic EP's kernel reuse), the other ranks make no matching call, so this rank
    decides alone.
    """
    from vllm.distributed.parallel_state import get_dp_group
    from vllm.v1.worker.dp_utils import should_skip_dp_coordination

    from atom_plugin.tbo.dp import decide_across_dp

    if should_skip_dp_coordination():
        return ForwardMode.decide([shape], 0, config, graph_keys)
    return decide_across_dp(shape, config, graph_keys, group=get_dp_group().cpu_group)
