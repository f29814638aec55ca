"""What both of vLLM's model runners (V1 and Model Runner V2) need to run a split step.

- `builders_per_ubatch`: each micro-batch builds its attention metadata with builders of
  its own (some keep state between `build` and the forward);
- `vllm_slices`: the planned micro-batches in vLLM's `UBatchSlice` type, what vLLM's
  metadata split and input slicing cut at;
- `pad_last_row`: a micro-batch's inputs padded to the token count all DP ranks agreed on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.v1.worker.ubatch_utils import UBatchSlice as VllmUBatchSlice

from atom_plugin.tbo.runner import NUM_UBATCHES
from atom_plugin.tbo.slices import UBatchSlice


def builders_per_ubatch(attn_groups, vllm_config, device, kernel_block_sizes) -> None:
    """Give every attention group one metadata builder per micro-batch (`attn_groups` holds
    one list per KV-cache group, as both runners keep it)."""
    for gid, groups in enumerate(attn_groups):
        for group in groups:
            group.create_metadata_builders(
                vllm_config,
                device,
                kernel_block_sizes[gid] if gid < len(kernel_block_sizes) else None,
                num_metadata_builders=NUM_UBATCHES,
            )


def vllm_slices(slices: Sequence[UBatchSlice]) -> list[VllmUBatchSlice]:
    """The micro-batches' slices in vLLM's type."""
    return [VllmUBatchSlice(s.request_slice, s.token_slice) for s in slices]


def pad_last_row(t: torch.Tensor | None, pad: int, dim: int = 0) -> torch.Tensor | None:
    """`t` with `pad` copies of its last row appended along `dim` (DP padding)."""
    if t is None or not pad:
        return t
    last = t.narrow(dim, t.shape[dim] - 1, 1)
    return torch.cat([t, last.repeat_interleave(pad, dim=dim)], dim=dim)
