"""TBO-on outputs equal TBO-off outputs on the test model, eagerly on CPU (invariants 2, 5, 6).

The check compares hidden states and the whole KV cache after the step, so a
micro-batch that attends with another request's context or writes another
request's slots fails it. `test_atom_mismatch_is_caught` reintroduces ATOM's
bug and shows the check then fails.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tbo_harness.batches import make_batch, random_decode_batch, run_split, run_step, run_unsplit
from tbo_harness.graph_buffers import pad_decode_rows
from tbo_harness.model import KVCaches, LocalComm, ModelConfig, OneRankComm, TboTestModel
from tbo_harness.ubatch_metadata import prepare_ubatch_decode

from atom_plugin.tbo import (
    BatchShape,
    ForwardMode,
    MicroBatchRunner,
    TboConfig,
    current_ubatch,
    maybe_create_ubatch_slices,
    plan_request_graphs,
)

CFG = ModelConfig()
NUM_BLOCKS = 700
MAX_BLOCKS = 4


@pytest.fixture(scope="module")
def model():
    return TboTestModel(CFG, "cpu", seed=0)


@pytest.fixture(scope="module")
def caches():
    return KVCaches.random(CFG, NUM_BLOCKS, "cpu", seed=1)


@pytest.fixture(scope="module")
def runner():
    with MicroBatchRunner("cpu", timeout_s=60) as r:
        yield r


def assert_same_step(out, out_caches, ref, ref_caches):
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(out_caches.raw, ref_caches.raw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def check_tbo_equals_reference(model, runner, caches, batch, mode):
    assert mode.split
    ref_caches, out_caches = caches.clone(), caches.clone()
    ref = run_unsplit(model, batch, ref_caches)
    out = run_step(model, runner, batch, out_caches, mode)
    assert_same_step(out, out_caches, ref, ref_caches)


def keys(buckets):
    return [k for k, _ in plan_request_graphs(buckets, 1, TboConfig())]


@settings(max_examples=12, deadline=None)
@given(st.integers(3, 96), st.lists(st.integers(3, 128), max_size=4), st.integers(0, 10**6))
def test_decode_tbo_on_equals_off(model, runner, caches, n, buckets, seed):
    """Eager split at the scheduled requests, or the replay layout cut at the bucket."""
    batch = random_decode_batch(CFG, n, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed)
    mode = ForwardMode.decide(
        [BatchShape.from_query_lens(batch.query_lens)], 0, TboConfig(), keys(buckets)
    )
    check_tbo_equals_reference(model, runner, caches, batch, mode)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 6),
    st.lists(st.integers(2, 9), min_size=1, max_size=6),
    st.integers(0, 10**6),
)
def test_prefill_and_mixed_tbo_on_equals_off(model, runner, caches, decodes, prefills, seed):
    """Token-midpoint split, straddling requests included (decodes first, as vLLM orders them)."""
    lens = [1] * decodes + prefills
    ctx = [(seed >> i) % 5 for i in range(len(lens))]
    batch = make_batch(CFG, lens, ctx, 4, NUM_BLOCKS, "cpu", seed)
    mode = ForwardMode.decide([BatchShape.from_query_lens(lens)], 0, TboConfig(), ())
    assert mode.kind == "prefill"
    check_tbo_equals_reference(model, runner, caches, batch, mode)


def test_straddling_prefill_request(model, runner, caches):
    batch = make_batch(CFG, [1, 1, 5, 7, 3], [3, 4, 2, 6, 0], 4, NUM_BLOCKS, "cpu", seed=5)
    mode = ForwardMode.decide([BatchShape.from_query_lens(batch.query_lens)], 0, TboConfig(), ())
    s0, s1 = maybe_create_ubatch_slices(mode, batch.query_lens)
    assert s0.request_slice.stop - 1 == s1.request_slice.start == 3  # request 3 straddles
    check_tbo_equals_reference(model, runner, caches, batch, mode)


def test_dp_padded_micro_batches_equal_unsplit(model, runner, caches):
    """An eager split padded to counts agreed with a rank that scheduled more requests."""
    batch = random_decode_batch(CFG, 25, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed=7)
    mode = ForwardMode.decide([BatchShape(25, 25, 1), BatchShape(32, 32, 1)], 0, TboConfig(), ())
    assert mode.ubatch_split_bs == 25 and mode.ubatch_num_tokens == (16, 16)
    check_tbo_equals_reference(model, runner, caches, batch, mode)


def test_atom_mismatch_is_caught(model, runner, caches):
    """ATOM's bug: slices cut from the 25 scheduled requests, metadata cut at half the bucket (32).

    The equality check must fail on it; with the metadata cut where the
    slices are cut, the same padded step passes.
    """
    batch = random_decode_batch(CFG, 25, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed=11)
    mode = ForwardMode.decide([BatchShape(25, 25, 1), BatchShape(32, 32, 1)], 0, TboConfig(), ())
    slices = maybe_create_ubatch_slices(mode, batch.query_lens)
    assert [s.token_slice for s in slices] == [slice(0, 12), slice(12, 25)]
    ref_caches = caches.clone()
    ref = run_unsplit(model, batch, ref_caches)

    bucket_metas = prepare_ubatch_decode(pad_decode_rows(batch.meta, 32), 32)
    bad_caches = caches.clone()
    bad = run_split(model, runner, batch.input_ids, bad_caches, slices, bucket_metas)
    with pytest.raises(AssertionError):
        assert_same_step(bad, bad_caches, ref, ref_caches)
    # Requests 12..15 ran with other rows' metadata: wrong outputs, and KV written into their slots.
    assert not torch.allclose(bad[12:], ref[12:], atol=1e-3)

    good_metas = prepare_ubatch_decode(batch.meta, mode.ubatch_split_bs)
    good_caches = caches.clone()
    good = run_split(model, runner, batch.input_ids, good_caches, slices, good_metas)
    assert_same_step(good, good_caches, ref, ref_caches)


def test_requests_attend_only_to_their_own_kv(model, runner, caches):
    """Invariant 5: changing one request's cached history changes only that request's output."""
    batch = random_decode_batch(CFG, 9, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed=13)
    mode = ForwardMode.decide([BatchShape(9, 9, 1)], 0, TboConfig(), ())
    base = run_step(model, runner, batch, caches.clone(), mode)
    seq_lens = batch.meta.seq_lens.tolist()
    for victim in (0, 4, 5, 8):  # both micro-batches, both edges of the cut
        perturbed = caches.clone()
        nblocks = -(-(seq_lens[victim] - 1) // CFG.block_size)  # history only
        if nblocks == 0:
            continue
        for raw in perturbed.raw:
            raw[batch.meta.block_table[victim, :nblocks].long()] += 1.0
        out = run_step(model, runner, batch, perturbed, mode)
        others = [i for i in range(9) if i != victim]
        torch.testing.assert_close(out[others], base[others], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out[victim], base[victim], atol=1e-3)


@pytest.mark.parametrize("record_on_first_step", [False, True], ids=["up-front", "first-step"])
@pytest.mark.parametrize("tbo_decode", [True, False])
def test_graph_steps_read_only_refreshed_static_buffers(
    model, runner, caches, tbo_decode, record_on_first_step
):
    """The recorded step reads static buffers only; a refresh in place is all a replay needs."""
    from tbo_harness.graphed import GraphedDecoder
    from tbo_harness.rerun_graphs import RerunGraphs

    graph_caches = caches.clone()
    config = TboConfig(decode=tbo_decode)
    dec = GraphedDecoder(
        model,
        graph_caches,
        runner,
        [4, 8, 32],
        config,
        MAX_BLOCKS,
        graphs=RerunGraphs(),
        record_on_first_step=record_on_first_step,
    )
    for n in (25, 3, 32, 7, 1):
        batch = random_decode_batch(CFG, n, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed=50 + n)
        assert dec.mode(batch).split == tbo_decode  # every bucket here is > 2, even for n = 1
        for raw, src in zip(graph_caches.raw, caches.raw, strict=True):
            raw.copy_(src)
        ref_caches = caches.clone()
        ref = run_unsplit(model, batch, ref_caches)
        assert_same_step(dec.step(batch).clone(), graph_caches, ref, ref_caches)
    assert dec.steps == {"captured": 3, "replayed": 5}


class RecordingComm(OneRankComm):
    """One rank's identity collectives that log which micro-batch issued each, in order."""

    def __init__(self):
        super().__init__()
        self.log = []

    def _note(self, op: str) -> None:
        ctx = current_ubatch()  # None in the unsplit reference step
        self.log.append((op, None if ctx is None else ctx.id))

    def dispatch(self, x):
        self._note("dispatch")
        return super().dispatch(x)

    def combine(self, y):
        self._note("combine")
        return super().combine(y)


@pytest.mark.parametrize(
    "overlap, layer_order",
    [
        ("per_comm", [("dispatch", 0), ("dispatch", 1), ("combine", 0), ("combine", 1)]),
        ("staged", [("dispatch", 0), ("combine", 0), ("dispatch", 1), ("combine", 1)]),
    ],
)
def test_overlap_schedule_orders_the_collectives(caches, runner, overlap, layer_order):
    """The order the comm stream (and every DP rank) sees, and TBO-on still equals TBO-off."""
    comm = RecordingComm()
    model = TboTestModel(CFG, "cpu", comm=comm, seed=0, overlap=overlap)
    batch = random_decode_batch(CFG, 9, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed=17)
    mode = ForwardMode.decide([BatchShape(9, 9, 1)], 0, TboConfig(), ())
    check_tbo_equals_reference(model, runner, caches, batch, mode)
    split_log = comm.log[-4 * CFG.layers :]
    assert split_log == layer_order * CFG.layers


def test_staged_overlap_prefill_equals_unsplit(caches, runner):
    model = TboTestModel(CFG, "cpu", seed=0, overlap="staged")
    lens = [1, 1, 5, 7, 3]
    batch = make_batch(CFG, lens, [3, 4, 2, 6, 0], 4, NUM_BLOCKS, "cpu", seed=19)
    mode = ForwardMode.decide([BatchShape.from_query_lens(lens)], 0, TboConfig(), ())
    check_tbo_equals_reference(model, runner, caches, batch, mode)


def test_unknown_overlap_schedule_is_refused(model):
    choices = r"\('per_comm', 'staged'\)"
    with pytest.raises(ValueError, match=f"overlap='per_token' is not one of {choices}"):
        TboTestModel(CFG, "cpu", overlap="per_token")
    with pytest.raises(ValueError, match="overlap='x' is not one of"):
        model.overlap = "x"
    assert model.overlap == "per_comm"
    odd = ModelConfig(heads=3, kv_heads=1)
    with pytest.raises(ValueError, match="cuts the attention by KV-head halves; kv_heads=1 is odd"):
        TboTestModel(odd, "cpu", overlap="staged")


def test_one_rank_comm_stands_in_for_the_other_ranks():
    """Dispatch returns every rank's rows (copies of this rank's), combine keeps this rank's."""
    comm = OneRankComm(world=4, rank=1)
    x = torch.arange(6.0).view(3, 2)
    torch.testing.assert_close(comm.dispatch(x), torch.cat([x] * 4))
    y = torch.arange(24.0).view(12, 2)
    torch.testing.assert_close(comm.combine(y), y[3:6])
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        OneRankComm(world=2, rank=2)
    with pytest.raises(ValueError, match="rank 0 is not in a world of 0"):
        LocalComm(world=0)


@pytest.mark.parametrize("overlap", ["per_comm", "staged"])
def test_one_rank_of_expert_parallel_tbo_on_equals_off(caches, runner, overlap):
    """One rank of 4: it holds one of the 4 experts, which sees 4 ranks' tokens."""
    model = TboTestModel(CFG, "cpu", comm=LocalComm(world=4), seed=0, overlap=overlap)
    assert model.layers[0]["w_up"].shape == (CFG.hidden, CFG.ffn)
    assert model.layers[0]["experts"] == slice(0, 1)
    batch = random_decode_batch(CFG, 11, MAX_BLOCKS, NUM_BLOCKS, "cpu", seed=23)
    mode = ForwardMode.decide([BatchShape(11, 11, 1)], 0, TboConfig(), ())
    check_tbo_equals_reference(model, runner, caches, batch, mode)
    with pytest.raises(ValueError, match="4 experts do not shard over 3 ranks"):
        TboTestModel(CFG, "cpu", comm=LocalComm(world=3))
