"""Nsight Compute profiles of the plugin's kernels beside FA3 and FlashMLA on the shapes
where `benchmarks.kernels_vs_vllm` measured the plugin slower: what limits each.

Per shape, one `ncu` run of this module's driver (`--run SHAPE`), which builds the
problem with `benchmarks.kernel_problems` (the inputs and calls kernels_vs_vllm times),
runs the plugin's call and the anchor's (FlashMLA through vLLM's _flashmla_C, FA3 through
vllm.vllm_flash_attn) twice each as warm-up, checks their outputs agree, then runs each
once inside cudaProfilerStart/Stop (`ncu --profile-from-start off`): only those launches
are profiled. A one-cycle `spin_kernel` (torch.cuda._sleep) launched between the two
sides marks where the plugin's kernels end and the anchor's begin.

Sections: SpeedOfLight, Occupancy, LaunchStats, WarpStateStats, MemoryWorkloadAnalysis,
ComputeWorkloadAnalysis, plus the per-reason warp-stall ratios and tensor-pipe activity
where this ncu lists them (`--query-metrics`). Caches are flushed before each kernel
(ncu's default, as kernels_vs_vllm flushes L2); clocks are left as the GPU runs them
(`--clock-control none`, so durations compare with kernels_vs_vllm's; `base` locks them).

Saved under --out-dir per shape: SHAPE.ncu-rep (open it in ncu-ui), SHAPE.details.csv
(`--csv --page details`), SHAPE.raw.csv (`--csv --page raw`), SHAPE.log (ncu's and the
driver's output); and kernel_profile.md, the tables also printed to stdout: one per
shape, kernels as columns. Exit status: 0 every shape profiled, 1 some shape failed,
2 bad flags, no ncu, or no permission to read the GPU's counters.

    python -m benchmarks.kernel_profile --out-dir $OUT [--shapes NAME,...] [--ncu PATH]
        [--timeout 150] [--budget 400] [--clock-control none|base]
    python -m benchmarks.kernel_profile --list
    python -m benchmarks.kernel_profile --run SHAPE      # the driver ncu runs
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._report import progress
from benchmarks.ncu_tables import (
    STALL_RE,
    TENSOR_RE,
    assign_sides,
    markdown_table,
    merge_raw,
    parse_details,
)

REPO = Path(__file__).resolve().parents[1]
SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
)
FA3_DECODE_SPLITS = 32  # as kernel_cases.FA3_DECODE_SPLITS (vLLM's CUDA-graph cap)
NCU_FALLBACKS = (  # looked at when ncu is not on PATH (glob patterns)
    "/usr/local/cuda/bin/ncu",
    "/usr/local/cuda-*/bin/ncu",
    "/opt/nvidia/nsight-compute/*/ncu",
)


@dataclass(frozen=True)
class Problem:
    """One profiled shape: `kind` 'mla' (batch, context, heads, q_len, cache) or 'mha'
    (reqs as (query_len, seq_len) pairs, FA3 num_splits, seed, heads)."""

    name: str
    kind: str
    anchor: str
    what: str
    args: tuple


def _mla(name, batch, context, heads, q_len, cache="bf16") -> Problem:
    anchor = "FlashMLA" if cache == "bf16" else "FlashMLA (bf16 copy of the cache)"
    what = (
        f"MLA decode, {cache} cache, {heads} heads, {batch} requests x {context // 1024}K "
        f"context, {q_len} query token{'s' if q_len > 1 else ''}"
    )
    return Problem(name, "mla", anchor, what, (batch, context, heads, q_len, cache))


def _mha(name, reqs, heads: str = "32/8/128") -> Problem:
    q, kv, d = (int(x) for x in heads.split("/"))
    decode = reqs[0][0] == 1
    splits = FA3_DECODE_SPLITS if decode else 0
    n, (new, seq) = len(reqs), reqs[0]
    if decode:
        what = f"MHA decode, {n} request{'s' if n > 1 else ''} x {seq // 1024}K context"
    elif new == seq:
        what = f"MHA causal fresh prefill, {n} x {new // 1024}K tokens"
    else:
        what = f"MHA causal chunked prefill, {n} x {new} new tokens over {seq - new} cached"
    what += f", {q} q / {kv} kv heads, head {d}, bf16, block 16; FA3 num_splits={splits}"
    return Problem(name, "mha", "FA3", what, (tuple(reqs), splits, n * 7 + seq, (q, kv, d)))


SHAPES = {
    p.name: p
    for p in (
        _mla("mla-h128-32x8k", 32, 8192, 128, 1),
        _mla("mla-h128-128x4k", 128, 4096, 128, 1),
        _mla("mla-h64-q2-32x8k", 32, 8192, 64, 2),
        _mla("mla-h128-q2-32x8k", 32, 8192, 128, 2),
        _mla("mla-fp8-h128-32x8k", 32, 8192, 128, 1, "fp8"),
        _mla("mla-fp8-h64-32x8k", 32, 8192, 64, 1, "fp8"),
        _mla("mla-h16-q2-128x4k", 128, 4096, 16, 2),
        _mla("mla-fp8-h16-32x32k", 32, 32768, 16, 1, "fp8"),
        _mla("mla-h16-32x32k", 32, 32768, 16, 1),  # the fp8 shape's bf16 twin
        _mha("prefill-1x8k", [(8192, 8192)]),
        _mha("prefill-h64-1x8k", [(8192, 8192)], "32/8/64"),
        _mha("prefill-8x1k-over-7k", [(1024, 8192)] * 8),
        _mha("prefill-1x4k", [(4096, 4096)]),
        _mha("prefill-4x2k", [(2048, 2048)] * 4),
        _mha("mha-decode-8x16k", [(1, 16384)] * 8),
        _mha("mha-decode-128x16k", [(1, 16384)] * 128),
        _mha("mha-decode-1x1k", [(1, 1024)]),
        _mha("mha-decode-gqa8-256x4k", [(1, 4096)] * 256, "32/4/128"),
    )
}


class ProfileError(Exception):
    """A setup error that stops the whole run (exit 2), message in one line."""


class MetricError(RuntimeError):
    """ncu refused a metric name: worth one more try without the extra metrics."""


def check_shapes(names) -> list[str]:
    """The names, each a key of SHAPES, or ValueError listing the valid ones."""
    out = []
    for name in names:
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}; valid shapes: {', '.join(SHAPES)}")
        if name not in out:
            out.append(name)
    return out


# ---------------------------------------------------------------- driver (inside ncu)


def build_calls(problem: Problem):
    """(plugin call, anchor call) on the problem's inputs, each returning its output."""
    import torch

    from benchmarks import attention
    from benchmarks import kernel_problems as kp

    if problem.kind == "mla":
        batch, context, heads, q_len, cache = problem.args
        seed = batch * 131 + heads + q_len
        shape = kp.make_mla_shape(batch, context, heads, q_len, seed=seed, cache=cache)
        plugin = kp.plugin_mla_call(shape, shape.plan(), shape.new_out())
        return plugin, kp.flashmla_call(shape, kp.bf16_latents(shape))
    reqs, num_splits, seed, (hq, hkv, d) = problem.args
    heads = kp.Heads(hq, hkv, d)
    decode = [(len(reqs), reqs[0][1])] if reqs[0][0] == 1 else []
    prefill = [] if decode else [(len(reqs), reqs[0][1])]
    torch.manual_seed(1)
    pool = attention.KVPool(
        kp.mha_pool_tokens(decode, prefill), kp.MHA_BLOCK_SIZE, hkv=heads.kv, d=heads.d
    )
    torch.manual_seed(seed)
    meta = kp.mha_meta(pool, list(reqs), seed)
    q = kp.peaked_mha_query(meta.num_actual_tokens, heads=heads)
    plugin = kp.plugin_mha_call(pool, meta, q, torch.empty_like(q))
    return plugin, kp.fa3_call(pool, meta, q, num_splits)


def drive(name: str) -> int:
    """Warm up, check, then run each side once between cudaProfilerStart and Stop."""
    import torch

    from benchmarks.kernel_problems import OutputMismatch, assert_close

    problem = SHAPES[name]
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    progress(f"driver {name}: {problem.what}")
    plugin, anchor = build_calls(problem)
    got = plugin().clone()
    want = anchor().clone()
    plugin()
    anchor()
    torch.cuda.synchronize()
    try:
        diff = assert_close(got, want, f"plugin vs {problem.anchor}")
        progress(f"driver {name}: outputs agree (max abs diff {diff:.3g})")
    except OutputMismatch as exc:
        progress(f"driver {name}: WARNING outputs differ: {exc}")
    del got, want
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    plugin()
    torch.cuda._sleep(1)  # the marker kernel between the sides
    anchor()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    progress(f"driver {name}: profiled launches done")
    return 0


# ---------------------------------------------------------------- ncu


def find_ncu(explicit: str | None = None, path: str | None = None, fallbacks=None) -> str:
    """The ncu executable: `explicit` (--ncu), else ncu on PATH, else the fallbacks and
    $CUDA_HOME/bin/ncu. ProfileError names every place looked at."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise ProfileError(f"--ncu {explicit}: no executable file there")
    path = os.environ.get("PATH", "") if path is None else path
    found = shutil.which("ncu", path=path)
    if found:
        return found
    places = list(NCU_FALLBACKS if fallbacks is None else fallbacks)
    if os.environ.get("CUDA_HOME"):
        places.append(os.path.join(os.environ["CUDA_HOME"], "bin", "ncu"))
    for pattern in places:
        for place in sorted(glob.glob(pattern), reverse=True):  # the newest version first
            if os.path.isfile(place) and os.access(place, os.X_OK):
                return place
    dirs = [d for d in path.split(os.pathsep) if d]
    raise ProfileError(
        f"ncu (Nsight Compute) not found: not on PATH ({', '.join(dirs) or 'empty'}) "
        f"nor at {', '.join(places)}; pass --ncu /path/to/ncu"
    )


def permission_line(output: str) -> str | None:
    """ncu's own ERR_NVGPUCTRPERM line (its hint and link), if the output has one."""
    for line in output.splitlines():
        if "ERR_NVGPUCTRPERM" in line:
            text = line.strip()
            text = text.removeprefix("==ERROR==").strip()
            return f"no permission to read the GPU's performance counters: {text}"
    return None


def extra_metrics(ncu: str) -> list[str]:
    """Per-reason warp-stall ratios and tensor-pipe activity, where this ncu lists them
    (an unknown metric name would fail the whole run); [] if the query fails."""
    try:
        res = subprocess.run(
            [ncu, "--query-metrics"], capture_output=True, text=True, timeout=90, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        progress(f"ncu --query-metrics failed ({exc}); stall reasons from the sections only")
        return []
    names = set(re.findall(r"\b[a-z0-9]+__[a-z0-9_]+\b", res.stdout))
    stalls = sorted(n for n in names if STALL_RE.match(n + ".ratio"))
    tensor = sorted(n for n in names if TENSOR_RE.match(n + ".avg.pct_of_peak_sustained_active"))
    if res.returncode != 0 or not (stalls or tensor):
        tail = (res.stdout + res.stderr).strip().splitlines()[-1:] or ["no output"]
        progress(f"ncu --query-metrics: no extra metrics ({tail[0][:160]})")
    return [n + ".ratio" for n in stalls] + [
        n + ".avg.pct_of_peak_sustained_active" for n in tensor
    ]


def profile_command(ncu, name, report, metrics, clock_control) -> list[str]:
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", clock_control]
    for section in SECTIONS:
        cmd += ["--section", section]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    cmd += ["--export", str(report), "--force-overwrite"]
    return cmd + [sys.executable, "-m", "benchmarks.kernel_profile", "--run", name]


def run_bounded(cmd, timeout: float, log: Path) -> tuple[int | None, str]:
    """Run `cmd` in its own process group from the repo root, output to `log`; on timeout
    kill the whole group (ncu and the driver under it). (returncode or None, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, log.read_text(errors="replace")


def export_page(ncu: str, report: Path, page: str, dest: Path) -> str:
    """One page of the report as CSV, saved to `dest`; units unscaled where this ncu
    takes --print-units (the parser reads scaled units too)."""
    cmd = [ncu, "--import", str(report), "--csv", "--page", page]
    for units in (["--print-units", "base"], []):
        res = subprocess.run(cmd + units, capture_output=True, text=True, timeout=120, check=False)
        if res.returncode == 0:
            break
    if res.returncode != 0:
        raise RuntimeError(f"ncu --import --page {page}: {res.stderr.strip()[-300:]}")
    dest.write_text(res.stdout)
    return res.stdout


# ---------------------------------------------------------------- default mode


def profile_shape(ncu, name, out_dir: Path, metrics, timeout, clock_control) -> str:
    """Profile one shape; its markdown table. RuntimeError on failure, ProfileError when
    the counters are off limits (every later shape would fail the same way)."""
    problem = SHAPES[name]
    report, log = out_dir / f"{name}.ncu-rep", out_dir / f"{name}.log"
    report.unlink(missing_ok=True)
    cmd = profile_command(ncu, name, out_dir / name, metrics, clock_control)
    rc, output = run_bounded(cmd, timeout, log)
    perm = permission_line(output)
    if perm:
        raise ProfileError(perm)
    if rc is None:
        raise RuntimeError(f"timed out after {timeout:.0f} s (killed; see {log})")
    if rc != 0 or not report.exists():
        errors = [line for line in output.splitlines() if line.startswith("==ERROR==")]
        tail = " / ".join(errors[-3:] or output.strip().splitlines()[-4:])[-500:]
        state = "present" if report.exists() else "missing"
        kind = MetricError if any("metric" in e.lower() for e in errors) else RuntimeError
        raise kind(f"ncu exit {rc}, report {state} (see {log}): {tail}")
    details = export_page(ncu, report, "details", out_dir / f"{name}.details.csv")
    kernels = parse_details(details)
    try:
        merge_raw(kernels, export_page(ncu, report, "raw", out_dir / f"{name}.raw.csv"))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        progress(f"  raw page unavailable ({exc}); stall reasons from the sections only")
    check = re.search(r"driver \S+: (outputs agree.*|WARNING outputs differ.*)", output)
    kernels = assign_sides(kernels, problem.anchor)
    table = markdown_table(f"{problem.name}: {problem.what}", problem.anchor, kernels)
    return table + (f"Output check before profiling: {check.group(1)}\n" if check else "")


def profile_all(cfg) -> int:
    out_dir = Path(cfg.out_dir).resolve()  # the ncu runs start in the repo root
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        ncu = find_ncu(cfg.ncu)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress(f"ncu: {ncu}; shapes: {', '.join(cfg.shapes)}; out: {out_dir}")
    metrics = extra_metrics(ncu)
    progress(f"extra metrics: {len(metrics)} (warp-stall reasons, tensor pipes)")
    deadline = time.monotonic() + cfg.budget
    tables, failed = [], 0
    for i, name in enumerate(cfg.shapes, 1):
        left = deadline - time.monotonic()
        if left < 20:
            tables.append(f"### {name}\n\nSKIPPED: the --budget of {cfg.budget:.0f} s ran out.\n")
            progress(f"[{i}/{len(cfg.shapes)}] {name}: skipped, budget spent")
            failed += 1
            continue
        limit = min(cfg.timeout, left)
        progress(f"[{i}/{len(cfg.shapes)}] {name}: ncu (limit {limit:.0f} s)")
        t0 = time.monotonic()
        try:
            try:
                table = profile_shape(ncu, name, out_dir, metrics, limit, cfg.clock_control)
            except MetricError as exc:
                limit = min(cfg.timeout, deadline - time.monotonic())
                if not metrics or limit < 20:
                    raise
                progress(f"  failed with the extra metrics ({exc}); again without them")
                metrics = []  # and without them for the shapes after this one
                table = profile_shape(ncu, name, out_dir, [], limit, cfg.clock_control)
        except ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:
            failed += 1
            table = f"### {name}: {SHAPES[name].what}\n\nFAILED: {exc}\n"
            progress(f"  FAILED: {exc}")
        else:
            progress(f"  done in {time.monotonic() - t0:.0f} s")
        tables.append(table)
        print(table, flush=True)
    text = (
        "# Nsight Compute: plugin kernels vs FA3 / FlashMLA\n\n"
        f"Sections {', '.join(SECTIONS)}; one launch of each side after warm-up; caches "
        f"flushed per kernel; clock control {cfg.clock_control}. Stalls: cycles per issued "
        "instruction spent in each reason (of the total per issue).\n\n" + "\n".join(tables)
    )
    (out_dir / "kernel_profile.md").write_text(text)
    progress(f"wrote {out_dir / 'kernel_profile.md'}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_profile", description=__doc__.splitlines()[0]
    )
    p.add_argument("--run", metavar="SHAPE", help="driver mode (what ncu runs)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of shape names")
    p.add_argument("--out-dir", default="kernel_profile_out", help="reports, CSVs, logs")
    p.add_argument("--ncu", help="the ncu executable (default: ncu on PATH)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per shape")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for all shapes")
    p.add_argument("--clock-control", choices=("none", "base"), default="none")
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    try:
        if a.run is not None:
            check_shapes([a.run])
        a.shapes = check_shapes([s.strip() for s in a.shapes.split(",") if s.strip()])
        if not a.shapes:
            raise ValueError("--shapes: no shape named")
    except ValueError as exc:
        p.error(str(exc))
    return a


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.list:
        for p in SHAPES.values():
            print(f"{p.name}: {p.what}")
        return 0
    if cfg.run:
        return drive(cfg.run)
    return profile_all(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
