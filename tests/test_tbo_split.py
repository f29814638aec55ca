"""Invariant 1: the one split covers the batch contiguously with two non-empty micro-batches."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import atom_plugin.tbo as tbo
from atom_plugin.tbo import (
    decode_bucket_splits,
    decode_ubatch_ranges,
    decode_ubatch_request_ranges,
    prefill_ubatch_ranges,
)


def test_atom_case_25_requests():
    assert decode_ubatch_request_ranges(25) == ((0, 12), (12, 25))
    assert decode_ubatch_request_ranges(32) == ((0, 16), (16, 32))


def test_exported_from_the_package():
    for name in ("decode_ubatch_request_ranges", "decode_bucket_splits", "prefill_ubatch_ranges"):
        assert name in tbo.__all__


@pytest.mark.parametrize("bad", [0, 1, -3])
def test_too_few_requests_raise(bad):
    with pytest.raises(ValueError, match=f"cannot split {bad} decode"):
        decode_ubatch_request_ranges(bad)


@pytest.mark.parametrize("bad", [True, 2.0, "4"])
def test_non_int_requests_raise(bad):
    with pytest.raises(TypeError, match="num_reqs must be an int"):
        decode_ubatch_request_ranges(bad)


@given(st.integers(2, 4096))
def test_decode_ranges_cover_contiguously(n):
    (a0, b0), (a1, b1) = decode_ubatch_request_ranges(n)
    assert (a0, b1) == (0, n) and b0 == a1 == n // 2
    assert a0 < b0 and a1 < b1


@given(st.integers(0, 600))
def test_bucket_gate(bs):
    assert decode_bucket_splits(bs) == (bs > 2)


@given(st.integers(2, 512), st.integers(1, 5))
def test_decode_token_ranges_follow_requests(n, q):
    r = decode_ubatch_ranges(n, q)
    assert r.requests == decode_ubatch_request_ranges(n)
    assert r.tokens == tuple((a * q, b * q) for a, b in r.requests)
    assert not r.straddles


def test_decode_ranges_reject_bad_query_len():
    with pytest.raises(ValueError, match="query_len must be a positive int"):
        decode_ubatch_ranges(8, 0)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30).filter(lambda q: sum(q) >= 2))
def test_prefill_split_at_token_midpoint(query_lens):
    r = prefill_ubatch_ranges(query_lens)
    total, cut = sum(query_lens), sum(query_lens) // 2
    assert r.tokens == ((0, cut), (cut, total))
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    # A request is in a micro-batch exactly when some of its new tokens are.
    in0 = [i for i, s in enumerate(starts) if s < cut]
    in1 = [i for i, (s, q) in enumerate(zip(starts, query_lens, strict=True)) if s + q > cut]
    assert r.requests[0] == (0, len(in0)) and in0 == list(range(len(in0)))
    assert r.requests[1] == (in1[0], len(query_lens)) and in1 == list(
        range(in1[0], len(query_lens))
    )
    assert r.requests[0][0] < r.requests[0][1] and r.requests[1][0] < r.requests[1][1]
    assert r.straddles == any(s < cut < s + q for s, q in zip(starts, query_lens, strict=True))


def test_prefill_straddling_request():
    # tokens: r0 [0,3) r1 [3,8) r2 [8,10); cut 5 falls inside r1
    r = prefill_ubatch_ranges([3, 5, 2])
    assert r.requests == ((0, 2), (1, 3)) and r.tokens == ((0, 5), (5, 10)) and r.straddles


@pytest.mark.parametrize(
    ("lens", "match"),
    [([1], "batch of 1 token"), ([], "batch of 0 token"), ([3, 0, 2], r"query_lens\[1\] = 0")],
)
def test_prefill_bad_input_raises(lens, match):
    with pytest.raises(ValueError, match=match):
        prefill_ubatch_ranges(lens)
