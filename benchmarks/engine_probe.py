"""Where an engine step's time goes, measured inside the engine benchmark's worker
(benchmarks/engine_case.py, engine core in-process).

`StepProbe` wraps the model runner's `execute_model` and `sample_tokens` and every
attention metadata builder's `build`, and records for each model step: host time in
each (perf_counter), the GPU's time from the step's first launch to its last (CUDA
events recorded on the stream at both ends: busy time plus any wait for the host
inside the step), synchronizing CUDA calls (`torch.cuda.set_sync_debug_mode`), the
step's kind (decode: every request one query token; prefill otherwise), how many
tokens each builder put on its decode and prefill paths, and the MLA decode launch the
plugin's layers ran (planned at the first layer's read; a step a FULL graph replays reads
none and shows as not planned) and, for decode steps, the one its CUDA graph was captured
with, which a FULL graph replays instead. A step whose host time exceeds its GPU time is host-bound;
under async scheduling a sync makes the host wait for the GPU's step before.

`PhaseProfiler` runs torch's profiler over one pass's decode steps or its prefill
steps (`engine_case.profile`), and `reduce_trace` reduces the trace to per-step figures:
GPU busy time, kernels by name, graph launches, host-to-device copies, syncs.
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
import statistics
import time
import warnings
from collections import Counter
from itertools import pairwise
from pathlib import Path

SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::_local_scalar_dense",
    "aten::nonzero",
)
BUILD_LABEL = "probe::build"


def _cuda():
    import torch

    return torch if torch.cuda.is_available() else None


@contextlib.contextmanager
def _counting_syncs(counts: list[int]):
    """Counts the synchronizing CUDA calls made inside (appended to `counts`)."""
    torch = _cuda()
    if torch is None:
        yield
        counts.append(0)
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
    counts.append(sum("synchronizing" in str(w.message) for w in caught))


def _timed(call, *args, **kwargs) -> tuple:
    """`call`'s result, its host seconds and the synchronizing CUDA calls it made."""
    syncs: list[int] = []
    t0 = time.perf_counter()
    with _counting_syncs(syncs):
        out = call(*args, **kwargs)
    return out, time.perf_counter() - t0, syncs[0]


# A Triton plan whose launch no layer read: a step a FULL CUDA graph replayed
UNPLANNED = "launch not planned (graph replay)"


def _is_triton_plan(plan) -> bool:
    """The Triton path's plan, whose launch is planned at the first layer's read."""
    from atom_plugin.attention.mla.plan import TritonMLAPlan

    return isinstance(plan, TritonMLAPlan)


def _plan_key(plan) -> str | None:
    """The plugin's MLA decode plan, in short: kernel, splits, tokens a program. Read
    after the step's layers ran, without planning a launch they did not read."""
    if plan is None:
        return None
    if not _is_triton_plan(plan):  # the torch reference's or AITER's plan
        return type(plan).__name__
    launch = plan.planned_launch
    return UNPLANNED if launch is None else _launch_key(launch)


def _launch_key(launch) -> str:
    return (
        f"{launch.kernel}/{launch.schedule} splits {launch.num_splits} "
        f"tokens {launch.tokens}x{launch.token_chunks}"
    )


_GRAPH_PLANS: dict[tuple, str] = {}  # planned once a bucket: the probe's own host time


def _graph_plan(builder, metadata, common) -> str | None:
    """The launch a FULL CUDA graph of this decode step replays: the plugin's builder
    plans a graph's capture for max_model_len keys, since the graph replays any context
    (None for other builders, and for steps no decode graph takes)."""
    planner = getattr(builder, "planner", None)
    decode = getattr(metadata, "decode", None)
    if planner is None or common.max_query_len > 1:
        return None
    if not _is_triton_plan(getattr(decode, "plan", None)):
        return None
    paged = decode.paged
    key = (id(builder), paged.num_reqs, paged.num_actual_tokens, planner.kv_dtype)
    if key not in _GRAPH_PLANS:
        _GRAPH_PLANS[key] = _capture_launch(builder, planner, paged)
    return _GRAPH_PLANS[key]


def _capture_launch(builder, planner, paged) -> str:
    """The launch the bucket's graph was captured with: the step's plan, for the longest
    context the graph may replay (as the builder plans under capture)."""
    from atom_plugin.attention.mla.plan import plan_mla_decode

    captured = plan_mla_decode(
        paged,
        paged.num_actual_tokens,
        planner.num_heads,
        kernel_impl=planner.kernel_impl,
        kv_dtype=planner.kv_dtype,
        layout=planner.layout,
        context=builder.model_config.max_model_len,
    )
    return _launch_key(captured.launch)


def _decode_tokens(metadata) -> int | None:
    """The tokens an MLA builder put on its decode path (None for other metadata)."""
    if not (hasattr(metadata, "decode") and hasattr(metadata, "prefill")):
        return None
    return metadata.num_decode_tokens


class StepProbe:
    """Per model step figures of one runner; `begin()` starts a pass's record,
    `end()` returns its summary."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.active = False
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._wrap(runner, "execute_model", self._execute)
        if hasattr(runner, "sample_tokens"):
            self._wrap(runner, "sample_tokens", self._sample)
        for groups in runner.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    self._wrap(builder, "build", self._build(group.backend.get_name()))

    @staticmethod
    def _wrap(obj, name: str, make):
        original = getattr(obj, name)
        setattr(obj, name, make(original))

    def _event(self):
        torch = _cuda()
        if torch is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _execute(self, original):
        def execute_model(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            step = {"start": self._event(), "builds": [], "syncs_build": []}
            self._current = step
            out, step["host_exec_s"], step["syncs_exec"] = _timed(original, *args, **kwargs)
            step["end"] = self._event()
            for build in step["builds"]:  # the layers have run: their launches are known
                build["plan"] = _plan_key(build["plan"])
            self.steps.append(step)
            return out

        return execute_model

    def _sample(self, original):
        def sample_tokens(*args, **kwargs):
            step = self._current
            if not self.active or step is None:
                return original(*args, **kwargs)
            out, step["host_sample_s"], step["syncs_sample"] = _timed(original, *args, **kwargs)
            step["end"] = self._event()
            self._current = None
            return out

        return sample_tokens

    def _build(self, backend: str):
        def make(original):
            def build(common_prefix_len, common_attn_metadata, *args, **kwargs):
                step = self._current
                if not self.active or step is None:
                    return original(common_prefix_len, common_attn_metadata, *args, **kwargs)
                from torch.profiler import record_function

                t0 = time.perf_counter()
                with record_function(BUILD_LABEL), _counting_syncs(step["syncs_build"]):
                    metadata = original(common_prefix_len, common_attn_metadata, *args, **kwargs)
                step["builds"].append(
                    {
                        "backend": backend,
                        "host_s": time.perf_counter() - t0,
                        "max_query_len": int(common_attn_metadata.max_query_len),
                        "tokens": int(common_attn_metadata.num_actual_tokens),
                        "decode_tokens": _decode_tokens(metadata),
                        # the decode plan, read once the step's layers have run
                        "plan": getattr(getattr(metadata, "decode", None), "plan", None),
                        "graph_plan": _graph_plan(
                            original.__self__, metadata, common_attn_metadata
                        ),
                    }
                )
                return metadata

            return build

        return make

    def begin(self) -> None:
        self.steps = []
        self._current = None
        self.active = True

    def end(self) -> dict:
        self.active = False
        torch = _cuda()
        if torch is not None:
            torch.cuda.synchronize()
        records = [step_record(s) for s in self.steps]
        # GPU time from a step's end (its sampling) to the next one's start (vLLM's
        # execute_model): idle while the host prepares the step, or work issued between
        # steps outside the probed span
        for prev, step, record in zip(self.steps, self.steps[1:], records[1:], strict=False):
            if prev.get("end") is not None and step.get("start") is not None:
                record["gpu_between_ms"] = prev["end"].elapsed_time(step["start"])
        return summarize(records)


def step_record(step: dict) -> dict:
    """One model step's figures from the probe's raw record."""
    start, end = step.get("start"), step.get("end")
    gpu_ms = start.elapsed_time(end) if start is not None and end is not None else None
    builds = step["builds"]
    kind = "decode" if builds and max(b["max_query_len"] for b in builds) <= 1 else "prefill"
    first = builds[0] if builds else {}
    tokens = first.get("tokens", 0)
    decode_tokens = first.get("decode_tokens")
    return {
        "kind": kind if builds else "none",
        "host_exec_ms": 1e3 * step["host_exec_s"],
        "host_sample_ms": 1e3 * step.get("host_sample_s", 0.0),
        "gpu_ms": gpu_ms,
        "build_us": 1e6 * sum(b["host_s"] for b in builds),
        "syncs_exec": step["syncs_exec"],
        "syncs_sample": step.get("syncs_sample", 0),
        "syncs_build": sum(step["syncs_build"]),
        "tokens": tokens,
        "decode_path_tokens": tokens if decode_tokens is None else decode_tokens,
        "plans": [b["plan"] for b in builds if b["plan"]],
        "graph_plans": [b["graph_plan"] for b in builds if b.get("graph_plan")],
    }


def summarize(records: list[dict]) -> dict:
    """Per step kind: step count, medians of host and GPU time and of the GPU time since
    the step before ended, sync counts, tokens on the decode and prefill paths, the plans
    seen."""
    out = {}
    for kind in ("decode", "prefill"):
        rs = [r for r in records if r["kind"] == kind]
        if not rs:
            continue
        gpu = [r["gpu_ms"] for r in rs if r["gpu_ms"] is not None]
        between = [r["gpu_between_ms"] for r in rs if r.get("gpu_between_ms") is not None]
        host = [r["host_exec_ms"] + r["host_sample_ms"] for r in rs]
        out[kind] = {
            "steps": len(rs),
            "host_ms": statistics.median(host),
            "host_exec_ms": statistics.median(r["host_exec_ms"] for r in rs),
            "host_sample_ms": statistics.median(r["host_sample_ms"] for r in rs),
            "build_us": statistics.median(r["build_us"] for r in rs),
            "gpu_ms": statistics.median(gpu) if gpu else None,
            "gpu_between_ms": statistics.median(between) if between else None,
            "host_bound_steps": sum(
                1
                for r, h in zip(rs, host, strict=True)
                if r["gpu_ms"] is not None and h > r["gpu_ms"]
            ),
            "host_total_s": sum(host) / 1e3,
            "gpu_total_s": sum(gpu) / 1e3 if gpu else None,
            "syncs_exec": sum(r["syncs_exec"] for r in rs),
            "syncs_sample": sum(r["syncs_sample"] for r in rs),
            "syncs_build": sum(r["syncs_build"] for r in rs),
            "tokens": sum(r["tokens"] for r in rs),
            "decode_path_tokens": sum(r["decode_path_tokens"] for r in rs),
            "plans": dict(Counter(p for r in rs for p in r["plans"]).most_common(4)),
            "graph_plans": dict(Counter(p for r in rs for p in r["graph_plans"]).most_common(4)),
        }
    return out


def install(worker) -> None:
    """collective_rpc target: put a StepProbe on this worker's model runner."""
    runner = getattr(worker, "worker", worker).model_runner
    if not hasattr(runner, "_engine_probe"):
        runner._engine_probe = StepProbe(runner)


def begin(worker) -> None:
    getattr(worker, "worker", worker).model_runner._engine_probe.begin()


def end(worker) -> dict:
    return getattr(worker, "worker", worker).model_runner._engine_probe.end()


def parse_profile_entry(entry: str) -> tuple[str, bool, str]:
    """`NAME[@again][:decode|:prefill]` -> (workload, same prompts again, phase). A
    fresh pass profiles its decode steps unless told, an `@again` pass (prefix-cache
    hits) its prefill steps."""
    name, _, phase = entry.partition(":")
    name, _, again = name.partition("@")
    if again not in ("", "again"):
        raise ValueError(f"profile entry {entry!r}: '@{again}' is not '@again'")
    phase = phase or ("prefill" if again else "decode")
    if phase not in ("decode", "prefill"):
        raise ValueError(f"profile entry {entry!r}: phase {phase!r} is not decode or prefill")
    return name, bool(again), phase


class PhaseProfiler:
    """A `run_workload` observer: torch's profiler runs over the pass's decode steps
    (at most `max_steps`, from the first step after every request has its first token)
    or over its prefill steps (while any request waits for its first token)."""

    def __init__(self, phase: str, max_steps: int = 8) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if _cuda() is not None:
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities)
        self.phase, self.max_steps = phase, max_steps
        self.steps = 0
        self.requests: list[int] = []  # unfinished requests at each profiled step
        self.running = self.done = False
        self.wall_s = 0.0
        self._t0 = 0.0

    def before_step(self, prefilling: bool, requests: int) -> None:
        """`requests`: the requests not yet finished, the step's batch (recorded for the
        steps profiled)."""
        wanted = prefilling if self.phase == "prefill" else not prefilling
        if not self.running and not self.done and wanted:
            self.prof.start()
            self.running = True
            self._t0 = time.perf_counter()
        elif self.running and (not wanted or self.steps >= self.max_steps):
            self.stop()
        if self.running:
            self.requests.append(requests)

    def after_step(self) -> None:
        if self.running:
            self.steps += 1

    def stop(self) -> None:
        if not self.running:
            return
        torch = _cuda()
        if torch is not None:
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._t0
        self.prof.stop()
        self.running, self.done = False, True


def reduce_trace(profiler: PhaseProfiler, label: str, trace_path: Path | None) -> dict:
    """Per-step figures of a PhaseProfiler's trace; the trace itself gzipped to
    `trace_path` when given."""
    prof, steps = profiler.prof, max(1, profiler.steps)
    kernels: dict[str, list[float]] = {}
    intervals = []
    host: dict[str, list[float]] = {}
    builds: list[tuple[float, float]] = []  # the metadata builders' host intervals
    launched_at: dict[int, float] = {}  # correlation id -> when the host called CUDA
    copies: list[int] = []  # host-to-device copies, by correlation id
    syncs: list[float] = []  # when each sync call began
    graph_launches: set[int] = set()  # correlation ids of cudaGraphLaunch calls
    by_launch: dict[int, list[tuple[float, float]]] = {}  # the GPU work of each host call
    for name, on_gpu, start, end, correlation in _trace_events(prof):
        dur = end - start
        if on_gpu:
            if name.startswith("Memcpy HtoD"):
                copies.append(correlation)
            kernels.setdefault(name[:100], []).append(dur)  # names cut as reported
            intervals.append((start, end))
            by_launch.setdefault(correlation, []).append((start, end))
            continue
        if correlation:
            launched_at[correlation] = start
        if name == "cudaGraphLaunch":
            graph_launches.add(correlation)
        if name == BUILD_LABEL:
            builds.append((start, end))
        if name in SYNC_CALLS:
            syncs.append(start)
        if name in SYNC_CALLS or name in ("cudaGraphLaunch", BUILD_LABEL):
            host.setdefault(name, []).append(dur)

    def in_build(t: float | None) -> bool:
        return t is not None and any(a <= t <= b for a, b in builds)

    busy = _union_us(intervals)
    gaps = graph_gaps_us([by_launch[c] for c in graph_launches if c in by_launch])
    by_time = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    result = {
        "workload": label,
        "phase": profiler.phase,
        "steps": profiler.steps,
        # the fewest and the most requests a profiled step ran (None: not recorded)
        "requests_per_step": (
            [min(profiler.requests), max(profiler.requests)] if profiler.requests else None
        ),
        "wall_ms_per_step": 1e3 * profiler.wall_s / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
        "h2d_copies_per_step": len(copies) / steps,
        # of those, and of the syncs, the ones the metadata builders' host code called
        "h2d_copies_in_build_per_step": sum(in_build(launched_at.get(c)) for c in copies) / steps,
        "syncs_in_build_per_step": sum(in_build(t) for t in syncs) / steps,
        # idle time between one CUDA graph node's end and the next one's start
        "graph_gap_us_median": statistics.median(gaps) if gaps else None,
        "graph_gaps_us_per_step": sum(g for g in gaps if g > 0) / steps,
        # every kernel, the longest first (the report lists the longest, the time split
        # between two cases reads them all)
        "kernels": [
            {
                "name": k,
                "calls_per_step": len(v) / steps,
                "us_per_step": sum(v) / steps,
                "mean_us": statistics.mean(v),
            }
            for k, v in by_time
        ],
        "kernels_complete": True,
        "host": {
            k: {"per_step": len(v) / steps, "mean_us": statistics.mean(v)} for k, v in host.items()
        },
    }
    if trace_path is not None:
        raw = trace_path.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        result["trace"] = trace_path.name
    return result


def _trace_events(prof):
    """(name, on the GPU, start us, end us, correlation id) of every traced event: read
    from Kineto's flat event list (`prof.events()` builds the whole call tree, minutes on
    a large trace). A GPU event's correlation id is that of the host's CUDA call that
    launched it (0 where none)."""
    from torch.autograd import DeviceType

    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        for ev in prof.events():
            on_gpu = ev.device_type == DeviceType.CUDA
            yield ev.name, on_gpu, ev.time_range.start, ev.time_range.end, 0
        return
    for ev in results.events():
        start = ev.start_ns() / 1e3
        on_gpu = ev.device_type() == DeviceType.CUDA
        yield ev.name(), on_gpu, start, start + ev.duration_ns() / 1e3, ev.correlation_id()


def graph_gaps_us(graphs: list[list[tuple[float, float]]]) -> list[float]:
    """Start of each graph node's GPU work less the end of the node before it, over the
    nodes of each graph launch (negative where programmatic dependent launch overlaps
    the two)."""
    gaps = []
    for nodes in graphs:
        gaps += [b[0] - a[1] for a, b in pairwise(sorted(nodes))]
    return gaps


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total
