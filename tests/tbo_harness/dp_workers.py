"""Data-parallel workers for the TBO tests: spawned processes over gloo (CPU).

Each worker writes what it saw to `out_dir/rank{r}.pt`; the test process
checks the files. Collectives time out after `GLOO_TIMEOUT_S`, so a rank left
waiting on a collective the others skipped fails the test instead of hanging it.
A worker still running after `WORKER_DEADLINE_S` prints every thread's stack
and exits, so a hang anywhere else (a graph capture, a blocked thread) fails
the test with the place it hung instead of running into the job's limit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts.serve import free_port

GLOO_TIMEOUT_S = 30
WORKER_DEADLINE_S = 150


def spawn(fn, world: int, *args) -> None:
    """Run `fn(rank, world, port, *args)` in `world` processes; a failing rank raises here."""
    mp.spawn(_run_with_deadline, args=(fn, world, free_port(), *args), nprocs=world, join=True)


def _run_with_deadline(rank: int, fn, *args) -> None:
    with deadline():
        fn(rank, *args)


NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def wait_for_device(device, timeout_s: float, what: str) -> None:
    """Wait for this rank's queued GPU work, or end the process after `timeout_s`.

    A collective captured in a CUDA graph has no NCCL watchdog, so a replay
    that never completes would block the next synchronisation for good; exiting
    lets `spawn` fail the run (and stop the other ranks) instead.
    """
    if torch.device(device).type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            print(f"{what}: the GPU did not finish within {timeout_s} s", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
        time.sleep(0.001)


@contextlib.contextmanager
def deadline(seconds: float = WORKER_DEADLINE_S):
    """Dump all threads' stacks to stderr and exit the process if the block outlasts `seconds`."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _init(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ.update(NO_MULTICAST_ENV)
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )


def _setup(rank: int, world: int, port: int, backend: str):
    """Join the group; this rank's device, CPU agreement group (None: the default) and config."""
    from .model import GPU_CONFIG, ModelConfig

    _init(rank, world, port, backend)
    if backend == "nccl":
        return f"cuda:{rank}", dist.new_group(backend="gloo"), GPU_CONFIG
    return "cpu", None, ModelConfig()


def _on_vs_off(off, on) -> dict:
    """One case's record from the (output, caches, mode) of TBO off and on."""
    (ref, ref_c, mode_off), (out, out_c, mode_on) = off, on
    return dict(
        mode_on=mode_on,
        mode_off=mode_off,
        out_diff=float((out - ref).abs().max()) if out.numel() else 0.0,
        cache_diff=max(
            float((a - b).abs().max()) for a, b in zip(out_c.raw, ref_c.raw, strict=True)
        ),
        scale=float(ref.abs().max()) if ref.numel() else 0.0,
    )


def _save(out_dir: str, rank: int, obj) -> None:
    torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))


def agreement_worker(rank, world, port, scenarios, out_dir) -> None:
    """For each scenario (per-rank BatchShapes, graph keys, per-rank configs): decide across DP."""
    from atom_plugin.tbo import dp

    _init(rank, world, port)
    calls = []
    real_all_gather = dist.all_gather

    def counting_all_gather(*args, **kwargs):
        calls.append(1)
        return real_all_gather(*args, **kwargs)

    dp.dist.all_gather = counting_all_gather
    seen = []
    try:
        for shapes, graph_keys, configs in scenarios:
            before = len(calls)
            try:
                mode = dp.decide_across_dp(shapes[rank], configs[rank], graph_keys)
            except ValueError as e:
                mode = f"ValueError: {e}"
            seen.append((mode, len(calls) - before))
    finally:
        dp.dist.all_gather = real_all_gather
        dist.destroy_process_group()
    _save(out_dir, rank, seen)


def model_worker(rank, world, port, cases, out_dir, backend="gloo") -> None:
    """Issue 7: the test model with a real collective per layer; TBO on vs off per rank.

    `cases` are (kind, per-rank sizes, graph buckets): kind "decode" sizes are
    request counts; "prefill" sizes are lists of query lengths. With backend
    "nccl" each rank runs on its GPU (eagerly; replay-layout cases run the
    bucket cut eagerly) and agrees over a separate gloo group.
    """
    from atom_plugin.tbo import BatchShape, MicroBatchRunner, TboConfig, plan_request_graphs
    from atom_plugin.tbo.dp import decide_across_dp

    from .batches import make_batch, random_decode_batch, run_step
    from .model import GroupComm, KVCaches, TboTestModel

    device, cpu_group, cfg = _setup(rank, world, port, backend)
    model = TboTestModel(cfg, device, comm=GroupComm(), seed=0)
    results = []
    on, off = TboConfig(), TboConfig(decode=False, prefill=False)
    try:
        with MicroBatchRunner(device, timeout_s=GLOO_TIMEOUT_S * 2) as runner:
            for case_id, (kind, sizes, buckets) in enumerate(cases):
                seed = 100 * case_id + rank
                if kind == "decode":
                    batch = random_decode_batch(cfg, sizes[rank], 6, 600, device, seed)
                else:
                    lens = sizes[rank]
                    batch = make_batch(cfg, lens, [2] * len(lens), 12, 600, device, seed)
                caches = KVCaches.random(cfg, 600, device, seed=rank)
                shape = BatchShape.from_query_lens(batch.query_lens)
                outs = {}
                for name, config in (("off", off), ("on", on)):
                    keys = [k for k, _ in plan_request_graphs(buckets, 1, config)]
                    mode = decide_across_dp(shape, config, keys, group=cpu_group)
                    c = caches.clone()
                    outs[name] = (run_step(model, runner, batch, c, mode), c, mode)
                results.append(_on_vs_off(outs["off"], outs["on"]))
    finally:
        dist.destroy_process_group()
    _save(out_dir, rank, results)


def replay_worker(rank, world, port, cases, buckets, out_dir, backend="gloo") -> None:
    """Issue 7 on replay: decode steps from request graphs, TBO on vs off, on each rank.

    `cases` are per-rank request counts. Each step's mode is agreed across the
    ranks (`decide_across_dp` over a gloo group) and the agreed bucket's graph
    is replayed: real CUDA graphs with the NCCL collectives captured inside
    them with backend "nccl", `RerunGraphs` (the recorded step re-run on its
    static buffers) on CPU. Every step starts from the same KV caches.
    """
    from atom_plugin.tbo import BatchShape, MicroBatchRunner, TboConfig
    from atom_plugin.tbo.dp import decide_across_dp

    from .batches import random_decode_batch
    from .graphed import GraphedDecoder
    from .model import GroupComm, KVCaches, TboTestModel
    from .rerun_graphs import RerunGraphs

    device, cpu_group, cfg = _setup(rank, world, port, backend)
    max_blocks, num_blocks = 6, 600
    model = TboTestModel(cfg, device, comm=GroupComm(), seed=0)
    source = KVCaches.random(cfg, num_blocks, device, seed=rank)
    configs = {"off": TboConfig(decode=False, prefill=False), "on": TboConfig()}
    results = []
    try:
        with MicroBatchRunner(device, timeout_s=GLOO_TIMEOUT_S * 2) as runner:
            decoders = {
                name: GraphedDecoder(
                    model,
                    source.clone(),
                    runner,
                    buckets,
                    config,
                    max_blocks,
                    graphs=RerunGraphs() if backend != "nccl" else None,
                )
                for name, config in configs.items()
            }
            for case_id, sizes in enumerate(cases):
                batch = random_decode_batch(
                    cfg, sizes[rank], max_blocks, num_blocks, device, 100 * case_id + rank
                )
                shape = BatchShape.from_query_lens(batch.query_lens)
                seen = {}
                for name, dec in decoders.items():
                    mode = decide_across_dp(shape, configs[name], list(dec.plan), group=cpu_group)
                    for raw, src in zip(dec.caches.raw, source.raw, strict=True):
                        raw.copy_(src)
                    seen[name] = (dec.step(batch, mode).clone(), dec.caches, mode)
                    wait_for_device(device, GLOO_TIMEOUT_S, f"rank {rank} case {case_id} {name}")
                results.append(_on_vs_off(seen["off"], seen["on"]))
            # Graphs holding NCCL collectives must go before the process group:
            # destroying the group under live graphs hung both ranks on the H200s.
            del decoders, dec  # `dec` still names the last decoder after the loop
            gc.collect()
        _save(out_dir, rank, results)
    finally:
        dist.destroy_process_group()
