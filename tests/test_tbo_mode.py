"""ForwardMode.decide, the slices and the per-micro-batch metadata (invariants 2, 3, 4, 7).

The slices, the agreed per-micro-batch token counts and the backends'
per-micro-batch rows must all come from the same ranges; padding rows must be
inert; every bucket must have a graph and buffers; capture and replay buffers
are the same tensors.
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tbo_harness.batches import make_batch
from tbo_harness.graph_buffers import DecodeGraphBuffers, pad_decode_rows
from tbo_harness.model import ModelConfig
from tbo_harness.ubatch_metadata import prepare_ubatch_decode, ubatch_metadata

from atom_plugin.tbo import (
    BatchShape,
    ForwardMode,
    GraphKey,
    TboConfig,
    decode_ubatch_request_ranges,
    maybe_create_ubatch_slices,
    plan_request_graphs,
    replay_splits,
)

CFG = ModelConfig()
BUCKETS = st.lists(st.integers(1, 512), min_size=1, max_size=8).map(lambda b: sorted(set(b)))


def keys(buckets, query_len=1, config=None):
    return [k for k, _ in plan_request_graphs(buckets, query_len, config or TboConfig())]


def decode_shape(n, q=1):
    return BatchShape(n, n * q, q if n else None)


def decode_meta(n, rows=None):
    """A decode batch of n requests (metadata only; block table rows padded as a builder does)."""
    b = make_batch(CFG, [1] * n, [2] * n, 2, 2 * n + 2, "cpu", seed=n)
    return b.meta if rows is None else pad_decode_rows(b.meta, rows)


def test_atom_case_replay_cuts_at_the_bucket():
    mode = ForwardMode.decide([decode_shape(25)], 0, TboConfig(), keys([8, 16, 32, 64]))
    assert (mode.replay, mode.split, mode.bucket, mode.ubatch_split_bs) == (True, True, 32, 32)
    s0, s1 = maybe_create_ubatch_slices(mode, [1] * 25)
    assert (s0.request_slice, s1.request_slice) == (slice(0, 16), slice(16, 32))
    m0, m1 = ubatch_metadata(pad_decode_rows(decode_meta(25), 32), mode, [1] * 25)
    assert (m0.num_reqs, m1.num_reqs) == (16, 16)
    assert m1.seq_lens[9:].eq(0).all() and m1.slot_mapping[9:].eq(-1).all()  # rows 25..31 inert


def test_atom_case_eager_cuts_at_the_scheduled_requests():
    mode = ForwardMode.decide([decode_shape(25)], 0, TboConfig(), ())
    assert (mode.replay, mode.split, mode.ubatch_split_bs, mode.ubatch_num_tokens) == (
        False,
        True,
        25,
        (12, 13),
    )
    s0, s1 = maybe_create_ubatch_slices(mode, [1] * 25)
    assert (s0.token_slice, s1.token_slice) == (slice(0, 12), slice(12, 25))


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 512), BUCKETS)
def test_slices_counts_and_backend_rows_share_ranges(n, buckets):
    mode = ForwardMode.decide([decode_shape(n)], 0, TboConfig(), keys(buckets))
    fits = [b for b in buckets if b >= n]
    assert mode.replay == bool(fits)
    assert mode.bucket == (fits[0] if fits else None)
    assert mode.split  # n > 2, and a bucket >= n > 2 splits too
    split_bs = mode.bucket if mode.replay else n
    assert mode.ubatch_split_bs == split_bs
    ranges = decode_ubatch_request_ranges(split_bs)
    slices = maybe_create_ubatch_slices(mode, [1] * n)
    meta = pad_decode_rows(decode_meta(n), split_bs) if mode.replay else decode_meta(n)
    metas = ubatch_metadata(meta, mode, [1] * n)
    full = pad_decode_rows(decode_meta(n), split_bs)
    for (a, b), s, m, agreed in zip(ranges, slices, metas, mode.ubatch_num_tokens, strict=True):
        assert s.request_slice == slice(a, b) and s.token_slice == slice(a, b)
        assert s.num_padded_tokens == agreed == b - a == m.num_reqs == m.num_actual_tokens
        assert m.query_start_loc.tolist() == list(range(b - a + 1))  # rebased to 0
        assert torch.equal(m.block_table, full.block_table[a:b])
        assert torch.equal(m.seq_lens, full.seq_lens[a:b])
        assert torch.equal(m.slot_mapping, full.slot_mapping[a:b])
        padding = torch.arange(a, b) >= n
        assert m.seq_lens[padding].eq(0).all() and m.slot_mapping[padding].eq(-1).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=20).filter(lambda q: sum(q) >= 2))
def test_prefill_metadata_cut_at_token_midpoint(query_lens):
    lens = sorted(query_lens, key=lambda q: q != 1)  # decodes first
    ctx = [3] * len(lens)
    b = make_batch(CFG, lens, ctx, 20, 400, "cpu", seed=1)
    mode = ForwardMode.decide([BatchShape.from_query_lens(lens)], 0, TboConfig(), ())
    if all(q == 1 for q in lens):
        assert mode.kind == "decode"
        return
    s0, s1 = maybe_create_ubatch_slices(mode, lens)
    m0, m1 = ubatch_metadata(b.meta, mode, lens)
    total = sum(lens)
    assert (s0.token_slice, s1.token_slice) == (slice(0, total // 2), slice(total // 2, total))
    assert (m0.num_actual_tokens, m1.num_actual_tokens) == (total // 2, total - total // 2)
    assert torch.equal(torch.cat([m0.slot_mapping, m1.slot_mapping]), b.meta.slot_mapping)
    for s, m in ((s0, m0), (s1, m1)):
        assert m.num_reqs == s.request_slice.stop - s.request_slice.start
        assert int(m.query_start_loc[0]) == 0 and int(m.query_start_loc[-1]) == s.num_tokens
        assert torch.equal(m.block_table, b.meta.block_table[s.request_slice])
    # The straddling request ends micro-batch 0 early and keeps its whole context in micro-batch 1.
    assert int(m1.seq_lens[0]) == int(b.meta.seq_lens[s1.request_slice.start])
    last = s0.request_slice.stop - 1
    after_cut = sum(lens[: last + 1]) - total // 2
    assert int(m0.seq_lens[-1]) == int(b.meta.seq_lens[last]) - after_cut


@given(st.integers(1, 300), BUCKETS, st.booleans())
def test_every_bucket_has_a_graph_and_buffers(n_max, buckets, tbo_decode):
    """Invariant 4: each batch up to the largest bucket replays a recorded graph of its split."""
    config = TboConfig(decode=tbo_decode)
    plan = dict(plan_request_graphs(buckets, 1, config))
    for n in range(1, max(buckets) + 1):
        mode = ForwardMode.decide([decode_shape(n)], 0, config, list(plan))
        assert mode.replay and mode.graph_key in plan
        assert mode.split == plan[mode.graph_key] == (tbo_decode and mode.bucket > 2)
    for key, split in plan.items():
        if key.bucket <= 64:  # building buffers for every bucket is slow; the rule is the same
            bufs = DecodeGraphBuffers(key, split, 2, CFG.block_size, "cpu")
            assert (bufs.ubatches is not None) == split


def test_static_buffers_refresh_in_place():
    """Invariant 7 (CPU part): replay buffers are the captured tensors, rewritten in place."""
    key = GraphKey(32, 1)
    bufs = DecodeGraphBuffers(key, True, 2, CFG.block_size, "cpu")
    tensors = [bufs.full.meta, *bufs.ubatches]
    names = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    ptrs = [getattr(m, f).data_ptr() for m in tensors for f in names]
    for n in (25, 3, 32):
        meta = decode_meta(n)
        bufs.refresh(meta)
        assert [getattr(m, f).data_ptr() for m in tensors for f in names] == ptrs
        expected = prepare_ubatch_decode(pad_decode_rows(meta, 32), 32)
        for static, want in zip(bufs.ubatches, expected, strict=True):
            for f in names:
                assert torch.equal(getattr(static, f), getattr(want, f))
    with pytest.raises(ValueError, match="does not fit graph"):
        bufs.refresh(decode_meta(33))
    with pytest.raises(ValueError, match="33 requests do not fit the captured 32 rows"):
        bufs.full.write_padded(decode_meta(33))
    with pytest.raises(ValueError, match="max_seq_len=9 exceeds the graph's bound 8"):
        bufs.refresh(dataclasses.replace(decode_meta(4), max_seq_len=9))


SHAPES = st.one_of(
    st.integers(0, 300).map(decode_shape),
    st.integers(2, 300).map(lambda t: BatchShape(1, t, None)),
    st.integers(1, 40).map(lambda n: decode_shape(n, 2)),
)


@given(st.lists(SHAPES, min_size=1, max_size=6), BUCKETS)
def test_all_ranks_split_or_none_with_agreed_counts(shapes, buckets):
    """Invariant 3 on the decision: every rank reaches the same split, bucket and counts."""
    modes = [ForwardMode.decide(shapes, r, TboConfig(), keys(buckets)) for r in range(len(shapes))]
    first = modes[0]
    for m in modes:
        assert (m.kind, m.split, m.replay, m.bucket, m.ubatch_num_tokens) == (
            first.kind,
            first.split,
            first.replay,
            first.bucket,
            first.ubatch_num_tokens,
        )
    kinds = {s.kind for s in shapes} - {"idle"}
    if len(kinds) > 1:
        assert not first.split and not first.replay
    if first.split and not first.replay:
        for s, m in zip(shapes, modes, strict=True):
            if first.kind == "decode":
                own = decode_ubatch_request_ranges(s.num_reqs)
                assert all(b - a <= c for (a, b), c in zip(own, m.ubatch_num_tokens, strict=True))
            else:
                assert s.num_tokens // 2 <= m.ubatch_num_tokens[0]
    if not first.split:
        assert all(m.num_padded_tokens >= s.num_tokens for s, m in zip(shapes, modes, strict=True))


def test_idle_rank_joins_a_split_replay_but_blocks_an_eager_split():
    shapes = [decode_shape(25), decode_shape(0)]
    replay = ForwardMode.decide(shapes, 1, TboConfig(), keys([32]))
    assert replay.split and replay.ubatch_split_bs == 32 and replay.ubatch_num_tokens == (16, 16)
    assert not ForwardMode.decide(shapes, 0, TboConfig(), ()).split


def test_mixed_modes_never_split():
    shapes = [decode_shape(25), BatchShape(2, 40, None)]
    for r in range(2):
        mode = ForwardMode.decide(shapes, r, TboConfig(), keys([32]))
        assert mode.kind == "mixed" and not mode.split and not mode.replay
        assert mode.num_padded_tokens == 40


def test_tbo_off_never_splits():
    off = TboConfig(decode=False, prefill=False)
    assert not ForwardMode.decide([decode_shape(25)], 0, off, keys([32], config=off)).split
    assert not ForwardMode.decide([BatchShape(3, 90)], 0, off, ()).split
    assert (
        maybe_create_ubatch_slices(ForwardMode.decide([BatchShape(3, 90)], 0, off), [30] * 3)
        is None
    )


def test_speculative_decode_replays_unsplit():
    mode = ForwardMode.decide([decode_shape(10, 3)], 0, TboConfig(), keys([16], query_len=3))
    assert mode.replay and not mode.split and mode.graph_key == GraphKey(16, 3)


def test_slices_reject_a_mode_for_other_requests():
    mode = ForwardMode.decide([decode_shape(25)], 0, TboConfig(), ())
    with pytest.raises(ValueError, match="ubatch_split_bs=25 must be the scheduled requests"):
        maybe_create_ubatch_slices(mode, [1] * 30)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((3, 5, 1), "cannot hold num_tokens=5"),
        ((0, 4, None), "disagree"),
        ((-1, 0, None), "num_reqs must be an int >= 0"),
    ],
)
def test_bad_batch_shapes_raise(args, match):
    with pytest.raises(ValueError, match=match):
        BatchShape(*args)


def test_bad_decide_arguments_raise():
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ForwardMode.decide([decode_shape(4)], 2, TboConfig())
    with pytest.raises(ValueError, match="prefill_min_tokens"):
        TboConfig(prefill_min_tokens=1)


def test_modes_and_the_decode_threshold():
    assert TboConfig.for_mode("off") is None
    config = TboConfig.for_mode("decode", decode_min_requests=64, prefill_min_tokens=512)
    assert (config.decode, config.prefill) == (True, False)
    assert not config.decode_splits(63) and config.decode_splits(64)
    assert not ForwardMode.decide([decode_shape(63)], 0, config).split
    assert ForwardMode.decide([decode_shape(64)], 0, config).split
    assert not replay_splits(GraphKey(32, 1), config) and replay_splits(GraphKey(64, 1), config)
    with pytest.raises(ValueError, match="TBO mode 'some' is not one of off, prefill, decode, all"):
        TboConfig.for_mode("some")
    with pytest.raises(ValueError, match="decode_min_requests must be an int >= 3, got 2"):
        TboConfig(decode_min_requests=2)


def test_one_unsplittable_rank_keeps_every_rank_whole():
    shapes = [BatchShape(2, 40, None), BatchShape(3, 90, None, splittable=False)]
    assert ForwardMode.decide(shapes[:1], 0, TboConfig()).split
    assert not any(ForwardMode.decide(shapes, r, TboConfig()).split for r in range(2))
