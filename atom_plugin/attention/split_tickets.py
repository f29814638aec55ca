"""Counters on which the programs of one split-KV decode launch count themselves in.

The split kernel merges a row's splits in the program that finishes last (the one whose
ticket is the split count less one) instead of in a second kernel; that program sets the
counter back to zero, so a buffer is all zeros between launches and the host never clears
it. Launches that may run at the same time (two-batch overlap on two compute streams)
must not share counters: each stream has its own buffer. A buffer is never freed, because
a captured CUDA graph keeps its address.
"""

from __future__ import annotations

import torch

MIN_TICKETS = 4096  # 16 KB: every (row, kv head) of a decode step that splits, in practice

_buffers: dict[tuple[str, int | None, int], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # replaced by a larger buffer, still held for graphs


def split_tickets(device: torch.device, count: int) -> torch.Tensor:
    """An int32 buffer of at least `count` zeros for launches on `device`'s current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    tickets = _buffers.get(key)
    if tickets is None or tickets.numel() < count:
        if tickets is not None:
            _outgrown.append(tickets)
        size = max(MIN_TICKETS, 1 << (count - 1).bit_length())
        tickets = _buffers[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return tickets
