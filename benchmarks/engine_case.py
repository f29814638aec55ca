"""One case of the engine benchmark: one vLLM engine (one attention backend) in this process.

Started by benchmarks/engine.py, one process per case. The engine core runs in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the steps can be timed one by one and
the torch profiler sees the worker. Cases of one wave start together and then measure
one at a time: each marks itself ready, waits for the wave, and takes the lock, so no
measurement overlaps another case's start-up or measurement.

    python -m benchmarks.engine_case SPEC_JSON
"""

from __future__ import annotations

import fcntl
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

from benchmarks.engine_shapes import Workload

ATTENTION_KERNELS = (
    "decode_split",
    "decode_reduce",
    "prefill_kernel",
    "write_kv",
    "flash",
    "fmha",
    "attn",
    "attention",
    "reshape_and_cache",
    "mla",
    "paged",
)
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::_local_scalar_dense",
    "aten::nonzero",
)
HOST_OPS = (
    "vllm::unified_attention_with_output",
    "vllm::unified_kv_cache_update",
    "vllm::unified_mla_attention_with_output",
    "vllm::unified_mla_kv_cache_update",
)


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

    return {
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


def _prompts(workload: Workload, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, 30000) for _ in range(workload.prompt_len)]
        for _ in range(workload.requests)
    ]


def run_workload(llm, workload: Workload, tag: str, seed: int = 0) -> dict:
    """Submit every prompt at once, then step the engine to the end, timing each step."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=workload.output_len,
        min_tokens=workload.output_len,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )
    prompts = _prompts(workload, seed)
    engine = llm.llm_engine
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[tuple[float, float, int]] = []  # (start, seconds, requests still prefilling)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        steps.append((start, end - start, workload.requests - len(first)))
        for out in outputs:
            rid = out.request_id
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = end
            if out.finished:
                done[rid] = end
    wall = time.perf_counter() - t0
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
    }


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


def profile_workload(llm, workload: Workload, tag: str) -> dict:
    """One more pass under the torch profiler: GPU busy time, kernels, syncs, host op cost."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        result = run_workload(llm, workload, tag)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    intervals = []
    host: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            dur = ev.time_range.end - ev.time_range.start
            kernels.setdefault(ev.name, []).append(dur)
            intervals.append((ev.time_range.start, ev.time_range.end))
        elif ev.name in SYNC_CALLS or ev.name in HOST_OPS or ev.name == "cudaGraphLaunch":
            host.setdefault(ev.name, []).append(ev.time_range.end - ev.time_range.start)
    busy = _union_us(intervals)
    total_kernel = sum(sum(v) for v in kernels.values())
    attention = {k: v for k, v in kernels.items() if any(s in k.lower() for s in ATTENTION_KERNELS)}
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "workload": workload.name,
        "wall_s_profiled": result["wall_s"],
        "steps": result["steps"],
        "gpu_busy_s": busy / 1e6,
        "gpu_busy_fraction": busy / 1e6 / result["wall_s"],
        "kernel_s": total_kernel / 1e6,
        "kernel_launches": sum(len(v) for v in kernels.values()),
        "attention_kernel_s": sum(sum(v) for v in attention.values()) / 1e6,
        "top_kernels": [
            {
                "name": k[:90],
                "calls": len(v),
                "total_ms": sum(v) / 1e3,
                "mean_us": statistics.mean(v),
            }
            for k, v in top
        ],
        "attention_kernels": [
            {
                "name": k[:90],
                "calls": len(v),
                "total_ms": sum(v) / 1e3,
                "mean_us": statistics.mean(v),
            }
            for k, v in sorted(attention.items(), key=lambda kv: -sum(kv[1]))[:10]
        ],
        "host": {
            k: {"calls": len(v), "mean_us": statistics.mean(v), "total_ms": sum(v) / 1e3}
            for k, v in host.items()
        },
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


def _wait_for_wave(ready_dir: Path, size: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([p for p in ready_dir.iterdir() if p.suffix in (".ready", ".failed")]) >= size:
            return
        time.sleep(0.5)
    print(f"# wave incomplete after {timeout:.0f} s; measuring anyway", flush=True)


def main(spec: dict) -> dict:
    import torch
    from vllm import LLM

    from benchmarks.engine_shapes import WORKLOADS

    ready_dir = Path(spec["ready_dir"])
    name = spec["case"]
    result: dict = {"case": name, "spec": {k: v for k, v in spec.items() if k != "ready_dir"}}
    t0 = time.perf_counter()
    try:
        llm = LLM(**spec["llm"])
    except Exception:
        (ready_dir / f"{name}.failed").write_text(traceback.format_exc())
        result["error"] = traceback.format_exc(limit=8)
        return result
    result["startup_s"] = time.perf_counter() - t0
    result["engine"] = llm.collective_rpc(worker_facts)[0]
    (ready_dir / f"{name}.ready").touch()
    _wait_for_wave(ready_dir, spec["wave_size"], spec["wave_timeout_s"])
    with open(spec["lock"], "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result["measured_at"] = time.time()
        result["physical"] = physical_limits()
        workloads = [WORKLOADS[w] for w in spec["workloads"]]
        runs = []
        # The first pass of the first workload runs cold: JIT compiles that vLLM's own
        # warm-up did not reach land here (a user's first requests pay them too).
        cold = run_workload(llm, workloads[0], "cold")
        result["cold"] = cold
        for w in workloads:  # small passes compile what each workload's steps need
            run_workload(llm, w.scaled(min(w.requests, 4), 4), f"warm-{w.name}")
        for w in workloads:
            for rep in range(spec["repeats"] if w is workloads[0] else 1):
                runs.append(run_workload(llm, w, f"{w.name}-{rep}", seed=rep))
                print("RUN " + json.dumps(runs[-1]), flush=True)
                # Saved after every pass: a case killed at the run's deadline keeps its rows.
                result["runs"] = runs
                save(spec, result)
        # Shorter passes (their prefill steps and 31 decode steps) keep the traces small.
        result["profiles"] = [
            profile_workload(llm, w.scaled(w.requests, min(32, w.output_len)), f"profile-{w.name}")
            for w in (WORKLOADS[name] for name in spec["profile"])
        ]
        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return result


def save(spec: dict, result: dict) -> None:
    Path(spec["out_json"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = main(spec)
    save(spec, out)
    print("DONE " + spec["case"], flush=True)
