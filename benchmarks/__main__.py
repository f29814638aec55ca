"""One entry point for the benchmarks: `python -m benchmarks NAME [ARGS...]` runs
benchmarks/NAME.py with ARGS, as `python -m benchmarks.NAME ARGS` would;
`python -m benchmarks NAME --help` gives that benchmark's own flags.

A benchmark joins the list with one line in BENCHMARKS: its module name and the question
it answers. The modules not listed are their helpers.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import textwrap

# module name under benchmarks/ -> the question it answers
BENCHMARKS = {
    "engine": "How fast is vLLM's engine with ATOM_AITER or ATOM_AITER_MLA beside vLLM's own "
    "attention backends on a model shape (output tok/s, TTFT, TPOT, decode step)?",
    "kernels_vs_vllm": "How fast are the plugin's attention kernels beside FA3, FlashMLA and "
    "vLLM's Triton kernel on the same inputs, and which targets are met?",
    "kernel_profile": "What limits a kernel where kernels_vs_vllm measured it slower "
    "(Nsight Compute, beside FA3 or FlashMLA)?",
    "attention": "How close do the MHA decode and prefill kernels come to the copy bandwidth "
    "and matmul rate measured in the same run?",
    "attention_mla": "How close does the MLA decode come to the physical limit at 16, 64 and "
    "128 heads, with bf16 and fp8 caches?",
    "compare_runs": "Did a change move the kernels' speed (two runs of attention or "
    "attention_mla, row by row)?",
    "mha_prefill_eager": "What does one eager MHA prefill call cost on the host and on the GPU, "
    "as vLLM runs a prefill's attention between its piecewise graphs?",
    "mla_eager_host": "What does one eager MLA layer call (a prefix hit's prefill rows at 16 "
    "heads) cost the host, decode and cache write, beside a plain op and vLLM's cache write?",
    "k3_logits": "What does the Kimi-K3 tool-call channel cost a step on the logits, beside "
    "xgrammar's bitmask?",
    "k3_serving": "Served end to end, how fast and how valid are Kimi-K3 tool calls held by the "
    "plugin's channel against vLLM's strict structural tag (tok/s, TTFT, TPOT, valid calls)?",
    "k3_admission": "How long do the other streams of a server stall while a request with a "
    "large tool schema is admitted, cold and warm?",
    "k3_compile": "What does compiling a new Kimi-K3 tool set cost the API server's event loop, "
    "per schema of k3_admission (standalone, no server)?",
    "k3_serving_model": "Builds the K3 serving model folder (DeepSeek-V3-shaped MLA, random "
    "weights, a synthetic K3 tokenizer of 163,840 ids) that the K3 benchmarks serve.",
    "tbo": "Does a decode step split into two micro-batches beat the unsplit step on one GPU, "
    "at a given share of communication?",
    "tbo_prefill": "From how many new tokens does a split prefill step pay?",
    "tbo_dp": "Two ranks over NCCL (or gloo): how long is a decode step with TBO on and off?",
    "tbo_trace": "In one TBO decode step, which kernels wait behind which (a kernel timeline)?",
    "graph_gaps": "In profiler traces of the engine, how long does the GPU idle between the "
    "kernels of each CUDA graph launch?",
    "graph_node_cost": "Does running one of the plugin's kernels make every later CUDA-graph "
    "node of its process slower (per-node time and idle gap, before and after)?",
    "graph_launch_cost": "How long does the host's CUDA-graph launch call take for graphs of "
    "the plugin's MLA kernels, node for node, beside torch, cuBLAS, Triton and vLLM kernels?",
    "host_pace": "Is a slow host a slow CPU or a slow moment (a fixed piece of Python pinned to "
    "each CPU in turn, round after round)?",
    "tbo_engine": "In vLLM's engine on one GPU, what does two-batch overlap cost or gain against "
    "off, for decode batches and long prefills (Model Runner V2)?",
}


def _listing() -> str:
    width = max(map(len, BENCHMARKS))
    indent = " " * (width + 4)
    return "benchmarks:\n" + "\n".join(
        textwrap.fill(
            question, 100, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent
        )
        for name, question in BENCHMARKS.items()
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run one benchmark; docs/benchmarks.md has the latest results of each.",
        epilog=_listing() + "\n\n`python -m benchmarks NAME --help` lists NAME's flags; "
        "benchmarks/README.md says what each needs (GPU, vLLM, ncu).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", metavar="NAME", help="the benchmark to run (listed below)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    ns = parser.parse_args(argv[:1])
    if ns.name not in BENCHMARKS:
        parser.error(f"unknown benchmark {ns.name!r}; choose from {', '.join(BENCHMARKS)}")
    sys.argv = [ns.name, *argv[1:]]  # argv[0] becomes the module's path while it runs
    runpy.run_module(f"benchmarks.{ns.name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
