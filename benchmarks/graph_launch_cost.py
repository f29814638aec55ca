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
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

HEADS = 16  # DeepSeek-V3 / Kimi at TP8


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
    from benchmarks.call_timing import host_us

    layer, ran = LAYERS[kind]()
    graph = capture(layer, layers)
    for _ in range(5):
        graph.replay()
    times = sorted(host_us(graph.replay) for _ in range(replays))
    return {
        "ran": ran,
        "nodes": graph_nodes(graph),
        "launch_us": statistics.median(times),
        "launch_p90_us": times[min(len(times) - 1, int(0.9 * len(times)))],
    }


def capture(layer: Callable[[], object], layers: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()  # compiles, picks kernels and workspaces outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            layer()
    return graph


def graph_nodes(graph: torch.cuda.CUDAGraph) -> int:
    """The GPU operations of one replay, from a profiler trace."""
    from benchmarks.graph_gaps import trace_gaps

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "trace.json")
        prof.export_chrome_trace(path)
        return trace_gaps(path)["nodes"]


def _aten():
    x = torch.zeros(64, 1024, device="cuda", dtype=torch.bfloat16)
    return lambda: x.add_(1.0), "add_ (torch)"


def _cublas():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    out = torch.empty_like(x)
    return lambda: torch.mm(x, w, out=out), "torch.mm (cuBLAS)"


def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.zeros(4096, device="cuda")
    return lambda: add_one[(4,)](x, x.numel(), BLOCK=1024), "add_one (Triton)"


def _triton_tma():
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def copy_tile(src_desc, dst_ptr, BLOCK: tl.constexpr):
        tile = src_desc.load([0, 0])
        rows, cols = tl.arange(0, BLOCK)[:, None], tl.arange(0, BLOCK)[None, :]
        tl.store(dst_ptr + rows * BLOCK + cols, tile)

    src = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    desc = TensorDescriptor(src, [64, 64], [64, 1], [64, 64])
    return lambda: copy_tile[(1,)](desc, dst, BLOCK=64), "copy_tile (Triton, TMA descriptor)"


def _mla_write_call():
    from atom_plugin.attention.mla import ops
    from benchmarks.attention_mla import LORA, PAGE, ROPE

    tokens, dtype = 64, torch.bfloat16
    cache = torch.zeros(8, PAGE, LORA + ROPE, device="cuda", dtype=dtype)
    kv_c = torch.randn(tokens, LORA, device="cuda").to(dtype)
    k_pe = torch.randn(tokens, 1, ROPE, device="cuda").to(dtype)
    slots = torch.arange(tokens, device="cuda", dtype=torch.int64)
    return lambda: ops.write_mla_kv(kv_c, k_pe, cache, slots, kernel_impl="triton")


def _mla_decode_call():
    from benchmarks.attention_mla import Shape

    shape = Shape(64, 2048, HEADS, 1, "bf16")
    plan, out = shape.plan(), shape.new_out()
    launch = plan.launch
    ran = f"mla_decode {launch.kernel}/{launch.schedule} splits {launch.num_splits}"
    return lambda: shape.run_new(out, plan), ran


def _mla_write():
    return _mla_write_call(), "write_mla_kv (Triton)"


def _mla_decode():
    return _mla_decode_call()


def _mla_layer():
    write = _mla_write_call()
    decode, ran = _mla_decode_call()

    def layer():
        write()
        decode()

    return layer, f"write_mla_kv; {ran}"


def _vllm_write():
    from vllm import _custom_ops

    from benchmarks.attention_mla import LORA, PAGE, ROPE

    tokens, dtype = 64, torch.bfloat16
    cache = torch.zeros(8, PAGE, LORA + ROPE, device="cuda", dtype=dtype)
    kv_c = torch.randn(tokens, LORA, device="cuda").to(dtype)
    k_pe = torch.randn(tokens, ROPE, device="cuda").to(dtype)
    slots = torch.arange(tokens, device="cuda", dtype=torch.int64)
    scale = torch.ones(1, device="cuda")
    torch.ops._C_cache_ops.concat_and_cache_mla  # noqa: B018 (vLLM's CUDA build only)

    def write():
        _custom_ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", scale)

    return write, "concat_and_cache_mla (vLLM)"


def _vllm_fa3():
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q, k, v = (torch.randn(64, HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)

    def fa3():
        flash_attn_varlen_func(q, k, v, 64, cu, 64, cu_seqlens_k=cu, causal=True, fa_version=3)

    return fa3, "flash_attn_varlen_func (FA3), 1 x 64 tokens"


LAYERS: dict[str, Callable[[], tuple[Callable[[], object], str]]] = {
    "aten": _aten,
    "cublas": _cublas,
    "triton": _triton,
    "triton-tma": _triton_tma,
    "mla-write": _mla_write,
    "mla-decode": _mla_decode,
    "mla-layer": _mla_layer,
    "vllm-write": _vllm_write,
    "vllm-fa3": _vllm_fa3,
}


if __name__ == "__main__":
    raise SystemExit(main())
