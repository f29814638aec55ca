"""Two-batch overlap across data-parallel ranks: decode step time with TBO on and off.

`--world` processes (default 2), one GPU each, run the
TBO test model with DP attention: each rank attends over its own requests
(`--batches` per rank) and its own KV cache, and every layer's experts
(sharded over the ranks) are reached through real collectives - an
all-gather of hidden states and gates (dispatch) and an all-reduce of the
expert outputs (combine), the model's `GroupComm`. Each step's mode is agreed
over a gloo group (`decide_across_dp`) before timing.

For each batch and each execution it times one decode step:
- eager: TBO off (one forward) vs TBO on (two micro-batches on the runner's
  worker threads, their collectives on the comm stream);
- replay: the unsplit graph (TBO off) vs the split replay (TBO on), a step
  being "refresh the static buffers in place + replay" (`GraphedDecoder`).
  On CUDA these are CUDA graphs with the NCCL collectives captured inside
  them, issued from the worker threads; on CPU (gloo) no graphs exist and
  "replay" re-runs the recorded step on its static buffers (`RerunGraphs`).

References measured in the same run, on each rank: the compute alone (the
unsplit step with `OneRankComm`: the same shapes, no transfer, run as the
execution runs it) and the communication alone (the step's collectives back
to back, eagerly). The ideal overlap is max(compute, communication); the
serial sum is compute + communication. Each figure is the slowest rank's
median (ranks wait for each other in every collective).

Before timing, TBO on is checked against TBO off on every rank (relative max
error of the hidden states; above `--tolerance` every rank aborts).

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 are set in the parent before the ranks are spawned.

    python3 -m benchmarks.tbo_dp --out tbo_dp.md --json tbo_dp.json           # 2 GPUs, NCCL
    python3 -m benchmarks.tbo_dp --executions eager                             # no graphs
    python3 -m benchmarks.tbo_dp --compute-streams 2                             # 1 stream/ubatch
    python3 -m benchmarks.tbo_dp --backend gloo --device cpu --batches 4 8      # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tbo_harness.batches import decode_blocks, run_step, uniform_decode_batch  # noqa: E402
from tbo_harness.dp_workers import NO_MULTICAST_ENV, free_port, wait_for_device  # noqa: E402
from tbo_harness.graphed import GraphedDecoder  # noqa: E402
from tbo_harness.model import (  # noqa: E402
    OVERLAP_SCHEDULES,
    GroupComm,
    KVCaches,
    ModelConfig,
    OneRankComm,
    TboTestModel,
)
from tbo_harness.rerun_graphs import RerunGraphs  # noqa: E402

from atom_plugin.tbo import BatchShape, MicroBatchRunner, TboConfig  # noqa: E402
from atom_plugin.tbo.dp import decide_across_dp  # noqa: E402
from atom_plugin.tbo.runner import COMPUTE_STREAM_CHOICES  # noqa: E402
from benchmarks.tbo import MODEL as BENCH_MODEL  # noqa: E402
from benchmarks.tbo import markdown, publish  # noqa: E402

MODELS = {"bench": BENCH_MODEL, "tiny": ModelConfig()}
EXECUTIONS = ("eager", "replay")
TBO_ON = TboConfig()
TBO_OFF = TboConfig(decode=False, prefill=False)
COLLECTIVE_TIMEOUT_S = 180  # a hung rank fails the run after this, not after the 10 min limit


class Mismatch(RuntimeError):
    """TBO on differs from TBO off beyond the tolerance on some rank."""


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 for an empty batch)."""
    if ref.numel() == 0:
        return 0.0
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def check_equal(errors: list[float], tolerance: float, what: str) -> float:
    """The largest per-rank error; raises `Mismatch` (naming the ranks) above `tolerance`."""
    bad = {r: e for r, e in enumerate(errors) if not e <= tolerance}
    if bad:
        raise Mismatch(
            f"{what}: TBO on differs from TBO off by {bad} (rank: rel err) > {tolerance}"
        )
    return max(errors)


def median_ms(fn, iters: int, device: torch.device) -> float:
    """Median milliseconds of one call after 3 warm-up calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        from benchmarks._timing import time_us

        return time_us(fn, iters=iters, warmup=3, graph=False) / 1e3
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


class Rank:
    """One rank's model, caches and runner, and the collectives over the other ranks."""

    def __init__(self, args: dict, rank: int, world: int, runner: MicroBatchRunner):
        self.args, self.rank, self.world, self.runner = args, rank, world, runner
        self.device = torch.device(f"cuda:{rank}" if args["device"] == "cuda" else "cpu")
        self.cpu_group = dist.new_group(backend="gloo")
        self.cfg = MODELS[args["model"]]
        self.model = TboTestModel(
            self.cfg, self.device, comm=GroupComm(), seed=0, overlap=args["overlap"]
        )
        self.compute_model = TboTestModel(
            self.cfg, self.device, comm=OneRankComm(world, rank), seed=0
        )
        self.max_blocks = decode_blocks(args["context"], self.cfg.block_size)
        self.num_blocks = max(args["batches"]) * self.max_blocks + 1
        self.caches = KVCaches.random(self.cfg, self.num_blocks, self.device, seed=rank)

    def gather(self, value) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.cpu_group)
        return out

    def timed(self, fn) -> float:
        """The slowest rank's median ms (every rank times the same calls, in lockstep)."""
        dist.barrier(group=self.cpu_group)
        return max(self.gather(median_ms(fn, self.args["iters"], self.device)))

    def comm_alone(self, batch_size: int):
        """The collectives of one unsplit step: dispatch and combine in every layer."""
        cfg, comm = self.cfg, self.model.comm
        payload = torch.randn(batch_size, cfg.hidden + cfg.experts, device=self.device)
        expert_out = torch.randn(self.world * batch_size, cfg.hidden, device=self.device)
        payload, expert_out = payload.to(cfg.dtype), expert_out.to(cfg.dtype)

        def step():
            for _ in range(cfg.layers):
                comm.dispatch(payload)
                comm.combine(expert_out)

        return step

    def agree(self, batch, config: TboConfig, keys=()):
        shape = BatchShape.from_query_lens(batch.query_lens)
        return decide_across_dp(shape, config, list(keys), group=self.cpu_group)

    def decoder(self, model, batch_size: int, config: TboConfig) -> GraphedDecoder:
        graphs = RerunGraphs() if self.device.type == "cpu" else None
        return GraphedDecoder(
            model, self.caches, self.runner, [batch_size], config, self.max_blocks, graphs=graphs
        )

    def step_fns(self, execution: str, batch):
        """(TBO off, TBO on, compute alone) step functions, with the agreed modes checked."""
        b = batch.meta.num_reqs
        if execution == "eager":
            off, on = self.agree(batch, TBO_OFF), self.agree(batch, TBO_ON)
            fns = [
                lambda: run_step(self.model, self.runner, batch, self.caches, off),
                lambda: run_step(self.model, self.runner, batch, self.caches, on),
                lambda: run_step(self.compute_model, self.runner, batch, self.caches, off),
            ]
        else:
            dec_off, dec_on = (
                self.decoder(self.model, b, TBO_OFF),
                self.decoder(self.model, b, TBO_ON),
            )
            dec_compute = self.decoder(self.compute_model, b, TBO_OFF)
            off, on = (
                self.agree(batch, TBO_OFF, dec_off.plan),
                self.agree(batch, TBO_ON, dec_on.plan),
            )
            if not (off.replay and on.replay):
                raise RuntimeError(f"batch {b}: expected replays, got {off} and {on}")
            fns = [
                lambda: dec_off.step(batch, off),
                lambda: dec_on.step(batch, on),
                lambda: dec_compute.step(batch),
            ]
        if off.split or not on.split:
            raise RuntimeError(f"batch {b} {execution}: expected TBO off unsplit, on split")
        return fns, on

    def measure(self, batch_size: int, execution: str) -> dict:
        args = self.args
        batch = uniform_decode_batch(
            self.cfg, batch_size, args["context"], self.num_blocks, self.device, 1000 + self.rank
        )
        (off, on, compute), mode_on = self.step_fns(execution, batch)
        what = f"batch {batch_size} per rank, {execution}"
        ref = off().float().clone()
        err = rel_error(on(), ref)
        wait_for_device(self.device, COLLECTIVE_TIMEOUT_S, f"rank {self.rank}, {what}")
        row = dict(batch=batch_size, execution=execution)
        row["rel_err"] = check_equal(self.gather(err), args["tolerance"], what)
        row["ubatch_num_tokens"] = list(mode_on.ubatch_num_tokens)
        row["tbo_off_ms"] = self.timed(off)
        row["tbo_on_ms"] = self.timed(on)
        row["compute_alone_ms"] = self.timed(compute)
        row["comm_alone_ms"] = self.timed(self.comm_alone(batch_size))
        row["off_over_on"] = row["tbo_off_ms"] / row["tbo_on_ms"]
        row["ideal_overlap_ms"] = max(row["compute_alone_ms"], row["comm_alone_ms"])
        row["serial_ms"] = row["compute_alone_ms"] + row["comm_alone_ms"]
        return row


def _worker(rank: int, world: int, port: int, args: dict, result_path: str) -> None:
    if args["device"] == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        args["backend"],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        with MicroBatchRunner(
            args["device"], timeout_s=COLLECTIVE_TIMEOUT_S, compute_streams=args["compute_streams"]
        ) as runner:
            me = Rank(args, rank, world, runner)
            rows = []
            for b in args["batches"]:
                for execution in args["executions"]:
                    rows.append(me.measure(b, execution))
                    if rank == 0:
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    gc.collect()
                    if me.device.type == "cuda":
                        torch.cuda.empty_cache()
            name = torch.cuda.get_device_name(rank) if me.device.type == "cuda" else "cpu"
            devices = me.gather(name)
        if rank == 0:
            Path(result_path).write_text(json.dumps(dict(rows=rows, devices=devices)))
    finally:
        dist.destroy_process_group()


COLUMNS = [
    ("batch", "batch / rank", "{}"),
    ("execution", "execution", "{}"),
    ("tbo_off_ms", "TBO off ms", "{:.3f}"),
    ("tbo_on_ms", "TBO on ms", "{:.3f}"),
    ("off_over_on", "off / on", "{:.2f}x"),
    ("compute_alone_ms", "compute alone ms", "{:.3f}"),
    ("comm_alone_ms", "comm alone ms", "{:.3f}"),
    ("ideal_overlap_ms", "ideal overlap ms", "{:.3f}"),
    ("serial_ms", "serial ms", "{:.3f}"),
    ("rel_err", "on vs off rel err", "{:.1e}"),
]


def header(args: argparse.Namespace, devices: list[str], when: datetime.datetime) -> list[str]:
    cfg = MODELS[args.model]
    comm = args.backend
    if args.backend == "nccl":
        v = torch.cuda.nccl.version()
        comm += " " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v))
    comm += ", NVLink multicast off (" + " ".join(f"{k}={v}" for k, v in NO_MULTICAST_ENV.items())
    comm += ")"
    replay = (
        "CUDA graphs with the collectives captured inside"
        if args.device == "cuda"
        else "no CUDA graphs on CPU: the recorded step re-run on its static buffers"
    )
    return [
        f"# TBO decode step over {args.world} data-parallel ranks ({when:%Y-%m-%d %H:%M} UTC)",
        f"devices: {', '.join(f'rank {r}: {d}' for r, d in enumerate(devices))}; "
        f"torch {torch.__version__}; backend {comm}",
        f"model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} heads x "
        f"{cfg.head_dim}, {cfg.experts} experts x ffn {cfg.ffn} sharded over the ranks "
        f"(dense-masked), {str(cfg.dtype).removeprefix('torch.')}; context {args.context} "
        f"tokens/request; per layer an all-gather (dispatch) and an all-reduce (combine)",
        f"replay: {replay}; each figure is the slowest rank's median of {args.iters} steps; "
        "comm alone is the step's collectives issued eagerly back to back",
        f"TBO on: MicroBatchRunner(compute_streams={args.compute_streams}), "
        f"hand-over {args.overlap}",
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256], help="per rank")
    p.add_argument("--executions", nargs="+", choices=EXECUTIONS, default=list(EXECUTIONS))
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), help="default: bench on cuda, tiny on cpu")
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each on cuda)")
    p.add_argument("--context", type=int, help="cached tokens per request (1024; 8 on cpu)")
    p.add_argument("--iters", type=int, help="timed steps per figure (50; 3 on cpu)")
    p.add_argument(
        "--compute-streams",
        type=int,
        choices=COMPUTE_STREAM_CHOICES,
        default=1,
        help="compute streams of the micro-batch runner (2: one per micro-batch)",
    )
    p.add_argument(
        "--overlap",
        choices=OVERLAP_SCHEDULES,
        default="per_comm",
        help="where the micro-batches hand over: after each collective (per_comm), or at "
        "three segments per layer with micro-batch 1 one segment behind (staged)",
    )
    p.add_argument("--tolerance", type=float, help="max rel err on vs off (5e-2 bf16, 1e-4 fp32)")
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--json", help="write the rows and the setting as JSON here")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.model = args.model or ("tiny" if cpu else "bench")
    if args.context is None:
        args.context = 8 if cpu else 1024
    if args.iters is None:
        args.iters = 3 if cpu else 50
    if args.tolerance is None:
        args.tolerance = 1e-4 if MODELS[args.model].dtype == torch.float32 else 5e-2
    pairs = {("nccl", "cuda"), ("gloo", "cpu")}
    if (args.backend, args.device) not in pairs:
        p.error(f"--backend {args.backend} with --device {args.device}: use one of {sorted(pairs)}")
    if args.world < 2:
        p.error(f"--world must be >= 2 (data-parallel ranks), got {args.world}")
    if any(b < 3 for b in args.batches):
        p.error(f"--batches must be >= 3 per rank (smaller batches never split): {args.batches}")
    if args.context < 0 or args.iters < 1:
        p.error(f"--context must be >= 0 and --iters >= 1, got {args.context}, {args.iters}")
    if MODELS[args.model].experts % args.world:
        p.error(f"{MODELS[args.model].experts} experts do not shard over --world {args.world}")
    if not cpu and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(NO_MULTICAST_ENV)  # inherited by the spawned ranks
    settings = dict(vars(args), batches=list(args.batches))
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rows.json")
        mp.spawn(
            _worker,
            args=(args.world, free_port(), settings, result_path),
            nprocs=args.world,
            join=True,
        )
        result = json.loads(Path(result_path).read_text())
    now = datetime.datetime.now(datetime.timezone.utc)
    table = markdown(result["rows"], header(args, result["devices"], now), COLUMNS)
    setting = {k: v for k, v in settings.items() if k not in ("out", "json")}
    report = dict(
        date=now.isoformat(),
        devices=result["devices"],
        torch=torch.__version__,
        env={k: os.environ[k] for k in NO_MULTICAST_ENV},
        setting=setting,
        model={k: str(v) for k, v in vars(MODELS[args.model]).items()},
        rows=result["rows"],
    )
    publish(table, report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
