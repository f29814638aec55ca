"""Engine benchmark: vLLM's offline engine on real model shapes, every attention backend side
by side in one run, each in its own process (benchmarks/engine_case.py).

A case is `BACKEND[@VARIANT]`: `default` is vLLM's own choice; `@disabled` runs with
ATOM_PLUGIN_DISABLE=1 (vLLM as if the plugin were absent); `@old` runs the plugin sources
found under --old-plugin instead of this checkout's; `@fp8` runs with an fp8 KV cache
(its ratios are against the best vLLM backend's `@fp8` case). Cases start in waves of
--wave processes; within a wave they measure one pass at a time, in rounds whose order
rotates (benchmarks/engine_turns.py; the table's "turn in each round"). --repeats N runs
N rounds over every workload; the table shows each row's median pass, the slowest and
fastest pass beside it, and every pass's decode step in the order the passes ran. Weights
are random (`load_format="dummy"`), prompts are random token ids, outputs run to a fixed
length.

--prefix-caching turns vLLM's prefix cache on; --again then times each workload a second
time on the same prompts (cache hits), reported in a row of its own ("again"). --probe
records each model step's host and GPU time, syncs and decode plan
(benchmarks/engine_probe.py); --profile CASES with --profile-workloads
`NAME[@again][:decode|:prefill]` profiles a few decode or prefill steps of a pass.

By default each engine's core runs in its measuring process, so the profiler sees the
worker and each `step()` is one model step; that thread then also turns every step's
outputs into request outputs. --engine-process runs the core in a process of its own, as
`vllm serve` and vLLM's `LLM` do by default, with the output handling beside it; the
probe reaches the worker by RPC there, the profiler does not.

    python -m benchmarks.engine --shape llama-3.1-8b \
        --cases FLASH_ATTN,FLASH_ATTN@disabled,TRITON_ATTN,ATOM_AITER --out-dir DIR
    python -m benchmarks.engine --shape deepseek-v3-tp8 --prefix-caching --again --probe \
        --cases ATOM_AITER_MLA,FLASH_ATTN_MLA,FLASHMLA,TRITON_MLA,ATOM_AITER_MLA@fp8,FLASHMLA@fp8 \
        --workloads lat-1,lat-8,decode-2k,shared-8k --out-dir DIR
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

from benchmarks import gpu_clocks, host_load, host_pace
from benchmarks.engine_probe import parse_profile_entry
from benchmarks.engine_profiles import kernel_differences, profile_report
from benchmarks.engine_shapes import MLA_SHAPES, WORKLOADS, parse_workloads, write_shape

REPO = Path(__file__).resolve().parent.parent
CASE_SCRIPT = REPO / "benchmarks" / "engine_case.py"
PLUGIN_BACKENDS = ("ATOM_AITER", "ATOM_AITER_MLA")
VARIANTS = ("", "disabled", "old", "fp8")
KV_VARIANTS = ("fp8",)  # variants that change the measured engine, compared among themselves
GIB = 1 << 30


def parse_case(case: str) -> tuple[str, str]:
    backend, _, variant = case.partition("@")
    if variant not in VARIANTS:
        raise ValueError(
            f"case {case!r}: unknown variant {variant!r}; choose one of "
            f"{', '.join(repr('@' + v) for v in VARIANTS if v)}"
        )
    return backend, variant


def case_env(variant: str, old_plugin: Path | None, engine_process: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if engine_process else "0",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if engine_process:
        # the case's collective_rpc calls hand the engine's process functions of this
        # repository (worker facts, the probe), which vLLM sends pickled only when told
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # Every pass samples greedily, which never reaches the top-k/top-p sampler; FlashInfer's
    # JIT build of it took 97 s of each engine's start on a fresh H200 (2026-12-06).
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
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


def llm_kwargs(args, shape_dir: Path, backend: str, variant: str = "") -> dict:
    kwargs = dict(
        model=str(shape_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_gib * GIB),
        gpu_memory_utilization=args.gpu_util,
        enable_prefix_caching=args.prefix_caching,
        enforce_eager=args.eager,
    )
    if variant == "fp8":
        kwargs["kv_cache_dtype"] = "fp8"
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
            "llm": llm_kwargs(args, shape_dir, backend, variant),
            "workloads": [w.name for w in args.workloads],
            "repeats": args.repeats,
            "again": args.again,
            "probe": args.probe,
            "profile": args.profile_workloads if case in args.profile else [],
            "trace_dir": str(out_dir),
            "ready_dir": str(wave_dir),
            "wave_size": len(cases),
            "wave_cases": cases,
            "wave_timeout_s": args.start_timeout,
            "measure_timeout_s": max(1.0, deadline - time.monotonic()),
            "out_json": str(out_dir / f"{slug}.json"),
            "cpus": args.cpus,
        }
        log = open(out_dir / f"{slug}.log", "w")
        env = case_env(variant, args.old_plugin, args.engine_process)
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


def _kind(case: str) -> str:
    """The cases a case is compared with: its KV variant's ('' for the model dtype)."""
    _, variant = parse_case(case)
    return variant if variant in KV_VARIANTS else ""


def _best_vllm(results: list[dict], label: str, kind: str = "") -> tuple[str, float] | None:
    """The fastest vLLM backend of this KV kind on a row (plugin backends, @disabled and
    @old cases never count)."""
    best = None
    for r in results:
        backend, variant = parse_case(r["case"])
        if backend in PLUGIN_BACKENDS or variant != kind:  # kind: "" or a KV variant
            continue
        run = _run(r, label)
        if run and (best is None or run["output_tok_s"] > best[1]):
            best = (r["case"], run["output_tok_s"])
    return best


def _label(run: dict) -> str:
    return run["workload"] + (" again" if run.get("pass") == "again" else "")


def _row_runs(result: dict, label: str) -> list[dict]:
    """A case's passes of one row, in the order they ran."""
    return [r for r in result.get("runs", []) if _label(r) == label]


def _passes(result: dict, label: str) -> list[dict]:
    """A case's passes of one row, slowest first."""
    return sorted(_row_runs(result, label), key=lambda r: r["output_tok_s"])


def _run(result: dict, label: str) -> dict | None:
    """The row's median pass (the lower of the two middle ones of an even count): with
    several rounds, one slow or fast spell of the host moves no figure of the table."""
    runs = _passes(result, label)
    return runs[(len(runs) - 1) // 2] if runs else None


def _spread(results: list[dict], name: str) -> str | None:
    """A row of each case's slowest and fastest pass, where some case has several."""
    passes = [_passes(r, name) for r in results]
    if max(map(len, passes)) < 2:
        return None
    cells = [
        f"{p[0]['output_tok_s']:,.0f}-{p[-1]['output_tok_s']:,.0f} ({len(p)})" if p else "-"
        for p in passes
    ]
    return f"| {name} output tok/s, slowest-fastest pass (passes) | " + " | ".join(cells) + " | |"


def _each_pass(results: list[dict], name: str, what: str, value) -> str | None:
    """A row of `value(run)` for each case's every pass, in the order the passes ran
    (round by round), where some case has several: a spread that moves every backend
    alike is the machine's, one that follows a case is its own."""
    passes = [_row_runs(result, name) for result in results]
    if max(map(len, passes)) < 2:
        return None
    cells = [", ".join(map(value, p)) or "-" for p in passes]
    return f"| {name} {what}, each pass in turn | " + " | ".join(cells) + " | |"


def _step_ms(run: dict) -> str:
    return f"{run['decode_step_ms']:.2f}" if run.get("decode_step_ms") else "-"


def _host_pace(run: dict) -> str:
    return host_load.pace_cell(run.get("host"))


def _labels(results: list[dict]) -> list[str]:
    """Every measured row, in workload order, each workload's "again" row after it."""
    seen = {_label(run) for r in results for run in r.get("runs", [])}
    order = [n for name in WORKLOADS for n in (name, f"{name} again")]
    return [n for n in order if n in seen]


def report(results: list[dict]) -> str:
    """Markdown: per workload (and pass), output tok/s of every case and each one's ratio
    to the best vLLM backend of its KV kind (plugin backends and @disabled/@old cases
    excluded from "best")."""
    if not results:
        return "no results\n"
    cases = [r["case"] for r in results]
    labels = _labels(results)
    lines = ["| workload | " + " | ".join(cases) + " | best vLLM backend |"]
    lines.append("|---" * (len(cases) + 2) + "|")
    kinds = sorted({_kind(c) for c in cases})
    for name in labels:
        bests = {k: _best_vllm(results, name, k) for k in kinds}
        cells = []
        for r in results:
            run = _run(r, name)
            if run is None:
                cells.append("-")
                continue
            best = bests[_kind(r["case"])]
            ratio = f" ({run['output_tok_s'] / best[1]:.2f}x)" if best else ""
            cells.append(f"{run['output_tok_s']:,.0f}{ratio}")
        best_cell = ", ".join(b[0] for b in bests.values() if b) or "-"
        lines.append(f"| {name} output tok/s | " + " | ".join(cells) + f" | {best_cell} |")
        spread = _spread(results, name)
        if spread:
            lines.append(spread)
    for metric, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms")):
        for name in labels:
            vals = [_run(r, name) for r in results]
            if any(v and v.get(metric) for v in vals):
                cells = [f"{v[metric]:.2f}" if v and v.get(metric) else "-" for v in vals]
                lines.append(f"| {name} {label} | " + " | ".join(cells) + " | |")
    for name in labels:
        vals = [_run(r, name) for r in results]
        cells = [f"{v['decode_step_ms']:.2f}" if v and v["decode_step_ms"] else "-" for v in vals]
        lines.append(f"| {name} decode step ms (median) | " + " | ".join(cells) + " | |")
        each = _each_pass(results, name, "decode step ms", _step_ms)
        if each:
            lines.append(each)
        row_runs = [run for r in results for run in _row_runs(r, name)]
        if any((run.get("host") or {}).get("pace_us") for run in row_runs):
            pace = _each_pass(
                results, name, "host's fixed Python work us (start/end, @CPU it ran on)", _host_pace
            )
            if pace:
                lines.append(pace)
        cells = [f"{v['prefill_phase_s']:.2f}" if v else "-" for v in vals]
        lines.append(f"| {name} prefill-phase s | " + " | ".join(cells) + " | |")
        if any(v and v.get("clocks") for v in vals):
            cells = [gpu_clocks.cell(v.get("clocks")) if v else "-" for v in vals]
            lines.append(f"| {name} SM clock MHz (median / lowest) | " + " | ".join(cells) + " | |")
        if any(v and v.get("host") for v in vals):
            cells = [host_load.cell(v.get("host")) if v else "-" for v in vals]
            lines.append(
                f"| {name} host busy cores (this engine's) of all | " + " | ".join(cells) + " | |"
            )
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
    if any(r.get("host_cpu") for r in results):
        cells = [r.get("host_cpu") or "-" for r in results]
        lines.append("| host CPU | " + " | ".join(cells) + " | |")
    cells = [f"{r['startup_s']:.0f}" if "startup_s" in r else "failed" for r in results]
    lines.append("| engine start s | " + " | ".join(cells) + " | |")
    cells = [",".join(map(str, r["turns"])) if r.get("turns") else "-" for r in results]
    lines.append("| turn in each round | " + " | ".join(cells) + " | |")
    cells = [
        f"{'/'.join(r['engine']['attention_backends'])}, {r['engine']['cudagraph_mode']}, "
        f"block {r['engine']['block_size']}, vLLM {r['engine'].get('versions', {}).get('vllm')}"
        f"{_core_process(r)}{_pinned(r)}"
        if "engine" in r
        else "-"
        for r in results
    ]
    lines.append("| ran | " + " | ".join(cells) + " | |")
    out = "\n".join(lines) + "\n"
    out += probe_report(results, labels)
    for r in results:
        if "error" in r:
            out += f"\n{r['case']} failed:\n```\n{r['error'][-1500:]}\n```\n"
        for prof in r.get("profiles", []):
            out += profile_report(r["case"], prof)
    out += kernel_differences(
        results, {r["case"] for r in results if parse_case(r["case"])[0] in PLUGIN_BACKENDS}
    )
    return out


PROBE_ROWS = (
    ("steps", "{:d}"),
    ("host_ms", "{:.3f}"),
    ("gpu_ms", "{:.3f}"),
    ("gpu_between_ms", "{:.3f}"),
    ("build_us", "{:.0f}"),
    ("host_bound_steps", "{:d}"),
    ("syncs_exec", "{:d}"),
    ("syncs_build", "{:d}"),
    ("syncs_sample", "{:d}"),
)


def probe_report(results: list[dict], labels: list[str]) -> str:
    """The step probe's figures (benchmarks/engine_probe.py) per row and step kind:
    medians of host time (execute_model + sample_tokens) and GPU time a step, the GPU
    time from the step before's end to the step's start (`gpu_between_ms`), the
    metadata builders' host time a step, host-bound steps, syncs, tokens on the decode
    path, and the plugin's decode plans (the step's, and its CUDA graph's capture)."""
    lines = []
    for name in labels:
        for kind in ("decode", "prefill"):
            probes = [((_run(r, name) or {}).get("probe") or {}).get(kind) for r in results]
            if not any(probes):
                continue
            for key, fmt in PROBE_ROWS:
                cells = [
                    fmt.format(p[key]) if p and p.get(key) is not None else "-" for p in probes
                ]
                lines.append(f"| {name} {kind} {key} | " + " | ".join(cells) + " |")
            cells = [f"{p['decode_path_tokens']}/{p['tokens']}" if p else "-" for p in probes]
            lines.append(f"| {name} {kind} tokens on the decode path | " + " | ".join(cells) + " |")
            cells = [
                "; ".join(f"{k} x{n}" for k, n in p["plans"].items()) if p and p["plans"] else "-"
                for p in probes
            ]
            lines.append(f"| {name} {kind} plans | " + " | ".join(cells) + " |")
            cells = [
                "; ".join(f"{k} x{n}" for k, n in p["graph_plans"].items())
                if p and p.get("graph_plans")
                else "-"
                for p in probes
            ]
            lines.append(f"| {name} {kind} graph plans | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    cases = [r["case"] for r in results]
    head = ["", "**Step probe** (medians a model step)", "", "| row | " + " | ".join(cases) + " |"]
    head.append("|---" * (len(cases) + 1) + "|")
    return "\n".join(head + lines) + "\n"


def _pinned(result: dict) -> str:
    """The CPUs the case was pinned to (`--cpus`), empty where it was not."""
    cpus = result.get("spec", {}).get("cpus")
    return f", CPUs {host_pace.cpu_ranges(cpus)}" if cpus else ""


def _core_process(result: dict) -> str:
    """Where the case's engine core ran, from the worker's process id against the
    measuring one (empty for results that recorded neither)."""
    worker, measuring = result["engine"].get("pid"), result.get("measuring_pid")
    if worker is None or measuring is None:
        return ""
    return ", core in process" if worker == measuring else ", core in its own process"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", nargs="+", type=Path, help="print tables from saved result folders")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--cases", default="FLASH_ATTN,ATOM_AITER")
    p.add_argument("--workloads", default="thr-512,thr-1k,lat-1,lat-8,long-16k,mixed-4k")
    p.add_argument("--wave", type=int, default=3, help="cases started together")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of passes over every workload (the table: each row's median pass)",
    )
    p.add_argument("--profile", default="", help="cases profiled once more (torch profiler)")
    p.add_argument(
        "--profile-workloads",
        default="",
        help="NAME[@again][:decode|:prefill],... profiled (default: the first workload's decode)",
    )
    p.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix cache on")
    p.add_argument(
        "--again", action="store_true", help="each workload once more on the same prompts"
    )
    p.add_argument("--probe", action="store_true", help="host/GPU time, syncs, plans a step")
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="each engine's core in a process of its own (vLLM's default), not the measuring one",
    )
    p.add_argument(
        "--cpus",
        help="CPUs every case (its engine and the engine core's process) may run on, e.g. "
        "0-3; `python -m benchmarks host_pace` tells whether some CPUs are slow",
    )
    p.add_argument("--layers", type=int, help="the shape's layer count (default: its own)")
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
    entries = [e.strip() for e in args.profile_workloads.split(",") if e.strip()]
    for entry in entries:
        parse_workloads(parse_profile_entry(entry)[0])  # names the bad workload
    args.profile_workloads = entries or [args.workloads[0].name]
    args.profile = {c for c in args.profile.split(",") if c}
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: at least 1 round of passes")
    if args.again and not args.prefix_caching:
        raise SystemExit("--again times cache hits: it needs --prefix-caching")
    if args.cpus:
        try:
            args.cpus = host_pace.parse_cpus(args.cpus)
        except ValueError as e:
            raise SystemExit(f"--cpus: {e}") from None
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        backend, _ = parse_case(c)
        if backend == "ATOM_AITER_MLA" and args.shape not in MLA_SHAPES:
            raise SystemExit(f"case {c}: shape {args.shape} has no MLA layers")
    if args.engine_process and args.profile:
        raise SystemExit(
            "--profile runs torch's profiler in the measuring process, and with "
            "--engine-process the engine core runs in another: drop one of them"
        )
    unknown = sorted(args.profile - set(cases))
    if unknown:
        raise SystemExit(f"--profile names {unknown}, not among the cases {cases}")
    deadline = time.monotonic() + args.deadline_s
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shape_dir = write_shape(args.shape, args.out_dir / "shapes", args.layers)
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
