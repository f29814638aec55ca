"""How busy the host's CPUs were while an engine-benchmark pass ran, and how much of it
was the measuring engine's own.

The 16-head decode steps are host-paced (probed host time 1.6-2.9 ms against 2.7 ms of GPU
work a step), and the same case's passes of the same work differed by up to 1.7 ms a step
on 2026-12-06. A pass that ran while other processes kept the host's cores busy (the idle
engines of the wave, an install) was measured on a slower host, not on slower code.
Read from /proc at the pass's start and end: the busy share of every core (as a count of
busy cores), the share the hypervisor gave other guests (steal, as a count of cores) and
the CPU time of the measuring process and its descendants (vLLM's engine core runs in a
child). Without /proc (not Linux) the summary is None.

An idle host can still be a slow one: on 2026-12-06 each backend's 1-request decode step
was its probed host time plus 0.4-0.7 ms in every pass, and the host time of the same code
moved by up to 50% from pass to pass with 1.2-1.8 busy cores of 16. So each pass also times
a fixed piece of Python at its start and end (`python_pace_us`): the host's speed at the
time, one figure to set beside each pass's step.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

PROC = Path("/proc")


PACE_REPEATS = 5


def cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, total, steal) jiffies of every CPU since boot, from /proc/stat's first line
    (steal counts as busy: the guest's CPU was not free for it)."""
    try:
        first = (PROC / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    fields = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields), fields[7]


def _fixed_python_work() -> int:
    """Bytecode, dict updates and small allocations, as a step's host work has: about
    0.2 ms on the project's 2-core CI host."""
    counts: dict[int, int] = {}
    for i in range(3000):
        key = i % 97
        counts[key] = counts.get(key, 0) + len((i, key))
    return sum(counts.values())


def current_cpu() -> int | None:
    """The CPU this thread last ran on (/proc's `processor` field); None without /proc. A
    pace reading names it: `python -m benchmarks host_pace` tells whether the slow readings
    stay with some CPUs."""
    try:
        text = (PROC / "thread-self" / "stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[36])  # field 39 of stat(5)


def python_pace_us(repeats: int = PACE_REPEATS) -> float:
    """Microseconds the host takes for `_fixed_python_work` now (median of `repeats`)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _fixed_python_work()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


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
    measuring process tree's share, the cores stolen by the hypervisor, the host's core
    count, and the fixed Python work's time at the start and end."""

    def __init__(self, pid: int | None = None):
        self.pid = pid if pid is not None else os.getpid()
        self.summary: dict | None = None

    def __enter__(self) -> HostLoad:
        self._pace = python_pace_us()
        self._pace_cpu = current_cpu()
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
        busy, total, steal = (b - a for a, b in zip(self._cpu, end, strict=True))
        self.summary = {
            "busy_cores": cpus * busy / total if total else 0.0,
            "own_cores": (own - self._own) / os.sysconf("SC_CLK_TCK") / seconds,
            "steal_cores": cpus * steal / total if total else 0.0,
            "cpus": cpus,
            "pace_us": (self._pace, python_pace_us()),
            "pace_cpu": (self._pace_cpu, current_cpu()),
        }


def cell(summary: dict | None) -> str:
    """A table cell: busy cores of the host (the measuring engine's own) of its count, and
    the cores stolen by the hypervisor where any were."""
    if not summary:
        return "-"
    text = f"{summary['busy_cores']:.1f} ({summary['own_cores']:.1f}) of {summary['cpus']}"
    steal = summary.get("steal_cores", 0.0)
    return f"{text}, {steal:.1f} stolen" if steal >= 0.05 else text


def pace_cell(summary: dict | None) -> str:
    """The fixed Python work's time in us, at the pass's start/end, each with the CPU it
    ran on where known ("249@3/514@7"; "-" where not measured)."""
    pace = (summary or {}).get("pace_us")
    if not pace:
        return "-"
    cpus = summary.get("pace_cpu") or (None,) * len(pace)
    marks = [f"@{cpu}" if cpu is not None else "" for cpu in cpus]
    return "/".join(f"{us:.0f}{mark}" for us, mark in zip(pace, marks, strict=True))
