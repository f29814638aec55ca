"""One case of the engine benchmark: one vLLM engine (one attention backend) in this process.

Started by benchmarks/engine.py, one process per case. The engine core runs in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the steps can be timed one by one and
the torch profiler and the step probe (benchmarks/engine_probe.py) see the worker; with
`--engine-process` it runs in a process of its own, as vLLM serves, and each `step()`
here waits for the next step's outputs (the probe reaches the worker by RPC). Cases
of one wave start together; each marks itself ready and waits for the wave, so no
measurement overlaps another case's start-up. Then they measure one at a time, pass by
pass, in rounds whose order rotates (benchmarks/engine_turns.py), and each stays up
(idle) until every case of its wave has measured, so each measures beside the same
started engines whatever its turn.

Prompts are random token ids drawn from the workload's name and the pass's seed, so no
two workloads or passes share a prefix by chance; an `again` pass submits the prompts of
its round's new pass once more (with prefix caching on, their cached blocks hit). Each
pass records the SM clock (benchmarks/gpu_clocks.py) and the host's CPU load
(benchmarks/host_load.py) while it ran.

    python -m benchmarks.engine_case SPEC_JSON
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

from benchmarks import engine_probe
from benchmarks.engine_shapes import Workload


def worker_facts(worker) -> dict:
    """Which attention backends and CUDA-graph mode this worker's runner ended up with."""
    runner = getattr(worker, "worker", worker).model_runner  # through vLLM's wrapper
    names = sorted({group.backend.get_name() for groups in runner.attn_groups for group in groups})
    manager = getattr(runner, "cudagraph_manager", None)
    mode = getattr(manager, "cudagraph_mode", None)
    if mode is None:
        mode = runner.compilation_config.cudagraph_mode
    import torch
    from vllm.platforms import current_platform

    from atom_plugin.attention.mla.plan import PLANNED_LAUNCHES

    return {
        "pid": os.getpid(),  # the engine core's process (the measuring one, or its own)
        "cpus": sorted(os.sched_getaffinity(0)),  # the CPUs its thread may run on
        "platform": type(current_platform).__name__,
        "logits_processors": [str(p) for p in runner.model_config.logits_processors or []],
        "attention_backends": names,
        "cudagraph_mode": str(mode),
        "runner": type(runner).__module__ + "." + type(runner).__name__,
        "block_size": runner.cache_config.block_size,
        "prefix_caching": bool(runner.cache_config.enable_prefix_caching),
        # vLLM 0.34's extensible KV cache (None on releases without it)
        "extensible_kv_cache": getattr(runner.cache_config, "enable_extensible_kv_cache", None),
        # vLLM's CPU worker module swaps torch.cuda's streams and events for placeholders
        # in any process that imports it; a GPU engine must still have torch's own.
        "torch_cuda_event": f"{torch.cuda.Event.__module__}.{torch.cuda.Event.__qualname__}",
        "versions": _versions(),
        # the plugin's MLA decode launches planned so far, by kernel (captures and eager steps)
        "mla_launches": dict(PLANNED_LAUNCHES),
    }


def _versions() -> dict:
    import torch
    import triton
    import vllm

    import atom_plugin

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "atom_plugin": atom_plugin.__file__,
    }


def prompts(workload: Workload, seed: int | str) -> list[list[int]]:
    """The pass's prompts: the same for the same workload name, sizes and seed."""
    rng = random.Random(f"{workload.name}/{seed}")
    shared = [rng.randrange(1000, 30000) for _ in range(workload.shared_prefix)]
    own = workload.prompt_len - workload.shared_prefix
    return [
        shared + [rng.randrange(1000, 30000) for _ in range(own)] for _ in range(workload.requests)
    ]


def run_workload(
    llm, workload: Workload, tag: str, seed: int | str = 0, observer=None, probe: bool = False
) -> dict:
    """Submit every prompt at once, then step the engine to the end, timing each step.
    `observer` (engine_probe.PhaseProfiler) hears of each step; `probe`: the step
    probe's summary of the pass comes back under "probe"."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=workload.output_len,
        min_tokens=workload.output_len,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )
    ids_per_request = prompts(workload, seed)
    engine = llm.llm_engine
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[tuple[float, float, int]] = []  # (start, seconds, requests still prefilling)
    if probe:
        llm.collective_rpc(engine_probe.begin)
    t0 = time.perf_counter()
    for i, ids in enumerate(ids_per_request):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        if observer is not None:
            observer.before_step(
                prefilling=len(first) < workload.requests,
                requests=workload.requests - len(done),
            )
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        if observer is not None:
            observer.after_step()
        steps.append((start, end - start, workload.requests - len(first)))
        for out in outputs:
            rid = out.request_id
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = end
            if out.finished:
                done[rid] = end
    wall = time.perf_counter() - t0
    if observer is not None:
        observer.stop()
    probed = llm.collective_rpc(engine_probe.end)[0] if probe else None
    n_out = workload.requests * workload.output_len
    decode_steps = [s for _, s, waiting in steps if waiting == 0]
    prefill_steps = [s for _, s, waiting in steps if waiting > 0]
    tpot = [
        (done[r] - first[r]) / (workload.output_len - 1)
        for r in done
        if r in first and workload.output_len > 1
    ]
    return {
        "workload": workload.name,
        "requests": workload.requests,
        "prompt_len": workload.prompt_len,
        "output_len": workload.output_len,
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_out + workload.requests * workload.prompt_len) / wall,
        "ttft_ms": 1e3 * statistics.mean(first[r] - t0 for r in first) if first else None,
        "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else None,
        "steps": len(steps),
        "decode_step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else None,
        "prefill_phase_s": sum(prefill_steps),
        "prefill_phase_steps": len(prefill_steps),
        **({"probe": probed} if probed is not None else {}),
    }


def physical_limits() -> dict | None:
    """The same run's limits beside the engine's figures: device-to-device copy (GB/s, read +
    written) and a dense bf16 matmul (TFLOP/s), measured in this process under the lock."""
    import torch

    if not torch.cuda.is_available():
        return None
    from benchmarks._timing import copy_bandwidth_gbps, matmul_tflops

    limits = {"copy_gbps": copy_bandwidth_gbps(), "matmul_tflops": matmul_tflops()}
    torch.cuda.empty_cache()
    return limits


def _wait_for_wave(ready_dir: Path, suffixes: tuple[str, ...], size: int, timeout: float) -> bool:
    """Waits until `size` cases of the wave have left a mark with one of `suffixes` in
    `ready_dir`; False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([p for p in ready_dir.iterdir() if p.suffix in suffixes]) >= size:
            return True
        time.sleep(0.5)
    return False


def start_in_wave(spec: dict, name: str, result: dict):
    """The case's engine (`spec["llm"]`), started beside the others of its wave: its start
    time and worker facts go into `result`, and it returns once the whole wave has started
    (or failed), so no case is measured while another compiles. None if it failed to start
    (`result["error"]` says why)."""
    from vllm import LLM

    ready_dir = Path(spec["ready_dir"])
    t0 = time.perf_counter()
    try:
        llm = LLM(**spec["llm"])
    except Exception:
        (ready_dir / f"{name}.failed").write_text(traceback.format_exc())
        result["error"] = traceback.format_exc(limit=8)
        return None
    result["startup_s"] = time.perf_counter() - t0
    result["engine"] = llm.collective_rpc(worker_facts)[0]
    (ready_dir / f"{name}.ready").touch()
    timeout = spec["wave_timeout_s"]
    if not _wait_for_wave(ready_dir, (".ready", ".failed"), spec["wave_size"], timeout):
        print(f"# wave incomplete after {timeout:.0f} s; measuring anyway", flush=True)
    return llm


def measured_passes(spec: dict) -> list[tuple[str, int, str]]:
    """(workload, seed, kind) of every measured pass, the same list in every case of a
    wave: `repeats` rounds over the workloads, each workload's new pass on prompts of
    the round's own (the seed) and, with `again`, the same prompts once more right after
    it. Rounds rather than back-to-back repeats: a slow spell of the host or the GPU
    then lands on one pass of several workloads, not on every pass of one."""
    passes = []
    for rep in range(spec["repeats"]):
        for name in spec["workloads"]:
            passes.append((name, rep, "new"))
            if spec.get("again"):
                passes.append((name, rep, "again"))
    return passes


def main(spec: dict) -> dict:
    import torch

    from benchmarks.engine_shapes import WORKLOADS
    from benchmarks.engine_turns import Turns
    from benchmarks.gpu_clocks import ClockSampler
    from benchmarks.host_load import HostLoad, cpu_model

    name = spec["case"]
    result: dict = {"case": name, "spec": {k: v for k, v in spec.items() if k != "ready_dir"}}
    result["measuring_pid"] = os.getpid()
    result["cpus"] = sorted(os.sched_getaffinity(0))
    llm = start_in_wave(spec, name, result)
    if llm is None:
        return result
    passes = measured_passes(spec)
    turns = Turns(
        Path(spec["ready_dir"]),
        spec["wave_cases"],
        rounds=len(passes) + 2,  # set-up, the passes, the profiles
        case=name,
        timeout=spec["measure_timeout_s"],
    )
    probe = bool(spec.get("probe"))
    with turns.turn(0):
        result["measured_at"] = time.time()
        result["physical"] = physical_limits()
        result["host_cpu"] = cpu_model()
        workloads = [WORKLOADS[w] for w in spec["workloads"]]
        # The first pass of the first workload runs cold: JIT compiles that vLLM's own
        # warm-up did not reach land here (a user's first requests pay them too).
        result["cold"] = run_workload(llm, workloads[0], "cold", seed="cold")
        result["warm"] = [
            run for w in workloads for run in warm_up(llm, w, again=bool(spec.get("again")))
        ]
        if probe:
            llm.collective_rpc(engine_probe.install)
    runs = []
    for k, (workload, seed, kind) in enumerate(passes, start=1):
        with turns.turn(k), ClockSampler() as clocks, HostLoad() as host:
            at = time.time()
            run = run_workload(
                llm, WORKLOADS[workload], f"{workload}-{kind}-{seed}", seed=seed, probe=probe
            )
            at = [at, time.time()]
        runs.append(
            {
                **run,
                "pass": kind,
                "round": seed,
                "at": at,
                "clocks": clocks.summary,
                "host": host.summary,
            }
        )
        print("RUN " + json.dumps(runs[-1]), flush=True)
        # Saved after every pass: a case killed at the run's deadline keeps its rows.
        result["runs"] = runs
        save(spec, result)
    with turns.turn(len(passes) + 1):
        result["profiles"] = [profile(llm, spec, entry) for entry in spec["profile"]]
        result["measured_until"] = time.time()
    result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result["turns"] = turns.positions
    save(spec, result)
    # Up until every case of the wave has measured (or stopped): each case measures
    # beside the same started engines.
    if not turns.wait_for_all():
        print("# the wave did not finish measuring in time; leaving", flush=True)
    result["left_at"] = time.time()
    return result


def warm_up(llm, workload: Workload, again: bool) -> list[dict]:
    """Short passes at the workload's own concurrency on prompts of their own, so the JIT
    compiles its steps need (Triton specializes kernels on the step's sizes: the batch's
    split counts and merge tiles, the token rows of a prefix-cache hit) land here and not
    in the measured passes; the cold pass reports what a first request pays. With `again`,
    the same prompts run once more, as the measured `again` pass runs its prompts. Returns
    each pass's sizes and wall time."""
    short = workload.scaled(workload.requests, 4)
    passes = ["new", "again"] if again else ["new"]
    runs = []
    for kind in passes:
        run = run_workload(llm, short, f"warm-{workload.name}-{kind}", seed="warm")
        keep = ("workload", "requests", "output_len", "wall_s")
        runs.append({"pass": kind, **{k: run[k] for k in keep}})
    return runs


def profile(llm, spec: dict, entry: str) -> dict:
    """One pass of a workload under torch's profiler, over its decode or its prefill
    steps (`engine_probe.parse_profile_entry`); `@again` passes the prompts of the
    workload's measured first pass (prefix-cache hits where caching is on)."""
    from benchmarks.engine_shapes import WORKLOADS

    name, again, phase = engine_probe.parse_profile_entry(entry)
    w = WORKLOADS[name]
    # Only the profiled steps matter: a prefill profile needs no more than two tokens. A
    # decode profile keeps the workload's output length: cut short, the requests whose
    # prefill ended first finish before the last one's ends, and the profiled steps run a
    # shrinking batch where the timed passes ran all requests (decode-2k at 12 tokens: 64
    # requests down to 24).
    if phase == "prefill":
        w = w.scaled(w.requests, 2)
    observer = engine_probe.PhaseProfiler(phase)
    run = run_workload(
        llm, w, f"profile-{entry}", seed=0 if again else "profile", observer=observer
    )
    label = name + ("@again" if again else "")
    trace_dir = spec.get("trace_dir")
    trace = None
    if trace_dir:
        slug = f"{spec['case']}-{label}-{phase}".replace("@", "-")
        trace = Path(trace_dir) / f"{slug}.json.gz"
    reduced = engine_probe.reduce_trace(observer, label, trace)
    return {**reduced, "pass_wall_s": run["wall_s"]}


def save(spec: dict, result: dict) -> None:
    Path(spec["out_json"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("cpus"):  # before vLLM starts a thread or the engine core's process
        os.sched_setaffinity(0, spec["cpus"])
    out = main(spec)
    save(spec, out)
    print("DONE " + spec["case"], flush=True)
