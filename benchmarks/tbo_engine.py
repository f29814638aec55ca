"""Two-batch overlap inside vLLM's engine on one GPU: split steps against unsplit ones.

A DeepSeek-V2-Lite-shaped MoE model (random weights, `ATOM_AITER_MLA`, Model Runner V2,
CUDA graphs) runs once with `tbo` off and once per TBO mode, each engine in its own
process; the engines start together and then measure one at a time
(`benchmarks.engine_case`'s wave). Measured per engine:

- a decode step at 32-256 requests (each request's own 64-token prompt, then
  `--decode-steps` steps at the full batch; the median step), which `tbo: decode`
  replays from a split graph of the bucket;
- a prefill step of 4K-16K new tokens (one request, one step; the median of
  `--repeats`), which `tbo: prefill` splits at the token midpoint.

The thresholds are set so every measured step of the mode splits, and the engine's
own counters (`atom_tbo_stats`) must show it did. One GPU has no all-to-all for a
micro-batch to hide, so the ratios are what the split costs; the engines' start-up
judgement lines, quoted in the report, say so.

    python -m benchmarks.tbo_engine --out tbo_engine.md --json tbo_engine.json
    python -m benchmarks.tbo_engine --case SPEC_JSON      # one engine (started by the above)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engine import case_env
from benchmarks.engine_shapes import write_shape

REPO = Path(__file__).resolve().parent.parent
MODES = ("off", "decode", "prefill", "all")
PROMPT_LEN = 64
THRESHOLDS = {"tbo_decode_min_requests": 32, "tbo_prefill_min_tokens": 4096}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tbo_engine", description=__doc__)
    p.add_argument("--cases", default="off,decode,prefill", help=f"TBO modes of {MODES}")
    p.add_argument(
        "--layers", type=int, default=8, help="decoder layers of the shape (27 in V2-Lite)"
    )
    p.add_argument("--decode-batches", default="32,64,128,256")
    p.add_argument("--prefill-tokens", default="4096,8192,16384")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-util", type=float, default=0.28)
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--out", help="markdown report")
    p.add_argument("--json", help="the results as JSON")
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p


def check_args(args) -> None:
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in MODES]
    if bad or not cases:
        raise SystemExit(f"--cases {args.cases!r}: choose from {', '.join(MODES)}")
    if args.layers < 2:
        raise SystemExit(f"--layers {args.layers}: at least 2 (one dense, one MoE layer)")
    batches, tokens = _ints(args.decode_batches), _ints(args.prefill_tokens)
    if not batches or min(batches) < THRESHOLDS["tbo_decode_min_requests"] or max(batches) > 256:
        raise SystemExit(f"--decode-batches {args.decode_batches}: within 32-256")
    if not tokens or min(tokens) < THRESHOLDS["tbo_prefill_min_tokens"] or max(tokens) > 16384:
        raise SystemExit(f"--prefill-tokens {args.prefill_tokens}: within 4096-16384")
    if args.decode_steps < 2 or args.repeats < 1:
        raise SystemExit("--decode-steps must be >= 2 and --repeats >= 1")
    args.cases, args.batches, args.tokens = cases, batches, tokens


def llm_kwargs(args, shape_dir: Path, mode: str) -> dict:
    kwargs = dict(
        model=str(shape_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=max(args.tokens) + PROMPT_LEN,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(max(args.tokens), max(args.batches) * PROMPT_LEN),
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
        gpu_memory_utilization=args.gpu_util,
        enable_prefix_caching=False,
        attention_config={"backend": "ATOM_AITER_MLA"},
    )
    if mode != "off":
        kwargs["additional_config"] = {"atom_plugin": {"tbo": mode, **THRESHOLDS}}
    return kwargs


# -- one engine ----------------------------------------------------------------------------
def _stats(llm, tbo: bool) -> dict:
    return llm.collective_rpc("atom_tbo_stats")[0] if tbo else {}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _run(llm, prompts: list[list[int]], max_tokens: int, tag: str) -> list[tuple[float, int]]:
    """Step the engine over `prompts`; each step's seconds and how many requests were still
    waiting for their first token when it began."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    engine = llm.llm_engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    waiting, steps = len(prompts), []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - start, waiting))
        waiting -= sum(1 for o in outputs if len(o.outputs[0].token_ids) == 1)
    return steps


def measure(llm, args, tbo: bool, rng: random.Random) -> dict:
    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(n)]

    decode, prefill = [], []
    for batch in args.batches:
        _run(llm, prompts(batch, PROMPT_LEN), 3, f"warm-d{batch}")  # records split graphs
        before = _stats(llm, tbo)
        steps = _run(llm, prompts(batch, PROMPT_LEN), args.decode_steps + 1, f"d{batch}")
        ms = [1e3 * s for s, waiting in steps if waiting == 0]
        stats = _delta(_stats(llm, tbo), before)
        decode.append({"batch": batch, "step_ms": statistics.median(ms), "steps": len(ms)})
        decode[-1]["tbo"] = stats
    for tokens in args.tokens:
        _run(llm, prompts(1, tokens), 1, f"warm-p{tokens}")
        before = _stats(llm, tbo)
        ms = [
            1e3 * _run(llm, prompts(1, tokens), 1, f"p{tokens}-{r}")[0][0]
            for r in range(args.repeats)
        ]
        stats = _delta(_stats(llm, tbo), before)
        prefill.append({"tokens": tokens, "step_ms": statistics.median(ms), "runs_ms": ms})
        prefill[-1]["tbo"] = stats
    return {"decode": decode, "prefill": prefill}


def run_case(spec: dict) -> dict:
    import torch

    from benchmarks.engine_case import start_in_wave

    mode = spec["mode"]
    result: dict = {"mode": mode}
    llm = start_in_wave(spec, mode, result)
    if llm is None:
        return result
    args = argparse.Namespace(**spec["args"])
    with open(spec["lock"], "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result.update(measure(llm, args, mode != "off", random.Random(0)))
    result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return result


# -- the driver ----------------------------------------------------------------------------
def run_all(args) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="tbo-engine-"))
    shape = write_shape("deepseek-v2-lite", work, args.layers)
    env = case_env("", None)  # the plugin on, this checkout first on the path
    procs = []
    for mode in args.cases:
        spec = {
            "mode": mode,
            "llm": llm_kwargs(args, shape, mode),
            "args": {
                "batches": args.batches,
                "tokens": args.tokens,
                "decode_steps": args.decode_steps,
                "repeats": args.repeats,
            },
            "ready_dir": str(work),
            "wave_size": len(args.cases),
            "wave_timeout_s": args.start_timeout,
            "lock": str(work / "measure.lock"),
            "out_json": str(work / f"{mode}.json"),
        }
        log = open(work / f"{mode}.log", "w")
        cmd = [sys.executable, "-m", "benchmarks.tbo_engine", "--case", json.dumps(spec)]
        procs.append(
            (mode, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))
        )
        print(
            f"# {time.strftime('%H:%M:%S')} started tbo={mode} (log {work / (mode + '.log')})",
            flush=True,
        )
    results = []
    for mode, proc in procs:
        proc.wait()
        path = work / f"{mode}.json"
        result = (
            json.loads(path.read_text())
            if path.exists()
            else {"mode": mode, "error": f"exit {proc.returncode}"}
        )
        result["judgement"] = [
            line.split("atom-plugin: ", 1)[1].strip()
            for line in (work / f"{mode}.log").read_text(errors="replace").splitlines()
            if "atom-plugin: two-batch overlap" in line or "atom-plugin: split decode" in line
        ]
        results.append(result)
        print(f"# {time.strftime('%H:%M:%S')} tbo={mode} exited {proc.returncode}", flush=True)
    return results


def report(results: list[dict], args) -> str:
    by_mode = {r["mode"]: r for r in results}
    off = by_mode.get("off", {})
    split_modes = [r for r in results if r["mode"] != "off"]
    lines = [
        f"DeepSeek-V2-Lite shape, {args.layers} layers, random weights, ATOM_AITER_MLA, "
        f"Model Runner V2 with CUDA graphs, {results[0].get('gpu', '?')}; "
        f"TBO thresholds {THRESHOLDS}.",
        "",
    ]
    for kind, key, label in (
        ("decode", "batch", "decode step"),
        ("prefill", "tokens", "prefill step"),
    ):
        head = ["| " + label + " | off ms |"] + [
            f" tbo {r['mode']} ms (x off) | splits |" for r in split_modes
        ]
        lines += ["".join(head), "|---" * (2 + 2 * len(split_modes)) + "|"]
        for i, point in enumerate(off.get(kind, [])):
            row = f"| {point[key]} | {point['step_ms']:.2f} |"
            for r in split_modes:
                p = r.get(kind, [])[i] if i < len(r.get(kind, [])) else None
                if p is None:
                    row += " - | - |"
                    continue
                t = p["tbo"]
                splits = f"{t.get(kind, 0)} split, {t.get('replayed', 0)} replayed"
                row += f" {p['step_ms']:.2f} ({p['step_ms'] / point['step_ms']:.2f}x) | {splits} |"
            lines.append(row)
        lines.append("")
    for r in results:
        start = (
            f"{r['startup_s']:.0f} s"
            if "startup_s" in r
            else f"failed: {r.get('error', '')[-300:]}"
        )
        lines.append(f"- tbo {r['mode']}: engine start {start}")
        lines += [f"  - `{line}`" for line in r.get("judgement", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        spec = json.loads(args.case)
        result = run_case(spec)
        Path(spec["out_json"]).write_text(json.dumps(result, indent=1))
        return 0 if "error" not in result else 1
    check_args(args)
    results = run_all(args)
    text = report(results, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
