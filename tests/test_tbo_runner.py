"""The micro-batch runner on CPU: real thread hand-off, streams tracked by name (invariant 7).

Every test runs with a short runner timeout, so a hand-off bug fails the test
instead of hanging it.
"""

import threading

import pytest
import torch

import atom_plugin.tbo as tbo
from atom_plugin.manager import new_plugin_manager
from atom_plugin.tbo import MicroBatchFailed, MicroBatchRunner, current_ubatch

TIMEOUT = 10.0


@pytest.fixture
def runner():
    with MicroBatchRunner("cpu", timeout_s=TIMEOUT) as r:
        yield r


def test_micro_batches_alternate_at_yield_points(runner):
    trace = []

    def fn(ctx):
        for layer in range(3):
            trace.append((ctx.id, layer, threading.current_thread().name))
            tbo.yield_to_other()
        return ctx.id * 10

    assert runner.run(fn, [None, None]) == [0, 10]
    assert [(u, layer) for u, layer, _ in trace] == [
        (u, layer) for layer in range(3) for u in (0, 1)
    ]
    assert {name for u, _, name in trace if u == 0} == {"tbo-ubatch-0"}
    assert {name for u, _, name in trace if u == 1} == {"tbo-ubatch-1"}


def test_uneven_micro_batches_finish(runner):
    def fn(ctx):
        for _ in range(1 if ctx.id == 0 else 5):
            tbo.yield_to_other()
        return ctx.id

    assert runner.run(fn, [None, None]) == [0, 1]


def test_forward_context_is_per_micro_batch(runner):
    def fn(ctx):
        seen = [tbo.forward_context()]
        tbo.yield_to_other()
        seen.append(tbo.forward_context())
        assert current_ubatch() is ctx
        return seen

    assert runner.run(fn, ["meta-0", "meta-1"]) == [["meta-0"] * 2, ["meta-1"] * 2]
    assert current_ubatch() is None and tbo.forward_context("none") == "none"


def test_stream_switches_are_tracked(runner):
    def fn(ctx):
        seen = [ctx.stream]
        tbo.switch_to_comm()
        seen.append(ctx.stream)
        tbo.yield_and_switch_to_compute()
        seen.append(ctx.stream)
        tbo.yield_and_switch_to_comm()
        seen.append(ctx.stream)
        tbo.switch_to_compute()
        seen.append(ctx.stream)
        return seen

    out = runner.run(fn, [None, None])
    assert out == [["compute", "comm", "compute", "comm", "compute"]] * 2


def test_api_is_a_no_op_outside_a_runner():
    for f in (
        tbo.yield_to_other,
        tbo.switch_to_comm,
        tbo.switch_to_compute,
        tbo.yield_and_switch_to_comm,
        tbo.yield_and_switch_to_compute,
    ):
        f()
    with tbo.take_turn():
        pass
    tbo.record_stream_use(torch.zeros(2))


def test_worker_threads_persist_across_steps(runner):
    def fn(ctx):
        return threading.get_ident()

    assert runner.run(fn, [None, None]) == runner.run(fn, [None, None])


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("where", ["before_yield", "after_yield"])
def test_failure_raises_in_caller_and_frees_the_other(runner, failing, where):
    reached = []

    def fn(ctx):
        if ctx.id == failing and where == "before_yield":
            raise KeyError(f"boom in {ctx.id}")
        tbo.yield_to_other()
        if ctx.id == failing:
            raise KeyError(f"boom in {ctx.id}")
        tbo.yield_to_other()
        reached.append(ctx.id)
        return ctx.id

    with pytest.raises(MicroBatchFailed, match=f"micro-batch {failing} failed") as info:
        runner.run(fn, [None, None])
    assert info.value.ubatch == failing and isinstance(info.value.__cause__, KeyError)
    assert failing not in reached
    # The runner is usable again: neither worker was left waiting.
    assert runner.run(lambda ctx: ctx.id, [None, None]) == [0, 1]


def test_a_hung_micro_batch_times_out():
    release = threading.Event()
    with MicroBatchRunner("cpu", timeout_s=0.5) as r:

        def fn(ctx):
            if ctx.id == 1:
                release.wait(20)
            return ctx.id

        with pytest.raises(TimeoutError, match="micro-batch 1 did not finish"):
            r.run(fn, [None, None])
        release.set()


def test_grad_and_inference_modes_follow_the_caller(runner):
    def fn(ctx):
        return torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    with torch.inference_mode():
        assert runner.run(fn, [None, None]) == [(True, False)] * 2
    with torch.no_grad():
        assert runner.run(fn, [None, None]) == [(False, False)] * 2
    assert runner.run(fn, [None, None]) == [(False, True)] * 2


def test_misuse_raises(runner):
    with pytest.raises(ValueError, match="need 2 forward contexts"):
        runner.run(lambda ctx: None, [None])
    with pytest.raises(MicroBatchFailed) as info:
        runner.run(lambda ctx: runner.run(lambda c: None, [None, None]), [None, None])
    assert "cannot be nested" in str(info.value)
    with pytest.raises(ValueError, match="device meta is not supported"):
        MicroBatchRunner("meta")
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        MicroBatchRunner("cpu", timeout_s=0)
    with pytest.raises(ValueError, match=r"compute_streams=3 is not one of \(1, 2\)"):
        MicroBatchRunner("cpu", compute_streams=3)
    with pytest.raises(ValueError, match="compute_streams=True is not one of"):
        MicroBatchRunner("cpu", compute_streams=True)
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(lambda ctx: None, [None, None])


def test_hook_provides_the_runner():
    spec = new_plugin_manager(load_entry_points=False).hook.atom_microbatch_runner()
    assert spec.name == "atom_tbo"
    with spec.factory(device="cpu", timeout_s=TIMEOUT) as r:
        assert r.run(lambda ctx: ctx.id + 1, [None, None]) == [1, 2]
