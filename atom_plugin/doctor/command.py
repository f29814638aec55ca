"""`atom-plugin doctor` (being written: see issue 6)."""

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("atom-plugin doctor is not implemented yet")
