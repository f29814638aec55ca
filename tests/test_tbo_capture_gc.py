"""No cyclic garbage collection inside a request graph's capture (CPU, torch.cuda faked).

On the H200, tests/test_tbo_gpu.py's unsplit up-front captures failed
(CUBLAS_STATUS_INTERNAL_ERROR, then cudaErrorStreamCaptureInvalidated) when the
collector ran inside a capture and destroyed the CUDA graphs of an earlier test's
decoder, left in a reference cycle: destroying a graph is not permitted while a
stream captures. Which capture the collection hits depends only on how many objects
were allocated before, so unrelated changes moved it onto a capture.
"""

import contextlib
import gc
import weakref

import pytest
import torch
from tbo_harness.batches import random_decode_batch
from tbo_harness.graphed import GraphedDecoder
from tbo_harness.model import KVCaches, ModelConfig, TboTestModel
from tbo_harness.rerun_graphs import RerunGraphs

from atom_plugin.tbo import MicroBatchRunner, TboConfig
from atom_plugin.tbo.graphs import RequestGraphs, gc_paused
from atom_plugin.tbo.mode import GraphKey


class FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's capture calls as no-ops; `state["capturing"]` is True inside the graph."""
    state = {"capturing": False}

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, capture_error_mode="global"):
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return state


class GraphInACycle:
    """Stands for an older decoder's CUDA graph in cyclic garbage: notes when it is freed."""

    def __init__(self, state, freed):
        self.state, self.freed = state, freed
        self.me = self

    def __del__(self):
        self.freed.append("during capture" if self.state["capturing"] else "outside")


def test_capture_runs_with_the_collector_paused(fake_cuda):
    """Allocations inside the capture trip no collection: the garbage outlives the capture."""
    graphs = RequestGraphs("cuda", pool="pool", warmup_steps=1)
    freed, seen = [], []

    def step():
        seen.append((fake_cuda["capturing"], gc.isenabled()))
        if fake_cuda["capturing"]:
            GraphInACycle(fake_cuda, freed)  # garbage at once: the cycle keeps it
            _ = [[] for _ in range(20 * gc.get_threshold()[0])]  # would trip a collection
        return torch.zeros(1)

    assert gc.isenabled()
    graphs.capture(GraphKey(4, 1), step)
    assert freed == []  # not "during capture"
    assert seen == [(False, True), (True, False)]  # warm-up collects as usual
    assert gc.isenabled()
    gc.collect()
    assert freed == ["outside"]


def test_gc_paused_restores_the_previous_state():
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left off, as the caller had it
    finally:
        gc.enable()


@pytest.mark.parametrize("tbo_decode", [True, False])
def test_graphed_decoder_is_freed_without_the_cyclic_collector(tbo_decode):
    """A dropped decoder frees its graphs at once (no cycle through its step functions),
    not at some later collection, which may fall inside another capture."""
    cfg = ModelConfig()
    model = TboTestModel(cfg, "cpu", seed=0)
    caches = KVCaches.random(cfg, 64, "cpu", seed=1)
    with MicroBatchRunner("cpu", timeout_s=60) as runner:
        graphs = RerunGraphs()
        dec = GraphedDecoder(
            model, caches, runner, [4, 8], TboConfig(decode=tbo_decode), 4, graphs=graphs
        )
        batch = random_decode_batch(cfg, 3, 4, 64, "cpu", seed=0)
        dec.step(batch)
        assert dec.plan[GraphKey(4, 1)] == tbo_decode
        freed = [weakref.ref(dec), weakref.ref(graphs)]
        del dec, graphs
        assert [r() for r in freed] == [None, None]
