"""One request's MHA prefill as vLLM's engine runs it outside CUDA graphs: a
1 x N prompt, 32 q / 8 kv heads, head 128, bf16, block 16, through `ops.paged_attention`
with the step's plan, on one CUDA GPU.

vLLM's engine graphs whole steps only for uniform decode batches; a step with a prefill
runs its attention between piecewise graphs (or none, past the largest capture size), an
eager call a layer, so its host time counts whenever the GPU work is short. Each line:
the call's GPU time replayed from a CUDA graph and called eagerly (median, L2 flushed
before each); its host time (median and 90th percentile of 200 calls, each made with the
GPU idle); and 32 eager "layers" of the 8B shape's MLP up-projection (N x 4096 @ 4096 x
28672) without and with the attention, whose difference over 32 is what the attention
adds to a layer when the host runs ahead.
`--profile N` adds where the call's host time goes (cProfile).
Run it once per tree to compare two kernels (the atom_plugin and benchmarks packages are
imported from PYTHONPATH):

    PYTHONPATH=TREE python benchmarks/mha_prefill_eager.py --tag TREE [--prompts 1024,512,2048] \
        [--profile 30]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks._timing import L2Flusher, time_us
from benchmarks.call_timing import host_profile, host_us_spread

HQ, HKV, D, BLOCK = 32, 8, 128, 16
LAYERS = 32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="", help="the tree's name, printed on each line")
    p.add_argument("--prompts", default="1024,512,2048", help="prompt lengths, comma list")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also print the N functions of most host time (own, then with callees) in a "
        "cProfile of 300 calls, each made with the GPU idle",
    )
    args = p.parse_args(argv)
    try:
        prompts = [int(n) for n in args.prompts.split(",")]
    except ValueError:
        prompts = []
    if not prompts or min(prompts) < 1:
        p.error(f"--prompts {args.prompts!r}: a comma list of prompt lengths >= 1, e.g. 1024,512")

    from benchmarks import attention

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    pool = attention.KVPool(2 * max(prompts), BLOCK, hkv=HKV, d=D)
    for n in prompts:
        line, call = _line(pool, n)
        print(args.tag, line, flush=True)
        if args.profile:
            print(host_profile(call, args.profile), flush=True)
    return 0


def _line(pool, n: int) -> tuple[str, object]:
    from atom_plugin.attention.mha import ops
    from atom_plugin.attention.mha.params import AttentionParams
    from atom_plugin.attention.mha.planner import plan_for_caches

    meta = pool.meta([(n, n)], seed=3)
    meta.plan = plan_for_caches(meta, pool.key_cache)
    q = (torch.randn(n, HQ, D, device="cuda") * 0.3).to(torch.bfloat16)
    out = torch.empty_like(q)
    params = AttentionParams(scale=D**-0.5)
    call = partial(ops.paged_attention, q, pool.key_cache, pool.value_cache, meta, params, out)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    graph_us = time_us(call, flush=L2Flusher(), iters=50)
    eager_us = time_us(call, flush=L2Flusher(), iters=50, graph=False)
    host_median, host_p90 = host_us_spread(call)
    x = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 28672, device="cuda", dtype=torch.bfloat16)
    bare = _layers_us(partial(torch.matmul, x, w))
    with_attention = _layers_us(lambda: (x @ w, call()))
    line = (
        f"1x{n}: attention graph {graph_us:7.1f} us, eager {eager_us:7.1f} us, "
        f"host {host_median:6.1f} us/call (p90 {host_p90:6.1f}); "
        f"{LAYERS} layers matmul {bare:8.1f} us, +attention {with_attention:8.1f} us -> "
        f"{(with_attention - bare) / LAYERS:6.1f} us a layer"
    )
    return line, call


def _layers_us(layer) -> float:
    """Median microseconds of LAYERS eager calls of `layer` (15 samples)."""

    def layers():
        for _ in range(LAYERS):
            layer()

    return time_us(layers, iters=15, warmup=0, graph=False)


if __name__ == "__main__":
    raise SystemExit(main())
