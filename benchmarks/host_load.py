"""How busy the host's CPUs were while an engine-benchmark pass ran, and how much of it
was the measuring engine's own.

The 16-head decode steps are host-paced (probed host time 1.6-2.9 ms against 2.7 ms of GPU
work a step), and the same case's passes of the same work differed by up to 1.7 ms a step
on 2026-12-06. A pass that ran while other processes kept the host's cores busy (the idle
engines of the wave, an install) was measured on a slower host, not on slower code.
Read from /proc at the pass's start and end: the busy share of every core (as a count of
busy cores) and the CPU time of the measuring process and its descendants (vLLM's engine
core runs in a child). Without /proc (not Linux) the summary is None.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat's first line."""
    try:
        first = (PROC / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    fields = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def tree_ticks(root: int) -> int:
    """CPU jiffies of process `root` and every live descendant, each with its reaped
    children's (a child that exits during a pass moves its time to its parent)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while listed
            continue
        rest = text[text.rindex(")") + 2 :].split()  # fields after the command name
        pid = int(stat.parent.name)
        parents[pid] = int(rest[1])
        ticks[pid] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    return sum(ticks.get(pid, 0) for pid in tree)


def cpu_model() -> str | None:
    """The host CPU's model name and core count (machines lent under one name differ)."""
    try:
        text = (PROC / "cpuinfo").read_text()
    except OSError:
        return None
    names = [
        line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")
    ]
    return f"{names[0] if names else 'unknown'}, {os.cpu_count()} cores"


class HostLoad:
    """`with HostLoad() as load: ...` then `load.summary`: busy cores of the host, the
    measuring process tree's share, and the host's core count."""

    def __init__(self, pid: int | None = None):
        self.pid = pid if pid is not None else os.getpid()
        self.summary: dict | None = None

    def __enter__(self) -> HostLoad:
        self._cpu = cpu_ticks()
        self._own = tree_ticks(self.pid) if self._cpu else 0
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        end = cpu_ticks()
        if self._cpu is None or end is None:
            return
        own = tree_ticks(self.pid)
        seconds = max(time.monotonic() - self._t0, 1e-6)
        cpus = os.cpu_count() or 1
        busy, total = end[0] - self._cpu[0], end[1] - self._cpu[1]
        self.summary = {
            "busy_cores": cpus * busy / total if total else 0.0,
            "own_cores": (own - self._own) / os.sysconf("SC_CLK_TCK") / seconds,
            "cpus": cpus,
        }


def cell(summary: dict | None) -> str:
    """A table cell: busy cores of the host (the measuring engine's own) of its count."""
    if not summary:
        return "-"
    return f"{summary['busy_cores']:.1f} ({summary['own_cores']:.1f}) of {summary['cpus']}"
