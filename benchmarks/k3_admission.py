"""What admitting a large tool schema costs the other streams of a `vllm serve`.

One plain request streams `--plain-tokens` tokens (no tools, `ignore_eos`); once it is
under way, one `tool_choice="required"` request arrives with a large but supported schema
(`SCHEMAS`). The figure is the plain stream's largest gap between two chunks of output
(its median gap beside it), with the tool request's time to first token. Each schema is
sent twice: cold (the server has not seen the tool set) and warm (the same tool set
again). A baseline stream runs alone first.

With `--parser atom_kimi_k3` the plugin's channel holds the request (its tool set is
compiled in the API server once, the engine lays out the rows); with `--parser kimi_k3`
the plugin is disabled (ATOM_PLUGIN_DISABLE=1) and vLLM's structural tag holds it
(xgrammar compiles the tag on the engine's grammar thread pool). Without `--model`, a tiny
Llama with random weights and a synthetic K3 tokenizer of `--vocab` ids is built
(`benchmarks.k3_serving_model`, `--shape`), for vLLM's CPU build.

    python -m benchmarks.k3_admission --parser atom_kimi_k3 [--schemas int2000,enum20000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import tempfile
from pathlib import Path

from benchmarks._report import versions
from benchmarks.k3_client import serve_env, stream_chat
from benchmarks.k3_serving_model import build_k3_model

PARSERS = ("atom_kimi_k3", "kimi_k3")


def _tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required or []}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


SCHEMAS = {
    "int2000": [_tool("configure", {f"p{i}": {"type": "integer"} for i in range(2000)})],
    "enum20000": [
        _tool("pick", {"value": {"type": "string", "enum": [f"v{i}" for i in range(20000)]}})
    ],
    "tools3000": [_tool(f"tool_{i}", {"a": {"type": "string"}}, ["a"]) for i in range(3000)],
}
MESSAGES = [{"role": "user", "content": "Hi"}]


def parse_schemas(parser: argparse.ArgumentParser, names: str) -> list[str]:
    """The comma list of SCHEMAS names `names`; an unknown one is the parser's error."""
    schemas = [s for s in names.split(",") if s]
    unknown = [s for s in schemas if s not in SCHEMAS]
    if unknown:
        parser.error(f"unknown schema(s) {unknown}; choose from {', '.join(SCHEMAS)}")
    return schemas


async def admission(url: str, model: str, tools: list, plain_tokens: int) -> dict:
    """One plain stream with one required request of `tools` sent while it runs."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    started = asyncio.Event()
    plain_body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": plain_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }

    def on_chunk(streamed):
        if len(streamed.times) >= min(20, plain_tokens // 4):
            started.set()

    plain = asyncio.create_task(stream_chat(client, plain_body, on_chunk))
    tool_result = None
    if tools:
        await started.wait()
        tool_body = {
            "model": model,
            "messages": MESSAGES,
            "tools": tools,
            "tool_choice": "required",
            "max_tokens": 8,
            "temperature": 0.0,
        }
        tool_result = await stream_chat(client, tool_body)
    streamed = await plain
    await client.close()
    gaps = streamed.gaps()
    return {
        "largest_gap_ms": 1e3 * max(gaps) if gaps else None,
        "median_gap_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "plain_tokens": streamed.output_tokens,
        "plain_error": streamed.error,
        "tool_ttft_ms": None
        if tool_result is None or tool_result.ttft is None
        else 1e3 * tool_result.ttft,
        "tool_error": None if tool_result is None else tool_result.error,
    }


def measure(url: str, model: str, schemas: list[str], plain_tokens: int) -> list[dict]:
    """Rows: the baseline, then each schema cold and warm (after one warm-up stream)."""
    _run(url, model, [], plain_tokens)
    rows = [{"schema": "none (baseline)", "phase": "-", **_run(url, model, [], plain_tokens)}]
    for name in schemas:
        for phase in ("cold", "warm"):
            rows.append(
                {"schema": name, "phase": phase, **_run(url, model, SCHEMAS[name], plain_tokens)}
            )
    return rows


def _run(url: str, model: str, tools: list, plain_tokens: int) -> dict:
    return asyncio.run(admission(url, model, tools, plain_tokens))


def server_args(parser: str, max_model_len: int = 2048) -> tuple[list[str], dict[str, str | None]]:
    """`vllm serve` arguments and environment for `parser` on vLLM's CPU build."""
    if parser not in PARSERS:
        raise ValueError(f"parser {parser!r} is not one of {', '.join(PARSERS)}")
    args = [
        *("--load-format", "dummy", "--dtype", "float32"),
        *("--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--enforce-eager"),
        *("--tool-call-parser", parser, "--enable-auto-tool-choice"),
    ]
    return args, serve_env(plugin_on=parser == "atom_kimi_k3")


def report(rows: list[dict], parser: str, command: str) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    lines = [
        f"`{command}` ({datetime.date.today().isoformat()}; {versions()}; parser {parser})",
        "",
        "| schema | phase | plain stream's largest gap (ms) | its median gap (ms) | "
        "tool request's first token (ms) | errors |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        errors = "; ".join(e for e in (row["plain_error"], row["tool_error"]) if e) or "none"
        lines.append(
            f"| {row['schema']} | {row['phase']} | {ms(row['largest_gap_ms'])} | "
            f"{ms(row['median_gap_ms'])} | {ms(row['tool_ttft_ms'])} | {errors} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    from scripts.serve import VllmServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parser", choices=PARSERS, default="atom_kimi_k3")
    parser.add_argument("--schemas", default="int2000,enum20000", help=", ".join(SCHEMAS))
    parser.add_argument("--plain-tokens", type=int, default=120)
    parser.add_argument("--model", help="a K3 model folder (default: a tiny one is built)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shape", default="small-llama", help="of benchmarks.k3_serving_model")
    parser.add_argument("--out", help="write the table here too")
    args = parser.parse_args(argv)
    schemas = parse_schemas(parser, args.schemas)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_k3_model(Path(tmp) / "model", args.shape, args.vocab))
        serve_args, env = server_args(args.parser)
        log = Path(tmp) / "serve.log"
        with VllmServer(model, serve_args, log_path=log, env=env) as server:
            rows = measure(f"{server.url}/v1", model, schemas, args.plain_tokens)
    shown = sys.argv[1:] if argv is None else argv
    table = report(rows, args.parser, "python -m benchmarks.k3_admission " + " ".join(shown))
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
