"""The engine benchmark's step probe (benchmarks/engine_probe.py) and graph gaps
(benchmarks/graph_gaps.py): what a model step records, its GPU time, the profiled
phases, copies and syncs traced to the metadata builders, and the gaps between a
replayed graph's nodes."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest


class _Builder:
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        import torch

        from atom_plugin.attention.mla.plan import TritonMLAPlan

        launch = Namespace(kernel="packed", schedule="lockstep", num_splits=4, tokens=1)
        launch.name = "packed"
        launch.token_chunks = 1
        plan = TritonMLAPlan(torch.zeros(1), torch.zeros(1), make_launch=lambda: launch)
        tokens = common_attn_metadata.num_actual_tokens
        return Namespace(num_decode_tokens=tokens, decode=Namespace(plan=plan), prefill=None)


class _Runner:
    """A model runner's shape as the probe meets it: execute_model builds each group's
    metadata and runs the layers (eager ones read the plan's launch; a replayed FULL
    graph reads none), sample_tokens follows."""

    def __init__(self):
        group = Namespace(backend=Namespace(get_name=lambda: "ATOM_AITER_MLA"))
        group.metadata_builders = [_Builder()]
        self.attn_groups = [[group]]

    def execute_model(self, max_query_len, tokens, replay=False):
        common = Namespace(max_query_len=max_query_len, num_actual_tokens=tokens)
        for group in self.attn_groups[0]:
            metadata = group.metadata_builders[0].build(0, common)
            if not replay:
                metadata.decode.plan.launch  # noqa: B018 - a layer's read

    def sample_tokens(self):
        return "sampled"


def test_the_probe_records_each_model_step():
    from benchmarks.engine_probe import StepProbe

    runner = _Runner()
    probe = StepProbe(runner)
    runner.execute_model(1, 4)  # before begin(): not recorded
    probe.begin()
    runner.execute_model(7, 40)
    assert runner.sample_tokens() == "sampled"
    for replay in (False, True, True):
        runner.execute_model(1, 4, replay=replay)
        runner.sample_tokens()
    summary = probe.end()
    assert summary["prefill"]["steps"] == 1 and summary["decode"]["steps"] == 3
    assert summary["decode"]["tokens"] == 12 and summary["decode"]["decode_path_tokens"] == 12
    # the probe plans nothing itself: the replayed steps' launches stay unplanned
    assert summary["decode"]["plans"] == {
        "launch not planned (graph replay)": 2,
        "packed/lockstep splits 4 tokens 1x1": 1,
    }
    assert summary["decode"]["build_us"] > 0 and summary["decode"]["syncs_build"] == 0
    runner.execute_model(1, 4)  # after end(): not recorded
    assert len(probe.steps) == 4


def _fake_cuda(times):
    """torch.cuda as the probe uses it, its events reading `times` one record() each."""
    from types import SimpleNamespace

    clock = iter(times)

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = next(clock)

        def elapsed_time(self, other):
            return other.at - self.at

    mode = ["default"]
    return SimpleNamespace(
        Event=Event,
        synchronize=lambda: None,
        get_sync_debug_mode=lambda: mode[0],
        set_sync_debug_mode=lambda m: mode.__setitem__(0, m),
    )


def test_the_probe_measures_the_gpu_time_between_steps(monkeypatch):
    """From a step's end event (after sampling) to the next step's start event."""
    from types import SimpleNamespace

    from benchmarks import engine_probe

    # each step: start, end of execute_model, end of sampling
    times = [0.0, 1.0, 2.0, 2.5, 3.0, 4.0, 5.5, 6.0, 7.0]
    fake = SimpleNamespace(cuda=_fake_cuda(times))
    monkeypatch.setattr(engine_probe, "_cuda", lambda: fake)
    runner = _Runner()
    probe = engine_probe.StepProbe(runner)
    probe.begin()
    for _ in range(3):
        runner.execute_model(1, 4)
        runner.sample_tokens()
    decode = probe.end()["decode"]
    assert decode["gpu_ms"] == 1.5  # the median of 2.0, 1.5 and 1.5
    assert decode["gpu_between_ms"] == 1.0  # the median of 0.5 and 1.5 (none before the first)


def test_the_phase_profiler_covers_the_phase_it_names():
    from benchmarks.engine_probe import PhaseProfiler, reduce_trace

    def drive(profiler, prefilling, requests):
        for p, n in zip(prefilling, requests, strict=True):
            profiler.before_step(p, requests=n)
            sum(range(1000))
            profiler.after_step()
        profiler.stop()

    decode = PhaseProfiler("decode", max_steps=3)
    drive(decode, [True, True, False, False, False, False, False], [8, 8, 8, 7, 5, 5, 1])
    prefill = PhaseProfiler("prefill")
    drive(prefill, [True, True, False, False], [8, 8, 8, 8])
    assert (decode.steps, prefill.steps) == (3, 2)
    reduced = reduce_trace(decode, "lat-1", None)
    assert (reduced["phase"], reduced["steps"]) == ("decode", 3)
    # the batch of the profiled steps alone: 8, 7 and 5 requests
    assert reduced["requests_per_step"] == [5, 8]
    assert reduce_trace(prefill, "lat-1", None)["requests_per_step"] == [8, 8]


def test_a_decode_profile_runs_the_workloads_output_length(monkeypatch):
    """Cut short, a decode profile's early requests finish while the last ones prefill,
    and its steps run fewer requests than the timed passes; a prefill profile needs two
    tokens."""
    from benchmarks import engine_case, engine_probe
    from benchmarks.engine_shapes import WORKLOADS

    ran = []
    monkeypatch.setattr(
        engine_case, "run_workload", lambda llm, w, *a, **k: ran.append(w) or {"wall_s": 1.0}
    )
    monkeypatch.setattr(engine_probe, "reduce_trace", lambda *a: {})
    spec = {"case": "X"}
    engine_case.profile(None, spec, "decode-2k:decode")
    engine_case.profile(None, spec, "decode-2k@again:prefill")
    assert [w.output_len for w in ran] == [WORKLOADS["decode-2k"].output_len, 2]
    assert {w.requests for w in ran} == {WORKLOADS["decode-2k"].requests}


def test_the_probe_names_the_plan_a_decode_graph_replays():
    """A decode step's FULL CUDA graph replays the launch its capture planned for
    max_model_len keys, not the step's own plan."""
    import torch

    from atom_plugin.attention.mla.gluon.probe import MLAStepLayout
    from atom_plugin.vllm.attention.mla import MLADecodePlanner
    from benchmarks.engine_probe import _graph_plan, _plan_key

    planner = MLADecodePlanner(
        kernel_impl="triton",
        num_heads=16,
        kv_dtype=torch.bfloat16,
        layout=MLAStepLayout(torch.bfloat16, 64),
        max_tokens=8,
        device="cpu",
    )
    decode = planner.decode_metadata(
        block_table=torch.zeros(1, 16, dtype=torch.int32),
        seq_lens=torch.tensor([1000], dtype=torch.int32),
        max_seq_len=1000,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        num_tokens=1,
        max_query_len=1,
    )
    metadata = Namespace(decode=decode, prefill=None)  # the builder's MLA metadata
    builder = Namespace(planner=planner, model_config=Namespace(max_model_len=16384))
    graph = _graph_plan(builder, metadata, Namespace(max_query_len=1))
    assert decode.plan.planned_launch is None  # naming the graph's launch planned none
    assert _plan_key(decode.plan) == "launch not planned (graph replay)"
    decode.plan.launch  # noqa: B018 - an eager layer's read
    assert _plan_key(decode.plan).startswith("per_token") and graph.startswith("packed")
    assert _graph_plan(builder, metadata, Namespace(max_query_len=2)) is None
    assert _graph_plan(Namespace(), metadata, Namespace(max_query_len=1)) is None


def _reduce_over_two_steps(monkeypatch, events):
    """`engine_probe.reduce_trace` of a decode profile of two steps that traced `events`
    (name, on the GPU, start us, end us, correlation id)."""
    from benchmarks import engine_probe

    monkeypatch.setattr(engine_probe, "_trace_events", lambda prof: iter(events))
    profiler = engine_probe.PhaseProfiler("decode")
    profiler.steps = 2
    return engine_probe.reduce_trace(profiler, "lat-1", None)


def test_copies_and_syncs_are_traced_to_the_builders(monkeypatch):
    """A host-to-device copy counts as the builders' when the host's CUDA call that
    launched it fell inside a builder's `probe::build` range; a sync call likewise."""
    events = [  # name, on the GPU, start, end, correlation id
        ("probe::build", False, 10.0, 20.0, 0),
        ("cudaMemcpyAsync", False, 12.0, 13.0, 5),  # inside the build
        ("cudaStreamSynchronize", False, 15.0, 16.0, 0),
        ("cudaMemcpyAsync", False, 30.0, 31.0, 6),
        ("cudaStreamSynchronize", False, 40.0, 41.0, 0),
        ("Memcpy HtoD (Pinned -> Device)", True, 50.0, 51.0, 5),
        ("Memcpy HtoD (Pinned -> Device)", True, 52.0, 53.0, 6),
        ("kernel", True, 53.0, 60.0, 7),
    ]
    reduced = _reduce_over_two_steps(monkeypatch, events)
    assert reduced["h2d_copies_per_step"] == 1.0
    assert reduced["h2d_copies_in_build_per_step"] == 0.5
    assert reduced["syncs_in_build_per_step"] == 0.5
    assert reduced["gpu_busy_ms_per_step"] == 0.0045  # (1 + 1 + 7) us over 2 steps
    assert reduced["graph_gap_us_median"] is None  # no graph was launched


def test_the_record_keeps_every_kernel_the_longest_first(monkeypatch):
    """Every kernel (the time split between two cases reads them all), summed by name as
    the report cuts it (100 characters)."""
    long_name = "k" * 120
    events = [(f"kernel{i}", True, 10.0 * i, 10.0 * i + 1 + i % 7, 0) for i in range(40)]
    events += [(long_name + "a", True, 500.0, 502.0, 0), (long_name + "b", True, 510.0, 512.0, 0)]
    reduced = _reduce_over_two_steps(monkeypatch, events)
    kernels = reduced["kernels"]
    assert reduced["kernels_complete"] and len(kernels) == 41
    assert [k["us_per_step"] for k in kernels] == sorted(
        (k["us_per_step"] for k in kernels), reverse=True
    )
    cut = next(k for k in kernels if k["name"] == long_name[:100])
    assert (cut["calls_per_step"], cut["us_per_step"]) == (1.0, 2.0)  # two calls over 2 steps


def test_gaps_between_graph_nodes_are_measured_per_launch(monkeypatch):
    """The idle time between the kernels of one CUDA graph launch: the gap before a
    graph's first node and the kernels of other host calls do not count."""
    events = [  # name, on the GPU, start, end, correlation id
        ("cudaGraphLaunch", False, 0.0, 5.0, 1),
        ("cudaLaunchKernel", False, 6.0, 7.0, 2),
        ("cudaGraphLaunch", False, 8.0, 9.0, 3),
        ("a", True, 10.0, 12.0, 1),
        ("b", True, 12.5, 14.0, 1),
        ("c", True, 13.8, 15.0, 1),  # overlaps its predecessor (a dependent launch)
        ("eager", True, 20.0, 21.0, 2),
        ("a", True, 30.0, 32.0, 3),
        ("b", True, 33.0, 34.0, 3),
    ]
    reduced = _reduce_over_two_steps(monkeypatch, events)
    assert reduced["graph_gap_us_median"] == pytest.approx(0.5)  # of 0.5, -0.2 and 1.0
    assert reduced["graph_gaps_us_per_step"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2


def test_graph_gaps_reads_a_chrome_trace(tmp_path):
    """`benchmarks.graph_gaps` over a trace file: only kernels of graph launches count."""
    import gzip

    from benchmarks.graph_gaps import trace_gaps

    def kernel(ts, dur, correlation):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}  # fmt: skip

    events = [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "ts": 0,
            "dur": 5,
            "args": {"correlation": 1},
        },  # fmt: skip
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 6,
            "dur": 1,
            "args": {"correlation": 2},
        },  # fmt: skip
        kernel(10, 2, 1),
        kernel(12.25, 1, 1),
        kernel(14.25, 1, 1),
        kernel(40, 1, 2),  # an eager kernel: not a graph's
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_gaps(str(path))
    assert (got["launches"], got["nodes"]) == (1, 3)
    assert got["median_gap_us"] == pytest.approx(0.625)  # of 0.25 and 1.0
    assert got["idle_us_per_launch"] == pytest.approx(1.25)
    # the one launch's call took 5 us, its first node started 10 us after the call began,
    # and no GPU work came before it
    assert (got["launch_call_us"], got["first_node_after_call_us"]) == (5, 10)
    assert got["idle_before_launch_us"] is None


def test_the_gpus_wait_for_each_graph_launch_is_measured(tmp_path):
    """Per launch: the host's call, its first node's start after the call began and the
    GPU's idle time before that node, since the end of any GPU work before it (the
    step's input copies included); medians over launches."""
    import gzip

    from benchmarks.graph_gaps import main, trace_gaps

    def launch(ts, dur, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts,
                "dur": dur, "args": {"correlation": correlation}}  # fmt: skip

    def gpu(ts, dur, correlation, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}  # fmt: skip

    events = [
        launch(0, 400, 1),
        gpu(400, 1800, 1),  # graph 1 runs once its call returned
        gpu(2300, 5, 9, "gpu_memcpy"),  # the next step's input copy (not a graph's)
        launch(2500, 600, 2),
        gpu(3100, 2000, 2),  # 795 us idle after the copy
        launch(5000, 500, 3),
        gpu(5500, 10, 3),
        gpu(5520, 10, 3),  # a second node: not a first
        gpu(5520, 10, 8, "gpu_memset"),  # beside it, at the same time, not a graph's
    ]
    path = tmp_path / "steps.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_gaps(str(path))
    assert got["launch_call_us"] == 500  # of 400, 600, 500
    assert got["first_node_after_call_us"] == 500  # of 400, 600, 500
    assert got["idle_before_launch_us"] == pytest.approx(597.5)  # of 795 and 400
    assert main([str(path)]) == 0
