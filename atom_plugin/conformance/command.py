"""`atom-plugin conformance [--plugin NAME] [--verbose]`: run the suite, print findings.

Exit status: 0 every contract item holds, 1 some finding failed, 2 bad usage or a
missing dependency (named).
"""

from __future__ import annotations

import argparse
import sys
import time

from atom_plugin.conformance import MissingDependency, checks


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        metavar="NAME",
        help="only the implementations of this plugin (a name `atom-plugin info` lists: "
        "the entry point's name for a third-party package)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print passing findings too")


def run(args: argparse.Namespace) -> int:
    try:
        found = checks(plugin=args.plugin)
    except ValueError as exc:
        print(f"atom-plugin conformance: {exc}", file=sys.stderr)
        return 2
    if not found:
        print(f"no implementations to check (plugin {args.plugin!r})")
        return 0
    failed = total = 0
    for check in found:
        started = time.monotonic()
        print(f"checking {check.implementation} ...", flush=True)
        bad = 0
        try:
            for finding in check.run():
                total += 1
                if not finding.ok:
                    bad += 1
                if args.verbose or not finding.ok:
                    print(f"  {finding}", flush=True)
        except MissingDependency as exc:
            print(f"atom-plugin conformance: {exc}", file=sys.stderr)
            return 2
        failed += bad
        verdict = "ok" if not bad else f"{bad} failed"
        print(f"  {verdict} ({time.monotonic() - started:.1f} s)", flush=True)
    print(f"{len(found)} implementations, {total} findings, {failed} failed")
    return 1 if failed else 0
