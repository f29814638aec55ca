"""Running a vendor tool under a deadline, killing all of it when it overruns.

A wedged GPU can make rocm-smi block in the driver. The tool runs in a session
of its own, so on timeout the whole process group (the tool and anything it
started) is killed and reaped: nothing is left running behind the check.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolRun:
    returncode: int | None  # None when it was killed for running past the deadline
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_tool(argv: list[str], timeout: float) -> ToolRun:
    """Run `argv` with no stdin; give up and kill its process group after `timeout` s."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        returncode = None
    except BaseException:  # e.g. Ctrl-C: do not leave the tool behind
        _kill_group(proc)
        proc.wait()
        raise
    return ToolRun(returncode, _text(out), _text(err))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
