"""What one eager MLA layer call costs the host at 16 query heads (DeepSeek-V3/Kimi at
TP8): a prefix-cache hit's prefill rows (1 x N new tokens over a cached context) on the
decode kernel, as vLLM's engine runs them between its piecewise graphs, on one CUDA GPU.

Each line, for the decode (`mla.ops.mla_decode` with the step's plan, bf16 query and
cache, block 64) and for the cache write (`mla.ops.write_mla_kv`): host microseconds a call
(median and 90th percentile of 200 calls, each made with the GPU idle) and GPU
microseconds a call replayed from a CUDA graph; beside them, the host time of one plain
torch op launch (an `empty_like` and a `copy_`), the floor any launch pays. With vLLM
importable, its own cache write (`concat_and_cache_mla`) is timed alike. The step's plan
(once a step, not a layer) is timed on the host both ways its token plan is made: the
search on the device, and from the host's query offsets as the builder makes it. A
uniform decode step's plan (every request one new token, `--decode-batches` requests) is
timed the same way, both ways the builder can make it: views of its identity rows and of
vLLM's seq_lens, or an arange and a copy into its buffers. Each plan is timed with its
launch planned, as an eager step's first layer plans it; the views also without, as a
step that a FULL CUDA graph replays pays for them.
`--profile N` adds where the host time of the decode and of the plan from the host's
offsets goes (cProfile, by own and cumulative time).

    python -m benchmarks mla_eager_host [--rows 64,128] [--context 1024] [--profile 30]
        [--decode-batches 1,64]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from benchmarks import kernel_calls
from benchmarks._timing import time_us
from benchmarks.attention_mla import LORA, PAGE, ROPE, Shape
from benchmarks.call_timing import host_profile, host_us, host_us_spread

HEADS = 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,128", help="new tokens of the one request, comma list")
    p.add_argument("--context", type=int, default=1024, help="cached tokens before them")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also print the N functions of most host time in cProfiles of 300 decode calls "
        "and 300 plans from the host's offsets",
    )
    p.add_argument(
        "--decode-batches", default="1,64", help="requests of the uniform decode steps planned"
    )
    args = p.parse_args(argv)
    rows, batches = _counts(args.rows), _counts(args.decode_batches)
    if not rows or min(rows) < 1 or args.context < 0:
        p.error(f"--rows {args.rows!r} --context {args.context}: rows >= 1, context >= 0")
    if not batches or min(batches) < 1:
        p.error(f"--decode-batches {args.decode_batches!r}: a comma list of counts >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"torch launch floor: {_floor_us():.1f} us host a plain op", flush=True)
    for n in rows:
        lines, decode, host_plan = _lines(n, args.context)
        for line in lines:
            print(line, flush=True)
        if args.profile:
            print(host_profile(decode, args.profile), flush=True)
            print(f"the plan from the host's offsets, 1x{n}:", flush=True)
            print(host_profile(_with_launch(host_plan), args.profile), flush=True)
    for batch in batches:
        for line in _decode_step_lines(batch, args.context):
            print(line, flush=True)
    return 0


def _counts(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        return []


def _decode_step_lines(batch: int, context: int) -> list[str]:
    """A uniform decode step's plan (`batch` requests, one new token each, over `context`
    cached keys), host time both ways the builder makes it."""
    dev = torch.device("cuda")
    shape = Shape(batch, context + 1, HEADS, 1, "bf16", dev)
    bufs = tuple(torch.empty(batch, device=dev, dtype=torch.int32) for _ in range(2))
    identity = torch.arange(batch, device=dev, dtype=torch.int32)
    head = f"decode step {batch}x1 over {context}: plan,"
    views, copies = partial(shape.plan, identity=identity), partial(shape.plan, out=bufs)
    return [
        f"{head} views of identity and seq_lens {_host(_with_launch(views))}",
        f"{head} arange and copy into buffers   {_host(_with_launch(copies))}",
        f"{head} views, for a graph replay      {_host(views)}",
    ]


def _with_launch(plan_call):
    """The plan as an eager step pays for it: its first layer's read plans the launch (a
    step that a FULL CUDA graph replays reads none)."""
    return lambda: plan_call().launch


def _lines(n: int, context: int) -> tuple[list[str], object, object]:
    from atom_plugin.attention.mla import ops

    dev, dtype = torch.device("cuda"), torch.bfloat16
    seq = context + n  # the request's keys, its n new tokens last
    shape = Shape(1, seq, HEADS, n, "bf16", dev)
    meta, q, cache, plan = shape.meta, shape.q, shape.kv, shape.plan()
    positions = torch.arange(context, seq, device=dev)
    slots = (meta.block_table[0, positions // PAGE] * PAGE + positions % PAGE).to(torch.int64)
    parts = (q[..., :LORA], q[..., LORA:])  # apart, as vLLM's MLA layer hands them
    decode = partial(ops.mla_decode, parts, cache, meta, plan, scale=0.1, output=shape.new_out())
    kv_c = torch.randn(n, LORA, device=dev).to(dtype)
    k_pe = torch.randn(n, 1, ROPE, device=dev).to(dtype)
    write = partial(ops.write_mla_kv, kv_c, k_pe, cache, slots, kernel_impl="triton")
    launch = plan.launch
    head = f"1x{n} over {context}: {launch.kernel}/{launch.schedule} splits {launch.num_splits}"
    lines = [f"{head} decode {_host_and_gpu(decode)}", f"{head} write  {_host_and_gpu(write)}"]
    bufs = tuple(torch.empty(n, device=dev, dtype=torch.int32) for _ in range(2))
    qsl_cpu = meta.query_start_loc.cpu()
    device_plan = partial(shape.plan, out=bufs)
    host_plan = partial(shape.plan, out=bufs, query_start_loc_cpu=qsl_cpu)
    for how, plan_call in (("device search", device_plan), ("host offsets ", host_plan)):
        lines.append(f"{head} plan, {how} {_host(_with_launch(plan_call))}")
    vllm_write = _vllm_write(kv_c, k_pe, cache, slots)
    if vllm_write is not None:
        lines.append(f"{head} vLLM concat_and_cache_mla {_host_and_gpu(vllm_write)}")
    return lines, decode, host_plan


def _vllm_write(kv_c, k_pe, cache, slots):
    """vLLM's own cache write over the same rows, where vLLM's ops load; else None."""
    try:
        return kernel_calls.vllm_cache_write(kv_c, k_pe, cache, slots)
    except (ImportError, AttributeError):
        return None


def _host(call) -> str:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    median, p90 = host_us_spread(call)
    return f"host {median:6.1f} us/call (p90 {p90:6.1f})"


def _host_and_gpu(call) -> str:
    return f"{_host(call)}, GPU {time_us(call, iters=50):6.1f} us"


def _floor_us() -> float:
    x = torch.empty(1024, device="cuda")

    def op():
        torch.empty_like(x).copy_(x)

    for _ in range(5):
        op()
    return statistics.median(host_us(op) for _ in range(200))


if __name__ == "__main__":
    raise SystemExit(main())
