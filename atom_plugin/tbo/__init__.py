"""Two-batch overlap: one split, DP agreement, forward mode, micro-batch runner, request graphs.

The request graphs live in `atom_plugin.tbo.graphs`; the DP agreement in
`atom_plugin.tbo.dp`.
"""

from atom_plugin.tbo.mode import (
    BatchShape,
    ForwardMode,
    GraphKey,
    TboConfig,
    plan_request_graphs,
    replay_splits,
)
from atom_plugin.tbo.runner import (
    MicroBatchFailed,
    MicroBatchRunner,
    UBatchContext,
    current_ubatch,
    forward_context,
    record_stream_use,
    switch_to_comm,
    switch_to_compute,
    take_turn,
    yield_and_switch_to_comm,
    yield_and_switch_to_compute,
    yield_to_other,
)
from atom_plugin.tbo.slices import UBatchSlice, maybe_create_ubatch_slices
from atom_plugin.tbo.split import (
    UBatchRanges,
    decode_bucket_splits,
    decode_ubatch_ranges,
    decode_ubatch_request_ranges,
    prefill_ubatch_ranges,
    prefill_ubatch_token_ranges,
)

__all__ = [
    "BatchShape",
    "ForwardMode",
    "GraphKey",
    "MicroBatchFailed",
    "MicroBatchRunner",
    "TboConfig",
    "UBatchContext",
    "UBatchRanges",
    "UBatchSlice",
    "current_ubatch",
    "decode_bucket_splits",
    "decode_ubatch_ranges",
    "decode_ubatch_request_ranges",
    "forward_context",
    "maybe_create_ubatch_slices",
    "plan_request_graphs",
    "prefill_ubatch_ranges",
    "prefill_ubatch_token_ranges",
    "record_stream_use",
    "replay_splits",
    "switch_to_comm",
    "switch_to_compute",
    "take_turn",
    "yield_and_switch_to_comm",
    "yield_and_switch_to_compute",
    "yield_to_other",
]
