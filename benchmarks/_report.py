"""What every benchmark report states beside its figures: the device, the date and the
versions it ran with, and progress lines on stderr while it runs. Imports no torch until
asked for versions, so a driver that only starts other processes stays light."""

from __future__ import annotations

import datetime
import sys
import time

_T0 = time.monotonic()


def progress(msg: str) -> None:
    """A progress line on stderr, with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def versions() -> str:
    """'torch X, triton Y, vllm Z' as installed; a missing one says why."""
    import torch

    parts = [f"torch {torch.__version__}"]
    for mod in ("triton", "vllm"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception as exc:
            parts.append(f"{mod} unavailable ({type(exc).__name__}: {str(exc)[:60]})")
    return ", ".join(parts)


def run_facts() -> str:
    """'DEVICE; YYYY-MM-DD HH:MM UTC; torch X, triton Y, vllm Z': what a result table states."""
    import torch

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{torch.cuda.get_device_name()}; {when}; {versions()}"
