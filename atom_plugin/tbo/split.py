"""The one definition of how a decode batch is cut into two micro-batches.

Every consumer (the micro-batch slices, the data-parallel agreement, each
attention backend's per-micro-batch metadata) takes its ranges from here. ATOM
once computed the cut in several places with different formulas and micro-batch
1 silently attended with other requests' context.
"""

from __future__ import annotations

MIN_SPLIT_REQUESTS = 2


def decode_ubatch_request_ranges(num_reqs: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Request ranges of the two decode micro-batches: ((0, h), (h, num_reqs)), h = num_reqs // 2.

    On a graph replay `num_reqs` is the bucket; on an eager split it is the
    number of scheduled requests.
    """
    if isinstance(num_reqs, bool) or not isinstance(num_reqs, int):
        raise TypeError(f"num_reqs must be an int, got {num_reqs!r}")
    if num_reqs < MIN_SPLIT_REQUESTS:
        raise ValueError(
            f"cannot split {num_reqs} decode request(s) into two micro-batches: "
            f"need at least {MIN_SPLIT_REQUESTS}"
        )
    half = num_reqs // 2
    return (0, half), (half, num_reqs)


def decode_bucket_splits(bs: int) -> bool:
    """Whether a decode bucket of `bs` requests is recorded and run split."""
    return bs > 2
