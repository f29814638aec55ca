"""`python -m atom_plugin.vllm.compat [--source DIR_OR_WHEEL]`: the host-API checks.

Without --source the installed vLLM is imported and inspected; with it a vLLM source
tree or wheel is parsed and nothing of vLLM is imported (for releases that cannot be
installed here). Exit status 0: no problem; 1: problems (listed); 2: bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time

from atom_plugin.vllm.compat import SUPPORTED_VLLM, is_supported
from atom_plugin.vllm.compat.check import ADAPTER_PACKAGE, Adapter, Coverage, check


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m atom_plugin.vllm.compat",
        description="Check that a vLLM offers every name, signature, call and attribute the "
        "adapter uses.",
    )
    parser.add_argument(
        "--source",
        metavar="DIR_OR_WHEEL",
        help="a vLLM wheel (.whl) or a directory holding the vllm package; default: the "
        "installed vLLM",
    )
    parser.add_argument(
        "--partial",
        action="store_true",
        help="the source tree is a cut-down one (a test fixture): modules it leaves out are "
        "not checked rather than missing",
    )
    parser.add_argument(
        "--adapter",
        metavar="DIR",
        help="the directory holding the adapter package (default: this atom_plugin's)",
    )
    parser.add_argument(
        "--package", default=ADAPTER_PACKAGE, help=f"adapter package (default {ADAPTER_PACKAGE})"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        if args.source:
            from atom_plugin.vllm.compat.hosts import SourceHost

            host = SourceHost(args.source, partial=args.partial)
        else:
            from atom_plugin.vllm.compat.hosts import InstalledHost

            host = InstalledHost()
        adapter = Adapter(args.adapter, args.package)
    except (FileNotFoundError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"checking {args.package} ({len(adapter.modules)} modules) against {host.label}")
    version = host.version()
    if not is_supported(version):
        print(f"note: vLLM {version} is outside the supported range {SUPPORTED_VLLM}")
    coverage = Coverage()
    problems = check(host, adapter, coverage)
    for problem in problems:
        print(problem)
    took = time.monotonic() - started
    print(f"compared {coverage}")
    print(f"{len(problems)} problem(s) ({took:.1f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
