"""Engine benchmark: vLLM's offline engine on real model shapes, every attention backend side
by side in one run, each in its own process (benchmarks/engine_case.py).

A case is `BACKEND[@VARIANT]`: `default` is vLLM's own choice; `@disabled` runs with
ATOM_PLUGIN_DISABLE=1 (vLLM as if the plugin were absent); `@old` runs the plugin sources
found under --old-plugin instead of this checkout's. Cases start in waves of --wave
processes; within a wave they measure one at a time. Weights are random
(`load_format="dummy"`), prompts are random token ids, outputs run to a fixed length.

    python -m benchmarks.engine --shape llama-3.1-8b \
        --cases FLASH_ATTN,FLASH_ATTN@disabled,TRITON_ATTN,ATOM_AITER --out-dir DIR
    python -m benchmarks.engine --report DIR [DIR ...]     # tables from saved results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.engine_shapes import MLA_SHAPES, WORKLOADS, parse_workloads, write_shape

REPO = Path(__file__).resolve().parent.parent
CASE_SCRIPT = REPO / "benchmarks" / "engine_case.py"
PLUGIN_BACKENDS = ("ATOM_AITER", "ATOM_AITER_MLA")
VARIANTS = ("", "disabled", "old")
GIB = 1 << 30


def parse_case(case: str) -> tuple[str, str]:
    backend, _, variant = case.partition("@")
    if variant not in VARIANTS:
        raise ValueError(
            f"case {case!r}: unknown variant {variant!r}; choose one of "
            f"{', '.join(repr('@' + v) for v in VARIANTS if v)}"
        )
    return backend, variant


def case_env(variant: str, old_plugin: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false"
    )
    env.pop("ATOM_PLUGIN_DISABLE", None)
    path = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    if variant == "disabled":
        env["ATOM_PLUGIN_DISABLE"] = "1"
    elif variant == "old":
        if old_plugin is None:
            raise ValueError("an @old case needs --old-plugin DIR (a folder holding atom_plugin/)")
        path.insert(0, str(old_plugin))
    env["PYTHONPATH"] = ":".join(path)
    return env


def llm_kwargs(args, shape_dir: Path, backend: str) -> dict:
    kwargs = dict(
        model=str(shape_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_gib * GIB),
        gpu_memory_utilization=args.gpu_util,
        enable_prefix_caching=False,
        enforce_eager=args.eager,
    )
    if backend != "default":
        kwargs["attention_config"] = {"backend": backend}
    if args.capture_sizes:
        kwargs["compilation_config"] = {
            "cudagraph_capture_sizes": [int(s) for s in args.capture_sizes.split(",")]
        }
    return kwargs


def run_wave(args, cases: list[str], shape_dir: Path, out_dir: Path, deadline: float) -> None:
    wave_dir = out_dir / f"wave-{int(time.time() * 1000)}"
    wave_dir.mkdir(parents=True)
    procs = []
    for case in cases:
        backend, variant = parse_case(case)
        slug = case.replace("@", "-")
        spec = {
            "case": case,
            "llm": llm_kwargs(args, shape_dir, backend),
            "workloads": [w.name for w in args.workloads],
            "repeats": args.repeats,
            "profile": args.profile_workloads if case in args.profile else [],
            "ready_dir": str(wave_dir),
            "wave_size": len(cases),
            "wave_timeout_s": args.start_timeout,
            "lock": str(out_dir / "measure.lock"),
            "out_json": str(out_dir / f"{slug}.json"),
        }
        log = open(out_dir / f"{slug}.log", "w")
        env = case_env(variant, args.old_plugin)
        cmd = [sys.executable, str(CASE_SCRIPT), json.dumps(spec)]
        procs.append((case, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        print(f"# {time.strftime('%H:%M:%S')} started {case}", flush=True)
    for case, proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            print(f"# {case}: killed at the deadline", flush=True)
        print(f"# {time.strftime('%H:%M:%S')} {case} exited {proc.returncode}", flush=True)


def load_results(dirs: list[Path]) -> list[dict]:
    results = []
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            data = json.loads(path.read_text())
            if "case" in data:
                results.append(data)
    return results


def _best_vllm(results: list[dict], workload: str) -> tuple[str, float] | None:
    best = None
    for r in results:
        backend, variant = parse_case(r["case"])
        if backend in PLUGIN_BACKENDS or variant:
            continue
        run = _run(r, workload)
        if run and (best is None or run["output_tok_s"] > best[1]):
            best = (r["case"], run["output_tok_s"])
    return best


def _run(result: dict, workload: str) -> dict | None:
    runs = [r for r in result.get("runs", []) if r["workload"] == workload]
    if not runs:
        return None
    best = max(runs, key=lambda r: r["output_tok_s"])  # repeats: the best pass
    return best


def report(results: list[dict]) -> str:
    """Markdown: per workload, output tok/s of every case and each one's ratio to the best
    vLLM backend (plugin backends and variants excluded from "best")."""
    if not results:
        return "no results\n"
    cases = [r["case"] for r in results]
    lines = ["| workload | " + " | ".join(cases) + " | best vLLM backend |"]
    lines.append("|---" * (len(cases) + 2) + "|")
    for name in WORKLOADS:
        if not any(_run(r, name) for r in results):
            continue
        best = _best_vllm(results, name)
        cells = []
        for r in results:
            run = _run(r, name)
            if run is None:
                cells.append("-")
                continue
            ratio = f" ({run['output_tok_s'] / best[1]:.2f}x)" if best else ""
            cells.append(f"{run['output_tok_s']:,.0f}{ratio}")
        best_cell = f"{best[0]}" if best else "-"
        lines.append(f"| {name} output tok/s | " + " | ".join(cells) + f" | {best_cell} |")
    for metric, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms")):
        for name in ("lat-1", "lat-8", "long-16k"):
            vals = [_run(r, name) for r in results]
            if any(vals):
                cells = [f"{v[metric]:.2f}" if v and v.get(metric) else "-" for v in vals]
                lines.append(f"| {name} {label} | " + " | ".join(cells) + " | |")
    for name in ("thr-512", "mixed-4k"):
        vals = [_run(r, name) for r in results]
        if any(vals):
            cells = [
                f"{v['decode_step_ms']:.2f}" if v and v["decode_step_ms"] else "-" for v in vals
            ]
            lines.append(f"| {name} decode step ms (median) | " + " | ".join(cells) + " | |")
            cells = [f"{v['prefill_phase_s']:.2f}" if v else "-" for v in vals]
            lines.append(f"| {name} prefill-phase s | " + " | ".join(cells) + " | |")
    cold = [r.get("cold") for r in results]
    if any(cold):
        cells = [f"{c['output_tok_s']:,.0f}" if c else "-" for c in cold]
        lines.append("| first pass (cold) output tok/s | " + " | ".join(cells) + " | |")
    physical = [r.get("physical") for r in results]
    if any(physical):
        cells = [
            f"{p['copy_gbps']:,.0f} / {p['matmul_tflops']:.0f}" if p else "-" for p in physical
        ]
        lines.append(
            "| copy GB/s / bf16 matmul TFLOP/s (same process) | " + " | ".join(cells) + " | |"
        )
    cells = [f"{r['startup_s']:.0f}" if "startup_s" in r else "failed" for r in results]
    lines.append("| engine start s | " + " | ".join(cells) + " | |")
    cells = [
        f"{'/'.join(r['engine']['attention_backends'])}, {r['engine']['cudagraph_mode']}, "
        f"block {r['engine']['block_size']}"
        if "engine" in r
        else "-"
        for r in results
    ]
    lines.append("| ran | " + " | ".join(cells) + " | |")
    out = "\n".join(lines) + "\n"
    for r in results:
        if "error" in r:
            out += f"\n{r['case']} failed:\n```\n{r['error'][-1500:]}\n```\n"
        for prof in r.get("profiles") or ([r["profile"]] if "profile" in r else []):
            out += profile_report(r["case"], prof)
    return out


def profile_report(case: str, prof: dict) -> str:
    lines = [
        f"\n**{case}, profiled {prof['workload']}**: wall {prof['wall_s_profiled']:.2f} s over "
        f"{prof['steps']} steps, GPU busy {prof['gpu_busy_s']:.2f} s "
        f"({100 * prof['gpu_busy_fraction']:.0f}%), {prof['kernel_launches']:,} kernels, "
        f"attention kernels {prof['attention_kernel_s'] * 1e3:.0f} ms",
        "",
        "| kernel | calls | total ms | mean us |",
        "|---|---|---|---|",
    ]
    for k in prof["top_kernels"]:
        lines.append(f"| `{k['name']}` | {k['calls']} | {k['total_ms']:.1f} | {k['mean_us']:.1f} |")
    for name, h in prof["host"].items():
        lines.append(f"| host `{name}` | {h['calls']} | {h['total_ms']:.1f} | {h['mean_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", type=Path, help="print tables from saved result folders")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--cases", default="FLASH_ATTN,ATOM_AITER")
    p.add_argument("--workloads", default="thr-512,thr-1k,lat-1,lat-8,long-16k,mixed-4k")
    p.add_argument("--wave", type=int, default=3, help="cases started together")
    p.add_argument("--repeats", type=int, default=2, help="passes of the first workload")
    p.add_argument("--profile", default="", help="cases profiled once more (torch profiler)")
    p.add_argument(
        "--profile-workloads", default="", help="the workloads profiled (default: the first)"
    )
    p.add_argument("--old-plugin", type=Path, help="folder holding the atom_plugin of @old cases")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--kv-gib", type=float, default=20.0, help="KV cache per engine, GiB")
    p.add_argument("--gpu-util", type=float, default=0.28, help="start-up free-memory check")
    p.add_argument("--capture-sizes", default="", help="CUDA-graph sizes (default: vLLM's)")
    p.add_argument("--eager", action="store_true", help="enforce_eager (no graphs, no compile)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=560.0, help="kill cases still running")
    p.add_argument("--out-dir", type=Path, default=Path("engine-out"))
    args = p.parse_args(argv)
    if args.report:
        print(report(load_results(args.report)), end="")
        return 0
    args.workloads = parse_workloads(args.workloads)
    profiled = parse_workloads(args.profile_workloads) if args.profile_workloads else []
    args.profile_workloads = [w.name for w in profiled or args.workloads[:1]]
    args.profile = {c for c in args.profile.split(",") if c}
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        backend, _ = parse_case(c)
        if backend == "ATOM_AITER_MLA" and args.shape not in MLA_SHAPES:
            raise SystemExit(f"case {c}: shape {args.shape} has no MLA layers")
    deadline = time.monotonic() + args.deadline_s
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shape_dir = write_shape(args.shape, args.out_dir / "shapes")
    print(f"# {datetime.date.today()} shape {args.shape}, cases {cases}", flush=True)
    for i in range(0, len(cases), args.wave):
        if time.monotonic() > deadline - 60:
            print(f"# skipped (deadline): {cases[i:]}", flush=True)
            break
        run_wave(args, cases[i : i + args.wave], shape_dir, args.out_dir, deadline)
    print(report(load_results([args.out_dir])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
