"""Does running one of the plugin's kernels make every later CUDA-graph node of its process
slower?

In vLLM's engine on an H100 (runs of 2026-12-05 and 2026-12-06), the GPU idled a median
0.448 us between consecutive kernels of every CUDA graph in the process that served
ATOM_AITER_MLA, against 0.06-0.10 us in the one that served FLASH_ATTN_MLA, also in
piecewise graphs that hold none of the plugin's kernels: something process-wide. This
benchmark looks for the trigger without vLLM. Each trigger runs in a process of its own:
it captures a chain of small kernels (a bf16 GEMM by cuBLAS and an in-place add,
`--pairs` times) in a CUDA graph, times its replays (CUDA events), runs the trigger, and
times again the graph captured before the trigger and one captured after it; last, the
median idle gap between the nodes of the later graph (torch profiler). A trigger that
slows graph nodes process-wide shows as a rise in both times.

The profile is taken once, last: on an H200 (2026-12-06) one torch-profiler session made
every later replay of its process slower, 2.31 to 2.50 us a node and a median gap of
0.127 to 0.288 us, whatever ran between (the `none` trigger alike), except where three
other processes had started CUDA contexts in between. So the `none` row is the control
for the gap column, and the times a node before and after come from CUDA events alone.

Triggers: `none`; `triton` (a plain Triton kernel of this file: any Triton launch);
`triton-tma` (one reading through a host-built TMA descriptor, as the plugin's decode
does); `triton-spill` (one whose registers spill to local memory: 4 KB a thread spilled when
compiled for sm_90 with Triton 3.8);
`mla-write` (the plugin's MLA cache write); `mla-packed` and `mla-gluon` (the MLA decode
on the plans vLLM's decode-2k steps and a prefix hit's 64 prefill rows got, 16 heads);
`mla-all` (the three); `vllm-import` (vLLM and its compiled ops loaded) and `vllm-fa3`
(one call of vLLM's FA3 kernel), where vLLM's CUDA build is installed, in case the
FLASH_ATTN_MLA process is the one that differs; `idle-contexts` (three other processes
hold an idle CUDA context, as the other engines of a benchmark wave do).

    python -m benchmarks graph_node_cost [--triggers none,mla-packed] [--pairs 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from benchmarks import kernel_calls

RESULT = "RESULT "

TRIGGERS = {
    "none": "nothing",
    "triton": "a plain Triton kernel",
    "triton-tma": "a Triton kernel reading through a host-built TMA descriptor",
    "triton-spill": "a Triton kernel whose registers spill to local memory",
    "mla-write": "the plugin's MLA cache write",
    "mla-packed": "the MLA decode, 64 x 2048 keys, 1 token each",
    "mla-gluon": "the MLA decode, 1 x 64 new tokens over 1024 cached",
    "mla-all": "the MLA cache write and both decodes",
    "vllm-import": "vLLM imported, its compiled ops loaded",
    "vllm-fa3": "one call of vLLM's FA3 kernel",
    "idle-contexts": "three other processes holding an idle CUDA context",
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triggers", default=",".join(TRIGGERS), help="comma list of triggers")
    p.add_argument("--pairs", type=int, default=128, help="GEMM + add pairs in the chain")
    p.add_argument("--replays", type=int, default=200, help="timed replays a measurement")
    p.add_argument("--one", metavar="TRIGGER", help=argparse.SUPPRESS)  # a child process
    args = p.parse_args(argv)
    triggers = [t for t in args.triggers.split(",") if t]
    unknown = [t for t in triggers if t not in TRIGGERS]
    if unknown or not triggers:
        p.error(f"--triggers {args.triggers!r}: unknown {unknown}; valid: {', '.join(TRIGGERS)}")
    if args.pairs < 1 or args.replays < 1:
        p.error(f"--pairs {args.pairs} --replays {args.replays}: both >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.one:
        print(RESULT + json.dumps(measure(args.one, args.pairs, args.replays)), flush=True)
        return 0
    print(f"# chain: {args.pairs} x (bf16 GEMM 64x1024x1024 + add), {args.replays} replays")
    print(
        "| trigger | what ran | us a node before | after, same graph | after, new graph "
        "| median gap us after |"
    )
    print("|---|---|---|---|---|---|")
    for trigger in triggers:
        print(_row(trigger, run_child(trigger, args.pairs, args.replays)), flush=True)
    return 0


def run_child(trigger: str, pairs: int, replays: int) -> dict:
    """One trigger in a fresh process (a trigger's effect must not reach the next)."""
    cmd = [sys.executable, "-m", "benchmarks.graph_node_cost", "--one", trigger]
    cmd += ["--pairs", str(pairs), "--replays", str(replays)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}"}


def _row(trigger: str, r: dict) -> str:
    if "error" in r:
        return f"| {trigger} | failed: {r['error']!r} | | | | |"
    b, a = r["before"], r["after"]
    return (
        f"| {trigger} | {r['ran']} | {b['us_per_node']:.3f} | {a['us_per_node_same']:.3f} "
        f"| {a['us_per_node']:.3f} | {a['median_gap_us']:.3f} |"
    )


def measure(trigger: str, pairs: int, replays: int) -> dict:
    """The chain's cost a node before and after `trigger` runs, and its median gap after."""
    first = Chain(pairs)
    before = {"us_per_node": first.us_per_node(replays)}
    ran, cleanup = run_trigger(trigger)
    try:
        second = Chain(pairs)
        after = {
            "us_per_node_same": first.us_per_node(replays),
            "us_per_node": second.us_per_node(replays),
            "median_gap_us": second.median_gap(),
        }
    finally:
        cleanup()
    return {"trigger": trigger, "ran": ran, "before": before, "after": after}


class Chain:
    """`pairs` small GEMMs, each followed by an in-place add, captured in one CUDA graph."""

    def __init__(self, pairs: int):
        self.nodes = 2 * pairs
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
        out = torch.empty_like(x)

        def pair():
            torch.mm(x, w, out=out)
            out.add_(1.0)

        self.graph = kernel_calls.capture(pair, pairs)

    def us_per_node(self, replays: int) -> float:
        for _ in range(5):
            self.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            self.graph.replay()
        end.record()
        end.synchronize()
        return 1e3 * start.elapsed_time(end) / (replays * self.nodes)

    def median_gap(self) -> float:
        """Median idle microseconds between consecutive nodes, from a profiler trace."""
        from benchmarks.graph_gaps import replay_gaps

        return replay_gaps(self.graph, 5)["median_gap_us"]


def run_trigger(trigger: str) -> tuple[str, object]:
    """Runs `trigger`; returns what ran (the plan a decode got) and a cleanup call."""
    if trigger == "idle-contexts":
        return _idle_contexts(3)
    ran = {
        "none": lambda: "nothing",
        "triton": lambda: _once(kernel_calls.triton_add()),
        "triton-tma": lambda: _once(kernel_calls.triton_tma()),
        "triton-spill": _triton_spill,
        "mla-write": lambda: _once(kernel_calls.mla_write()),
        "mla-packed": lambda: _once(_MLA_DECODES["packed"]()),
        "mla-gluon": lambda: _once(_MLA_DECODES["gluon"]()),
        "mla-all": lambda: "; ".join(
            _once(make())
            for make in (kernel_calls.mla_write, _MLA_DECODES["packed"], _MLA_DECODES["gluon"])
        ),
        "vllm-import": _vllm_import,
        "vllm-fa3": lambda: _once(kernel_calls.vllm_fa3()),
    }[trigger]()
    torch.cuda.synchronize()
    return ran, lambda: None


# the plans vLLM's decode-2k steps (64 x 2048 keys) and a prefix hit's 64 prefill rows
# (1 x 64 new tokens over 1024 cached) got at 16 heads
_MLA_DECODES = {
    "packed": lambda: kernel_calls.mla_decode(64, 2048, 1, kernel="packed"),
    "gluon": lambda: kernel_calls.mla_decode(1, 1088, 64, kernel="gluon"),
}


def _once(call: kernel_calls.Call) -> str:
    run, ran = call
    run()
    return ran


def _triton_spill() -> str:
    import triton
    import triton.language as tl

    @triton.jit
    def wide_sum(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
        # a [ROWS, COLS] fp32 tile held by one warp: far more values a thread than registers
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        x = tl.load(x_ptr + offs)  # every value stays live until the row sums are known
        tl.store(out_ptr + offs, x * tl.sum(x * x, axis=1)[:, None])

    x = torch.randn(128, 256, device="cuda")
    out = torch.empty_like(x)
    compiled = wide_sum[(1,)](x, out, ROWS=128, COLS=256, num_warps=1)
    local = getattr(compiled, "n_spills", "?")  # Triton's name for the local bytes a thread
    return f"wide_sum (Triton, {local} bytes of local memory a thread)"


def _vllm_import() -> str:
    import vllm
    from vllm import _custom_ops  # noqa: F401 (loads vLLM's compiled ops)

    return f"vLLM {vllm.__version__} imported"


def _idle_contexts(count: int) -> tuple[str, object]:
    code = (
        "import sys, torch; torch.ones(1, device='cuda'); torch.cuda.synchronize(); "
        "print('up', flush=True); sys.stdin.read()"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    for proc in procs:
        if proc.stdout.readline().strip() != "up":
            raise SystemExit("an idle-context process did not start")

    def stop():
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)

    return f"{count} idle processes with a CUDA context", stop


if __name__ == "__main__":
    raise SystemExit(main())
