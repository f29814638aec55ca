"""`atom-plugin doctor`: refuse a GPU host whose GPUs look wedged, before a job starts.

Exit status: 0 healthy, 1 unhealthy, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from atom_plugin.doctor.check import (
    AUTO,
    DEFAULT_TIMEOUT_S,
    UsageError,
    Verdict,
    check_host,
    check_saved,
)

EXIT_HEALTHY, EXIT_UNHEALTHY = 0, 1
ANNOTATION_TITLE = "Unhealthy GPU host"


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of seconds")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--smi",
        default=AUTO,
        metavar="NAME",
        help="vendor tool to use: auto (the first one on PATH), rocm, amd, nvidia, "
        "or a probe added by another plugin (default: auto)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help=f"give up on the tool after this long, all its commands together "
        f"(default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--smi-output",
        metavar="FILE",
        help="judge a saved table (or a log holding one) instead of running the tool",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the verdict, reason and per-GPU rows as JSON"
    )
    parser.set_defaults(doctor_parser=parser)


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.doctor_parser
    try:
        verdict = _verdict(args)
    except UsageError as err:
        parser.error(str(err))  # exits 2
    if args.json:
        print(json.dumps(verdict.as_dict(), indent=2, ensure_ascii=False))
    else:
        _print_text(verdict)
    if not verdict.healthy and os.environ.get("GITHUB_ACTIONS") == "true":
        # Workflow commands are read from stdout and stderr; keep --json's stdout pure.
        print(github_annotation(verdict.reason), file=sys.stderr if args.json else sys.stdout)
    return EXIT_HEALTHY if verdict.healthy else EXIT_UNHEALTHY


def _verdict(args: argparse.Namespace) -> Verdict:
    if args.smi_output is None:
        timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
        return check_host(args.smi, timeout)
    if args.timeout is not None:
        raise UsageError("--timeout limits a tool run; it has no effect with --smi-output")
    try:
        with open(args.smi_output, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"cannot read --smi-output {args.smi_output!r}: {err.strerror}") from None
    return check_saved(text, args.smi)


def _print_text(verdict: Verdict) -> None:
    state = "healthy" if verdict.healthy else "UNHEALTHY"
    print(f"atom-plugin doctor: {state}: {verdict.reason}")
    for gpu in verdict.unhealthy_gpus:
        print(
            f"  GPU {gpu.index}  unique ID {gpu.unique_id or 'unknown'}  "
            f"temperature {gpu.temperature or '(blank)'}  power {gpu.power or '(blank)'}"
        )


def github_annotation(reason: str) -> str:
    """A GitHub Actions error annotation; the message is escaped as the runner expects."""
    message = reason.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return f"::error title={ANNOTATION_TITLE}::{message}"
