"""What compiling a new Kimi-K3 tool set costs the API server, standalone (no server).

`atom_kimi_k3` compiles each tool set it has not seen on the API server's event loop:
the call spec from the tools and the tokenizer, the call automaton and its table, the
wire form in the request's `vllm_xargs` (`CallCache.calls_for`, `channel_extra_args`).
This times that per schema of `benchmarks.k3_admission` with the synthetic K3 tokenizer
`vllm serve` loads there (`--vocab` ids): its first compile in this process (for the
first schema, the process's first, as a server's first cold request meets it), then the
median of `--runs` more, each with a cache that has not seen the tool set. `--profile`
adds each schema's cProfile top entries.

    python -m benchmarks.k3_compile [--schemas int2000,enum20000,tools3000] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._report import versions
from benchmarks.k3_admission import SCHEMAS, parse_schemas


def compile_once(tokenizer, classes, channel, tools) -> tuple[float, object, dict]:
    """Seconds of one cold compile (a fresh cache), its compiled calls and extra args."""
    from atom_plugin.k3.call_cache import CallCache, CompiledCalls
    from atom_plugin.k3.channel_for import channel_extra_args

    start = time.perf_counter()
    calls, compiled = CallCache(tokenizer, classes).calls_for(tools, None, True)
    if not (compiled and isinstance(calls, CompiledCalls)):
        raise RuntimeError(f"the tool set did not compile: {calls}")
    extra = channel_extra_args(channel, calls.wire)
    return time.perf_counter() - start, calls, extra


def profile_top(tokenizer, classes, channel, tools, entries: int = 15) -> str:
    profile = cProfile.Profile()
    profile.enable()
    compile_once(tokenizer, classes, channel, tools)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(entries)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help=", ".join(SCHEMAS))
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    schemas = parse_schemas(parser, args.schemas)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")

    from transformers import AutoTokenizer

    from atom_plugin.k3.channel_for import required_channel_for
    from atom_plugin.k3.token_classes import classes_for_tokenizer
    from benchmarks.k3_serving_model import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp), args.vocab)
        tokenizer = AutoTokenizer.from_pretrained(tmp)  # as the server loads it
    classes = classes_for_tokenizer(tokenizer)
    channel = required_channel_for(tokenizer)
    shown = sys.argv[1:] if argv is None else argv
    lines = [
        f"`python -m benchmarks.k3_compile {' '.join(shown)}` ({versions()}; synthetic K3 "
        f"tokenizer of {args.vocab:,} ids)",
        "",
        "| schema | states | explicit edges | wire (KB) | first (ms) | "
        f"median of {args.runs} (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    profiles = []
    for name in schemas:
        tools = SCHEMAS[name]
        first, calls, extra = compile_once(tokenizer, classes, channel, tools)
        runs = [compile_once(tokenizer, classes, channel, tools)[0] for _ in range(args.runs)]
        wire = calls.wire
        lines.append(
            f"| {name} | {wire['states']:,} | {wire['edges']:,} | "
            f"{len(next(iter(extra.values()))) / 1024:.0f} | {1e3 * first:.1f} | "
            f"{1e3 * statistics.median(runs):.1f} |"
        )
        if args.profile:
            profiles.append(f"\n{name}:\n{profile_top(tokenizer, classes, channel, tools)}")
    print("\n".join(lines) + "\n" + "".join(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
