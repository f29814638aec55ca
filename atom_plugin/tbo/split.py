"""The one definition of how a batch is cut into two micro-batches.

Every consumer (the micro-batch slices, the data-parallel agreement, each
attention backend's per-micro-batch metadata) takes its ranges from here. ATOM
once computed the cut in several places with different formulas and micro-batch
1 silently attended with other requests' context.

Decode batches are cut by requests (`decode_ubatch_request_ranges`); prefill
and mixed batches at the token midpoint (`prefill_ubatch_token_ranges`, with
the requests on each side from `prefill_ubatch_ranges`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_SPLIT_REQUESTS = 2
MIN_SPLIT_TOKENS = 2

Range = tuple[int, int]


def decode_ubatch_request_ranges(num_reqs: int) -> tuple[Range, Range]:
    """Request ranges of the two decode micro-batches: ((0, h), (h, num_reqs)), h = num_reqs // 2.

    On a graph replay `num_reqs` is the bucket; on an eager split it is the
    number of scheduled requests.
    """
    if isinstance(num_reqs, bool) or not isinstance(num_reqs, int):
        raise TypeError(f"num_reqs must be an int, got {num_reqs!r}")
    return _halves(num_reqs, MIN_SPLIT_REQUESTS, f"{num_reqs} decode request(s)")


def _halves(count: int, minimum: int, what: str) -> tuple[Range, Range]:
    """((0, count // 2), (count // 2, count)); `what` names the count in the error below
    `minimum`. The one cut behind both the decode and the prefill split."""
    if count < minimum:
        raise ValueError(f"cannot split {what} into two micro-batches: need at least {minimum}")
    half = count // 2
    return (0, half), (half, count)


def decode_bucket_splits(bs: int) -> bool:
    """Whether a decode bucket of `bs` requests is recorded and run split."""
    return bs > 2


@dataclass(frozen=True)
class UBatchRanges:
    """Request and token ranges of the two micro-batches.

    In a prefill split the request straddling the token cut (if any) is in
    both request ranges: micro-batch 0 holds its first new tokens, micro-batch
    1 the rest, seeing the first part as cached prefix.
    """

    requests: tuple[Range, Range]
    tokens: tuple[Range, Range]

    @property
    def straddles(self) -> bool:
        """Whether one request has new tokens in both micro-batches."""
        return self.requests[0][1] > self.requests[1][0]


def decode_ubatch_ranges(split_bs: int, query_len: int = 1) -> UBatchRanges:
    """Decode ranges at `split_bs` requests of `query_len` tokens each (tokens follow requests)."""
    if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1:
        raise ValueError(f"query_len must be a positive int, got {query_len!r}")
    r0, r1 = decode_ubatch_request_ranges(split_bs)
    return UBatchRanges(
        requests=(r0, r1),
        tokens=((r0[0] * query_len, r0[1] * query_len), (r1[0] * query_len, r1[1] * query_len)),
    )


def prefill_ubatch_token_ranges(num_tokens: int) -> tuple[Range, Range]:
    """Prefill micro-batches' token ranges: ((0, t), (t, num_tokens)), t = num_tokens // 2."""
    return _halves(num_tokens, MIN_SPLIT_TOKENS, f"a batch of {num_tokens} token(s)")


def prefill_ubatch_ranges(query_lens: Sequence[int]) -> UBatchRanges:
    """Cut a prefill (or mixed) batch at its token midpoint (`prefill_ubatch_token_ranges`).

    Micro-batch 0 takes tokens [0, t), micro-batch 1 tokens [t, total). A
    request whose new tokens cross t belongs to both request ranges.
    """
    lens = list(query_lens)
    for i, q in enumerate(lens):
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"query_lens[{i}] = {q!r}: every scheduled request needs >= 1 token")
    tokens = prefill_ubatch_token_ranges(sum(lens))
    cut = tokens[0][1]
    k, start = 0, 0
    while start + lens[k] <= cut:
        start += lens[k]
        k += 1
    # Request k holds token `cut`; it is in micro-batch 0 too when it began before the cut.
    end0 = k + 1 if start < cut else k
    return UBatchRanges(requests=((0, end0), (k, len(lens))), tokens=tokens)
