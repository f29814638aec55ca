"""Micro-batch slices: which requests and tokens of a step each micro-batch runs.

Built from the one split (`atom_plugin.tbo.split`) and the step's
`ForwardMode`, and from nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from atom_plugin.tbo.mode import DECODE, PREFILL, ForwardMode
from atom_plugin.tbo.split import UBatchRanges, decode_ubatch_ranges, prefill_ubatch_ranges


@dataclass(frozen=True)
class UBatchSlice:
    """One micro-batch.

    `token_slice` indexes the step's token buffer (padded to the bucket on a
    replay). The micro-batch runs `num_padded_tokens` tokens: its own, then
    padding up to the count all DP ranks agreed on.
    """

    request_slice: slice
    token_slice: slice
    num_padded_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


def ubatch_ranges(mode: ForwardMode, query_lens: Sequence[int]) -> UBatchRanges:
    """A split step's ranges: decode cut at `mode.ubatch_split_bs`, prefill at the midpoint."""
    if not mode.split:
        raise ValueError(f"the step does not split (mode {mode})")
    if mode.kind == DECODE:
        n = len(query_lens)
        limit = mode.bucket if mode.replay else n
        if mode.ubatch_split_bs != limit:
            raise ValueError(
                f"ubatch_split_bs={mode.ubatch_split_bs} must be the "
                f"{'bucket' if mode.replay else 'scheduled requests'} ({limit}) "
                f"for {n} scheduled decode requests"
            )
        return decode_ubatch_ranges(mode.ubatch_split_bs, mode.query_len)
    if mode.kind == PREFILL:
        return prefill_ubatch_ranges(query_lens)
    raise ValueError(f"a {mode.kind!r} step cannot split; split steps are decode or prefill")


def maybe_create_ubatch_slices(
    mode: ForwardMode, query_lens: Sequence[int]
) -> tuple[UBatchSlice, UBatchSlice] | None:
    """The two micro-batch slices of this rank's step, or None when the step does not split.

    `query_lens` are this rank's scheduled requests' new tokens.
    """
    if not mode.split:
        return None
    ranges = ubatch_ranges(mode, query_lens)
    out = []
    for (r0, r1), (t0, t1), padded in zip(
        ranges.requests, ranges.tokens, mode.ubatch_num_tokens, strict=True
    ):
        if t1 - t0 > padded:
            raise ValueError(
                f"micro-batch tokens [{t0}, {t1}) exceed the agreed count {padded}; "
                "the mode was decided from other batch shapes"
            )
        out.append(UBatchSlice(slice(r0, r1), slice(t0, t1), padded))
    return out[0], out[1]
