"""Kimi-K3 tool calls served end to end: the plugin's channel against vLLM's kimi_k3 tag.

Each configuration is one `vllm serve` (one engine start), and every concurrency runs
against it:
- `atom:LEVEL`: `--tool-call-parser atom_kimi_k3 --tool-strict-level LEVEL`, the plugin
  on: its channel holds required, named and auto requests whose schemas it supports
  (all of these), compiled in the API server once per tool set. The strict level does
  not change what the channel holds.
- `vllm:LEVEL`: `--tool-call-parser kimi_k3 --tool-strict-level LEVEL` with
  ATOM_PLUGIN_DISABLE=1: vLLM's xgrammar structural tag (VLLM_ENFORCE_STRICT_TOOL_CALLING
  on, vLLM's default); `function` holds the call envelope, `parameter` pins the arguments
  to the schemas too.

The model is `benchmarks.k3_serving_model` (`--shape`, default DeepSeek-V3's MLA
attention on four dense layers, `--load-format dummy`: random weights) with the
synthetic K3 tokenizer of 163,840 ids. At each concurrency C the benchmark sends C chat
requests at once (at concurrency 1, `--rounds` of them one after another), streamed
with usage on every chunk, cycling through the mix a tool-calling agent sends over
`TOOLS` (four tools, arguments of nested objects, arrays, enums, booleans, integers
and strings): `tool_choice="required"`, a named tool, and `"auto"`. The strict level
changes nothing the channel holds, so one `atom` configuration stands for both levels
when GPU time is short.

How the content is forced. Random weights give near-uniform logits, so each request
carries a `logit_bias` and is sampled at temperature 1: +30 on the tokens of the turn's
way into the tools channel (required and named: `<|close|>`, `response`, `<|sep|>`,
whose sequence ends the response channel; auto: `<|open|>`, `tools`, `<|sep|>`, which
open the tools channel, and `<|close|>`), +20 on the quote `"`. Where the constraint
allows them, these dominate: the response soon holds the sequence that leads into the
tools channel, a call index ends after one digit, strings and numbers end on
`<|close|>`, optional keys are mostly skipped, one call is made. Where the constraint
masks them, the model's near-uniform choice among the allowed ids decides (tool names,
enum values, digits). Every nested value in `TOOLS` is finite (enums, booleans), so a
call ends under either constraint. The same bias goes to every configuration; the
channel leaves the response free until the model writes that sequence itself, while
vLLM's tag ends the response at its first `<|close|>`, so responses are longer under
the channel; xgrammar lets the model spell the tag's fixed texts and enum values in any
tokenization (with near-uniform logits, often a character a token), so its calls are
longer under the tag. `--max-tokens` must leave room for both.

Per configuration and concurrency: output tokens per second (all requests' output
tokens over the wall time of the wave); TPOT and TTFT as the engine measured them
(vLLM's `/metrics` histograms over the wave: mean, and the p50 and p90 buckets' upper
bounds; they start when the request reaches the engine, after the API server's work);
the time to the first streamed chunk with output as the client saw it (schema compile
in the API server included; a tool parser may hold text back, so it also depends on the
parser); calls made and the share that parse and validate (`jsonschema`) against their
tool's schema (named: the named tool); required and named requests answered without a
call (plain text); auto requests with a call; errors.

    python -m benchmarks.k3_serving --configs atom:parameter,vllm:function,vllm:parameter \
        --out k3_serving.md                                     # the GPU run (about 5 min)
    python -m benchmarks.k3_serving --smoke --out smoke.md     # vLLM's CPU build, toy scale
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._report import versions
from benchmarks.k3_client import (
    Streamed,
    histogram,
    parsed_arguments,
    scrape,
    serve_env,
    stream_chat,
)
from benchmarks.k3_serving_model import K3_VOCAB, SHAPES, build_k3_model

CONFIGS = ("atom:function", "atom:parameter", "vllm:function", "vllm:parameter")
CHOICES = ("required", "named", "auto")
TRIGGER_BIAS, QUOTE_BIAS = 30, 20


def _enum(*values) -> dict:
    return {"type": "string", "enum": list(values)}


CITIES = _enum("Paris", "Tokyo", "Lima", "Oslo", "Cairo")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": _enum("celsius", "fahrenheit"),
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_flight",
            "description": "Book a flight",
            "parameters": {
                "type": "object",
                "properties": {
                    "passenger": {
                        "type": "object",
                        "properties": {
                            "title": _enum("mr", "ms", "dr"),
                            "seat": _enum("aisle", "window", "middle"),
                            "vip": {"type": "boolean"},
                        },
                        "required": ["seat"],
                    },
                    "legs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"from": CITIES, "to": CITIES},
                            "required": ["from", "to"],
                        },
                    },
                    "cabin": _enum("economy", "business", "first"),
                },
                "required": ["passenger", "legs"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Set an alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "when": {
                        "type": "object",
                        "properties": {
                            "hour": {"type": "integer", "enum": list(range(24))},
                            "minute": {"type": "integer", "enum": [0, 15, 30, 45]},
                        },
                        "required": ["hour", "minute"],
                    },
                    "repeat": {"type": "array", "items": _enum("mon", "tue", "wed", "thu")},
                    "label": {"type": "string"},
                },
                "required": ["when"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {
                        "type": "object",
                        "properties": {
                            "lang": _enum("en", "fr", "ja"),
                            "safe": {"type": "boolean"},
                        },
                    },
                    "limit": {"type": "integer"},
                },
                "required": ["query"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WARM_TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
MESSAGES = [
    {"role": "system", "content": "You are an agent. Call a tool when it helps."},
    {"role": "user", "content": "Book me a window seat from Paris to Tokyo and set an alarm."},
]


@dataclass(frozen=True)
class Config:
    side: str  # "atom" or "vllm"
    level: str  # --tool-strict-level

    @classmethod
    def parse(cls, text: str) -> Config:
        side, _, level = text.partition(":")
        if text not in CONFIGS:
            raise ValueError(f"configuration {text!r} is not one of {', '.join(CONFIGS)}")
        return cls(side, level)

    @property
    def name(self) -> str:
        return f"{self.side}:{self.level}"

    def serve_args(self, engine_args: list[str]) -> tuple[list[str], dict[str, str | None]]:
        parser = "atom_kimi_k3" if self.side == "atom" else "kimi_k3"
        args = [
            *engine_args,
            *("--tool-call-parser", parser, "--enable-auto-tool-choice"),
            *("--tool-strict-level", self.level),
        ]
        env = serve_env(plugin_on=self.side == "atom")
        return args, {**env, "VLLM_ENFORCE_STRICT_TOOL_CALLING": None}  # vLLM's default: on


def bias_for(choice: str, ids: dict[str, int]) -> dict[str, int]:
    """The request's logit bias (see the module's docstring)."""
    if choice == "auto":
        trigger = ("<|open|>", "tools", "<|sep|>", "<|close|>")
    else:
        trigger = ("<|close|>", "response", "<|sep|>")
    bias = {str(ids[t]): TRIGGER_BIAS for t in trigger}
    bias[str(ids['"'])] = QUOTE_BIAS
    return bias


def request_body(model: str, index: int, max_tokens: int, ids: dict[str, int]) -> dict:
    choice = CHOICES[index % len(CHOICES)]
    tool_choice: object = choice
    if choice == "named":
        name = TOOLS[(index // len(CHOICES)) % len(TOOLS)]["function"]["name"]
        tool_choice = {"type": "function", "function": {"name": name}}
    return {
        "model": model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": index,
        "logit_bias": bias_for(choice, ids),
    }


def check_calls(body: dict, streamed: Streamed) -> tuple[int, int, str | None]:
    """(calls, valid calls, why the first invalid one is not) of one reply: a valid call
    names a tool of the request (the named one for a named choice) and its arguments parse
    and validate against its schema."""
    import jsonschema

    named = body["tool_choice"]
    wanted = named["function"]["name"] if isinstance(named, dict) else None
    calls = streamed.tool_calls()
    valid, why = 0, None
    for name, arguments in calls:
        args = parsed_arguments(arguments)
        if name not in SCHEMAS or (wanted is not None and name != wanted):
            reason = f"{name!r} is not the tool asked for"
        elif args is None:
            reason = f"{name}: arguments are not JSON: {arguments[:60]!r}"
        else:
            try:
                jsonschema.validate(args, SCHEMAS[name])
                valid += 1
                continue
            except jsonschema.ValidationError as err:
                reason = f"{name}: {err.message[:80]}"
        why = why or reason
    return len(calls), valid, why


async def wave(url: str, bodies: list[dict], sequential: bool) -> tuple[list[Streamed], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
    start = time.perf_counter()
    if sequential:
        results = [await stream_chat(client, body) for body in bodies]
    else:
        results = await asyncio.gather(*(stream_chat(client, body) for body in bodies))
    wall = time.perf_counter() - start
    await client.close()
    return list(results), wall


def summarize(config: str, concurrency: int, bodies, results, wall: float, metrics) -> dict:
    def stats(values):
        values = sorted(v for v in values if v is not None)
        if not values:
            return None, None, None
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        return statistics.median(values), p90, values[-1]

    calls = valid = plain = auto_calls = errors = 0
    forced = autos = 0
    invalid = None
    for body, streamed in zip(bodies, results, strict=True):
        if streamed.error:
            errors += 1
            continue
        made, good, why = check_calls(body, streamed)
        invalid = invalid or why
        calls, valid = calls + made, valid + good
        if body["tool_choice"] == "auto":
            autos += 1
            auto_calls += made > 0
        else:
            forced += 1
            plain += made == 0
    tokens = sum(s.output_tokens for s in results)
    return {
        "config": config,
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": tokens,
        "tok_s": tokens / wall if wall else 0.0,
        "first_chunk_ms": [None if v is None else 1e3 * v for v in stats(s.ttft for s in results)],
        "ttft_ms": _ms(histogram(*metrics, "vllm:time_to_first_token_seconds")),
        "tpot_ms": _ms(histogram(*metrics, "vllm:request_time_per_output_token_seconds")),
        "calls": calls,
        "valid": valid,
        "forced": forced,
        "plain": plain,
        "autos": autos,
        "auto_calls": auto_calls,
        "errors": errors,
        "first_error": next((s.error for s in results if s.error), None),
        "first_invalid": invalid,
    }


def _ms(values):
    return [None, None, None] if values is None else [1e3 * v for v in values]


def run_config(config: Config, model: str, args, engine_args: list[str], log_dir: Path):
    """One server; every concurrency against it. Returns the rows."""
    from transformers import AutoTokenizer

    from scripts.serve import VllmServer

    tokenizer = AutoTokenizer.from_pretrained(model)
    names = ("<|open|>", "<|close|>", "<|sep|>", "tools", "response", '"')
    ids = {n: tokenizer.encode(n, add_special_tokens=False)[0] for n in names}
    serve_args, env = config.serve_args(engine_args)
    log = log_dir / f"serve-{config.side}-{config.level}.log"
    rows = []
    with VllmServer(model, serve_args, log_path=log, env=env) as server:
        url = f"{server.url}/v1"
        # The engine's first steps and each constraint's first use (its kernels, xgrammar's
        # vocabulary), with a tool set of their own: the benchmark's tools still pay their
        # compile in the first wave.
        warm = [{"model": model, "messages": MESSAGES, "max_tokens": 8}]
        for i in range(len(CHOICES)):
            body = request_body(model, i, 32, ids)
            body["tools"] = WARM_TOOLS
            if isinstance(body["tool_choice"], dict):
                body["tool_choice"] = {"type": "function", "function": {"name": "ping"}}
            warm.append(body)
        asyncio.run(wave(url, warm, sequential=True))
        index = 0
        for concurrency in args.concurrency:
            count = args.rounds if concurrency == 1 else concurrency
            bodies = [request_body(model, index + i, args.max_tokens, ids) for i in range(count)]
            index += count
            before = scrape(server.url)
            results, wall = asyncio.run(wave(url, bodies, sequential=concurrency == 1))
            metrics = (before, scrape(server.url))
            row = summarize(config.name, concurrency, bodies, results, wall, metrics)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def report(rows: list[dict], header: str) -> str:
    def f(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    def trio(values, digits=0):
        return " / ".join(f(v, digits) for v in values)

    lines = [
        header,
        "",
        "| config | C | requests | output tok/s | TPOT ms (mean / p50 / p90) | "
        "TTFT ms (mean / p50 / p90) | first chunk ms, client (p50 / p90 / max) | calls valid | "
        "required+named without a call | auto with a call | errors |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        share = f"{r['valid']}/{r['calls']}" + (
            f" ({100 * r['valid'] / r['calls']:.0f}%)" if r["calls"] else ""
        )
        errors = str(r["errors"]) + (f" ({r['first_error'][:80]})" if r["first_error"] else "")
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['requests']} | {f(r['tok_s'])} | "
            f"{trio(r['tpot_ms'], 1)} | {trio(r['ttft_ms'])} | {trio(r['first_chunk_ms'])} | "
            f"{share} | "
            f"{r['plain']}/{r['forced']} | {r['auto_calls']}/{r['autos']} | {errors} |"
        )
    invalid = [f"{r['config']}, C={r['concurrency']}: {r['first_invalid']}" for r in rows
               if r["first_invalid"]]  # fmt: skip
    if invalid:
        lines += ["", "First invalid call of each row that has one:", ""]
        lines += [f"- {line}" for line in invalid]
    ratios = _ratios(rows)
    if ratios:
        lines += ["", "Output tok/s of `atom` over `vllm` at the same strict level and C:", ""]
        lines += [f"- {line}" for line in ratios]
    return "\n".join(lines) + "\n"


def _ratios(rows: list[dict]) -> list[str]:
    by = {(r["config"], r["concurrency"]): r for r in rows}
    out = []
    for (config, c), row in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        side, _, level = config.partition(":")
        other = by.get((f"vllm:{level}", c)) if side == "atom" else None
        if other and other["tok_s"]:
            out.append(f"{level}, C={c}: {row['tok_s'] / other['tok_s']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=", ".join(CONFIGS))
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=6, help="requests at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    parser.add_argument("--vocab", type=int, default=K3_VOCAB)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--engine-args", default="", help="more `vllm serve` arguments")
    smoke = "vLLM's CPU build at toy scale: a tiny Llama, 8,192 ids, C=1,3"
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--workdir", help="keep the model folder and server logs here")
    parser.add_argument("--out", help="write the table here too")
    parser.add_argument("--json", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.vocab, args.max_num_seqs = "tiny-llama", 8192, 4
        args.concurrency, args.rounds, args.max_tokens = "1,3", 2, 192
    try:
        configs = [Config.parse(c) for c in args.configs.split(",") if c]
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError as err:
        parser.error(str(err))
    engine_args = [
        *("--load-format", "dummy", "--max-model-len", "2048"),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *(("--dtype", "float32", "--enforce-eager") if args.smoke else ()),
        *args.engine_args.split(),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = str(build_k3_model(work / "model", args.shape, args.vocab))
        rows = []
        for config in configs:
            rows += run_config(config, model, args, engine_args, work)
    shown = sys.argv[1:] if argv is None else argv
    header = (
        f"`python -m benchmarks.k3_serving {' '.join(shown)}` "
        f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}; "
        f"shape {args.shape}, {args.vocab} ids, max_tokens {args.max_tokens})"
    )
    table = report(rows, header)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
