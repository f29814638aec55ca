"""vLLM's own yield points (`vllm.v1.worker.ubatching.dbo_*`) hand over through the plugin's
micro-batch runner, and each micro-batch sees its own vLLM forward context (CPU, real vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm import forward_context as vllm_fc  # noqa: E402
from vllm.v1.worker import ubatching  # noqa: E402

from atom_plugin.tbo.runner import MicroBatchRunner  # noqa: E402
from atom_plugin.vllm.tbo import dbo_bridge  # noqa: E402


def test_vllm_yields_alternate_the_micro_batches_with_their_forward_contexts():
    contexts = [SimpleNamespace(name="ubatch-0"), SimpleNamespace(name="ubatch-1")]
    log = []

    def ubatch(ctx):
        with dbo_bridge.registered(ctx):
            assert ubatching.dbo_enabled() and ubatching.dbo_current_ubatch_id() == ctx.id
            log.append((ctx.id, "a", vllm_fc._forward_context.name))
            ubatching.dbo_yield()
            log.append((ctx.id, "b", vllm_fc._forward_context.name))
            ubatching.dbo_yield_and_switch_from_compute_to_comm()
            log.append((ctx.id, "c", vllm_fc._forward_context.name))
            ubatching.dbo_yield_and_switch_from_comm_to_compute()
            ubatching.dbo_switch_to_comm_sync()
            ubatching.dbo_switch_to_compute_sync()
            log.append((ctx.id, "d", vllm_fc._forward_context.name))
        return ctx.id

    with MicroBatchRunner("cpu", timeout_s=30) as runner:
        out = runner.run(ubatch, contexts, on_resume=dbo_bridge.install_forward_context)
    assert out == [0, 1]
    assert [(i, p) for i, p, _ in log] == [
        (0, "a"),
        (1, "a"),
        (0, "b"),
        (1, "b"),
        (0, "c"),
        (1, "c"),
        (0, "d"),
        (1, "d"),
    ]
    assert all(name == f"ubatch-{i}" for i, _, name in log)
    assert not ubatching.dbo_enabled()  # nothing left registered


def test_a_receive_hook_registered_for_the_other_micro_batch_runs_there():
    ran = []

    def ubatch(ctx):
        with dbo_bridge.registered(ctx):
            if ctx.id == 0:
                ubatching.dbo_register_recv_hook(lambda: ran.append("hook"))
                ubatching.dbo_yield()
            else:
                ubatching.dbo_maybe_run_recv_hook()
                ran.append("ubatch 1 after its receive")
                ubatching.dbo_yield()

    with MicroBatchRunner("cpu", timeout_s=30) as runner:
        runner.run(ubatch, [None, None], on_resume=dbo_bridge.install_forward_context)
    assert ran == ["hook", "ubatch 1 after its receive"]


def test_only_yielding_all2all_backends_register_micro_batches():
    def cfg(ep, backend):
        return SimpleNamespace(enable_expert_parallel=ep, all2all_backend=backend)

    assert dbo_bridge.model_yields(cfg(True, "deepep_low_latency"))
    assert not dbo_bridge.model_yields(cfg(True, "allgather_reducescatter"))
    assert not dbo_bridge.model_yields(cfg(False, "deepep_high_throughput"))
