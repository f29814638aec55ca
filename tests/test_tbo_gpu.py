"""TBO on a CUDA GPU: eager split and request-graph replay equal the unsplit step (invariants 6, 7).

The comm step of each layer is a stand-in kernel on the comm stream, so the
micro-batches really overlap and a missing stream dependency shows up as
wrong numbers. Run on the H200: `pytest -m gpu tests/test_tbo_gpu.py`.
"""

import pytest
import torch
from tbo_harness.batches import make_batch, random_decode_batch, run_step, run_unsplit
from tbo_harness.model import GPU_CONFIG, CopyComm, KVCaches, LocalComm, TboTestModel

import atom_plugin.tbo as tbo
from atom_plugin.tbo import BatchShape, ForwardMode, MicroBatchFailed, MicroBatchRunner, TboConfig

pytestmark = pytest.mark.gpu

CFG = GPU_CONFIG
NUM_BLOCKS, MAX_BLOCKS = 2048, 8
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
SLEEP_CYCLES_PER_TOKEN = 2000  # stand-in comm: ~1 us per token per call at ~2 GHz
TOL = dict(rtol=2e-3, atol=2e-3)


@pytest.fixture(
    scope="module",
    params=[(1, "per_comm"), (2, "per_comm"), (1, "staged"), (2, "staged")],
    ids=lambda p: f"{p[0]}-compute-streams-{p[1]}",
)
def setup(request):
    """Every pairing of compute streams and hand-over schedule stays exact (the benchmark
    times the fast ones; a slow pairing must still be correct)."""
    streams, overlap = request.param
    torch.cuda.set_device(0)
    comm = LocalComm(SLEEP_CYCLES_PER_TOKEN)
    model = TboTestModel(CFG, "cuda", comm=comm, seed=0, overlap=overlap)
    base = KVCaches.random(CFG, NUM_BLOCKS, "cuda", seed=1)
    with MicroBatchRunner("cuda", timeout_s=120, compute_streams=streams) as runner:
        yield model, base, runner


def test_compute_streams_per_micro_batch(setup):
    """Micro-batch 0 computes on the caller's stream; micro-batch 1 too, or on its own."""
    _, _, runner = setup
    caller = torch.cuda.current_stream()
    seen = runner.run(lambda ctx: (ctx.compute_stream, torch.cuda.current_stream()), [None, None])
    assert seen[0] == (caller, caller)
    assert seen[1][0] == seen[1][1]
    assert (seen[1][0] == caller) == (runner.compute_streams == 1)


def _same(out, out_caches, ref, ref_caches):
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(out_caches.raw, ref_caches.raw, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("n", [3, 25, 100])
def test_eager_decode_split_equals_unsplit(setup, n):
    model, base, runner = setup
    batch = random_decode_batch(CFG, n, MAX_BLOCKS, NUM_BLOCKS, "cuda", seed=n)
    mode = ForwardMode.decide([BatchShape(n, n, 1)], 0, TboConfig(), ())
    assert mode.split and not mode.replay
    ref_c, out_c = base.clone(), base.clone()
    ref = run_unsplit(model, batch, ref_c)
    out = run_step(model, runner, batch, out_c, mode)
    torch.cuda.synchronize()
    _same(out, out_c, ref, ref_c)


def test_eager_prefill_split_equals_unsplit(setup):
    model, base, runner = setup
    lens = [1, 1, 1, 37, 5, 60, 18]
    batch = make_batch(CFG, lens, [9, 40, 3, 20, 0, 7, 30], MAX_BLOCKS, NUM_BLOCKS, "cuda", seed=3)
    mode = ForwardMode.decide([BatchShape.from_query_lens(lens)], 0, TboConfig(), ())
    assert mode.split and mode.kind == "prefill"
    ref_c, out_c = base.clone(), base.clone()
    ref = run_unsplit(model, batch, ref_c)
    out = run_step(model, runner, batch, out_c, mode)
    torch.cuda.synchronize()
    _same(out, out_c, ref, ref_c)


@pytest.mark.parametrize("record_on_first_step", [False, True], ids=["up-front", "first-step"])
@pytest.mark.parametrize("tbo_decode", [True, False])
def test_replay_equals_unsplit(setup, tbo_decode, record_on_first_step):
    """Split buckets replay one graph holding both micro-batches; refreshed in place each step.
    Recorded up front, or as vLLM's runner does: each on the first step that replays it,
    between other buckets' replays, into a pool passed in (vLLM's runner passes its own)."""
    from tbo_harness.graphed import GraphedDecoder

    from atom_plugin.tbo.graphs import RequestGraphs

    model, base, runner = setup
    graph_caches = base.clone()
    config = TboConfig(decode=tbo_decode)
    graphs = RequestGraphs("cuda", pool=torch.cuda.graph_pool_handle())
    dec = GraphedDecoder(
        model,
        graph_caches,
        runner,
        BUCKETS,
        config,
        MAX_BLOCKS,
        graphs=graphs,
        record_on_first_step=record_on_first_step,
    )
    static = [
        getattr(m, f).data_ptr()
        for b in dec.buffers.values()
        for m in [b.full.meta] + list(b.ubatches or ())
        for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    ]
    for n in (25, 3, 32, 17, 64, 5, 1, 2, 60):
        batch = random_decode_batch(CFG, n, MAX_BLOCKS, NUM_BLOCKS, "cuda", seed=1000 + n)
        mode = dec.mode(batch)
        assert mode.replay and mode.split == (tbo_decode and mode.bucket > 2)
        for raw, src in zip(graph_caches.raw, base.raw, strict=True):
            raw.copy_(src)
        ref_c = base.clone()
        ref = run_unsplit(model, batch, ref_c)
        out = dec.step(batch).clone()
        torch.cuda.synchronize()
        _same(out, graph_caches, ref, ref_c)
    # 9 steps over the buckets 1, 2, 4, 8, 32, 64 (recorded once each), or all 7 up front
    assert dec.steps == {"captured": 6 if record_on_first_step else len(BUCKETS), "replayed": 9}
    assert static == [
        getattr(m, f).data_ptr()
        for b in dec.buffers.values()
        for m in [b.full.meta] + list(b.ubatches or ())
        for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    ]


def test_failure_on_cuda_raises_and_runner_recovers(setup):
    _, _, runner = setup

    def fn(ctx):
        x = torch.ones(8, device="cuda")
        tbo.switch_to_comm()
        if ctx.id == 1:
            raise RuntimeError("boom")
        tbo.yield_and_switch_to_compute()
        return x * 2

    with pytest.raises(MicroBatchFailed, match="micro-batch 1 failed"):
        runner.run(fn, [None, None])
    out = runner.run(lambda ctx: torch.full((2,), float(ctx.id), device="cuda"), [None, None])
    assert [o.tolist() for o in out] == [[0.0, 0.0], [1.0, 1.0]]


def test_copy_stand_in_moves_bytes_per_token_row():
    """The benchmark's no-SM stand-in: a device-to-host copy sized by the token rows."""
    torch.cuda.set_device(0)
    comm = CopyComm(max_bytes=64, bytes_per_token=8)
    comm._src.copy_(torch.arange(64, dtype=torch.uint8))
    comm._dst.fill_(255)
    x = torch.ones(3, 4, device="cuda")
    assert comm.dispatch(x) is x
    torch.cuda.synchronize()
    assert comm._dst[:24].tolist() == list(range(24))
    assert comm._dst[24:].eq(255).all()  # 3 rows x 8 bytes, no more
    with pytest.raises(ValueError, match="72 bytes exceed the stand-in's buffer of 64"):
        comm.combine(torch.ones(9, 4, device="cuda"))


def test_take_turn_chains_two_compute_streams_on_the_gpu():
    """Micro-batch 1's block runs after micro-batch 0's (a 50 ms spin, then a write), though
    the two compute streams share no other dependency."""
    torch.cuda.set_device(0)
    flag = torch.zeros(1, device="cuda")

    def fn(ctx):
        if ctx.id == 0:
            with tbo.take_turn():
                torch.cuda._sleep(100_000_000)
                flag.fill_(1.0)
            tbo.yield_to_other()
            return None
        with tbo.take_turn():
            return flag.clone()

    with MicroBatchRunner("cuda", timeout_s=60, compute_streams=2) as runner:
        _, seen = runner.run(fn, [None, None])
    torch.cuda.synchronize()
    assert seen.item() == 1.0
