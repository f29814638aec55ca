"""How long does the host's `cudaGraphLaunch` take for a graph of the plugin's MLA kernels,
node for node, beside graphs of plain torch, cuBLAS and Triton kernels and of vLLM's own?

In vLLM's engine a decode step's FULL graph starts on the GPU only once the host's launch
call has returned (profiles of 2026-12-06, `python -m benchmarks graph_gaps`), and in the
profiled steps of that day's H100 run the call took 566-590 us for the plugin's 274-node
decode graph against 413-427 us for FLASH_ATTN_MLA's graph of as many nodes. Each kind
here captures `--layers` copies of one layer's worth of its kernels in one CUDA graph and
times the host's replay call with the GPU idle (median and 90th percentile of
`--replays` calls); last, one profiled replay counts the graph's nodes (the profiler is
used once, after the timing: a profiler session slows later replays of its process).

Kinds: `aten` (an in-place add), `cublas` (a bf16 GEMM 64 x 1024 x 1024), `triton` (a
plain Triton kernel), `triton-tma` (one reading through a host-built TMA descriptor),
`mla-write` (the plugin's MLA cache write, 64 tokens), `mla-decode` (its decode at 16
heads, 64 requests x 2048 keys, the plan's kernel: stage 1 and the merge), `mla-layer`
(both, as a decode layer runs them); with vLLM's CUDA build, `vllm-write` (its
concat_and_cache_mla) and `vllm-fa3` (its FA3 varlen kernel, 64 tokens).

    python -m benchmarks graph_launch_cost [--kinds aten,mla-layer] [--layers 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks import kernel_calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(LAYERS), help="comma list of kinds")
    p.add_argument("--layers", type=int, default=16, help="copies of a layer's kernels a graph")
    p.add_argument("--replays", type=int, default=100, help="timed launch calls a kind")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in LAYERS]
    if unknown or not kinds:
        p.error(f"--kinds {args.kinds!r}: unknown {unknown}; valid: {', '.join(LAYERS)}")
    if args.layers < 1 or args.replays < 1:
        p.error(f"--layers {args.layers} --replays {args.replays}: both >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"# {args.layers} layers a graph, {args.replays} launch calls a kind, the GPU idle")
    print("| kind | what ran | nodes | launch call us (median, p90) | us a node |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        try:
            result = measure(kind, args.layers, args.replays)
        except Exception as exc:  # one kind's failure (vLLM's without its CUDA build) is its row
            first_line = (str(exc).splitlines() or [""])[0][:200]
            result = {"error": f"{type(exc).__name__}: {first_line}"}
        print(row(kind, result), flush=True)
    return 0


def row(kind: str, r: dict) -> str:
    if "error" in r:
        return f"| {kind} | failed: {r['error']} | | | |"
    per_node = r["launch_us"] / r["nodes"] if r["nodes"] else float("nan")
    return (
        f"| {kind} | {r['ran']} | {r['nodes']} | {r['launch_us']:.1f}, {r['launch_p90_us']:.1f} "
        f"| {per_node:.2f} |"
    )


def measure(kind: str, layers: int, replays: int) -> dict:
    """The launch call's host time for a graph of `layers` copies of `kind`'s layer."""
    from benchmarks.call_timing import host_us_spread
    from benchmarks.graph_gaps import replay_gaps

    layer, ran = LAYERS[kind]()
    graph = kernel_calls.capture(layer, layers)
    for _ in range(5):
        graph.replay()
    launch_us, launch_p90_us = host_us_spread(graph.replay, replays)
    return {
        "ran": ran,
        "nodes": replay_gaps(graph)["nodes"],  # the GPU operations of one replay
        "launch_us": launch_us,
        "launch_p90_us": launch_p90_us,
    }


def _mla_layer() -> kernel_calls.Call:
    write, _ = kernel_calls.mla_write()
    decode, ran = kernel_calls.mla_decode(64, 2048, 1)

    def layer():
        write()
        decode()

    return layer, f"write_mla_kv; {ran}"


LAYERS: dict[str, Callable[[], kernel_calls.Call]] = {
    "aten": kernel_calls.aten_add,
    "cublas": kernel_calls.cublas_mm,
    "triton": kernel_calls.triton_add,
    "triton-tma": kernel_calls.triton_tma,
    "mla-write": kernel_calls.mla_write,
    "mla-decode": lambda: kernel_calls.mla_decode(64, 2048, 1),
    "mla-layer": _mla_layer,
    "vllm-write": kernel_calls.vllm_write,
    "vllm-fa3": kernel_calls.vllm_fa3,
}


if __name__ == "__main__":
    raise SystemExit(main())
