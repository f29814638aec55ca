"""Is a slow host a slow CPU or a slow moment? `host_load`'s fixed Python work, pinned to
each CPU in turn, round after round.

On the H100 leases of 2026-12-06 the engine benchmark's pace readings took either 245-280 us
or 438-619 us, changing from one pass to the next and within a pass, on an idle 16-core
host; where a backend's decode step is shorter on the GPU than on the host, its step
followed them. If the slow readings stay with some CPUs, pinning the engine to the others
(`python -m benchmarks engine --cpus LIST`) removes them; if every CPU is slow at the same
moments, the whole host changes speed (its clock, the hypervisor) and only more rounds
average it out.

    python -m benchmarks host_pace [--rounds 20] [--interval-s 0.5] [--cpus 0-15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.host_load import python_pace_us

SYS_CPU = Path("/sys/devices/system/cpu")
# A reading this many times the fastest CPU's median counts as slow (the 2026-12-06 hosts:
# about 2.1x between their two speeds, rarely between).
SLOW_FACTOR = 1.5


def parse_cpus(text: str, allowed: set[int] | None = None) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]; every CPU must be one this process may run on."""
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            first, _, last = part.partition("-")
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(
                f"CPU list {text!r}: {part!r} is not a CPU or a range like 0-3"
            ) from None
        if low > high:
            raise ValueError(f"CPU list {text!r}: range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    outside = sorted(cpus - allowed)
    if outside:
        raise ValueError(
            f"CPU list {text!r}: CPUs {outside} are not among this process's CPUs "
            f"{cpu_ranges(sorted(allowed))}"
        )
    return sorted(cpus)


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(f"{start}-{cpu}" if cpu != start else f"{cpu}")
            start = None
    return ",".join(parts)


def siblings(cpu: int) -> str:
    """The CPUs sharing `cpu`'s core (hyperthreads), as the kernel lists them; '-' unknown."""
    try:
        return (SYS_CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return "-"


def measure(cpus: list[int], rounds: int, interval_s: float) -> list[dict[int, float]]:
    """Per round, each CPU's pace (us), this thread pinned to it; the affinity is restored."""
    before = os.sched_getaffinity(0)
    readings = []
    try:
        for r in range(rounds):
            if r:
                time.sleep(interval_s)
            row = {}
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                row[cpu] = python_pace_us()
            readings.append(row)
    finally:
        os.sched_setaffinity(0, before)
    return readings


def report(readings: list[dict[int, float]]) -> str:
    """Per CPU: its readings' median, range and slow share; per round: how many CPUs were
    slow at once, which tells a slow CPU from a slow moment."""
    cpus = sorted(readings[0])
    by_cpu = {cpu: [row[cpu] for row in readings] for cpu in cpus}
    fastest = min(statistics.median(v) for v in by_cpu.values())
    slow_at = SLOW_FACTOR * fastest
    lines = [
        f"fixed Python work, {len(readings)} rounds over {len(cpus)} CPUs; slow: over "
        f"{slow_at:.0f} us ({SLOW_FACTOR}x the fastest CPU's median, {fastest:.0f} us)",
        "",
        "| cpu | siblings | median us | fastest | slowest | slow readings |",
        "|---|---|---|---|---|---|",
    ]
    for cpu in cpus:
        v = by_cpu[cpu]
        slow = sum(x > slow_at for x in v)
        lines.append(
            f"| {cpu} | {siblings(cpu)} | {statistics.median(v):.0f} | {min(v):.0f} | "
            f"{max(v):.0f} | {slow} of {len(v)} |"
        )
    slow_counts = [sum(x > slow_at for x in row.values()) for row in readings]
    every = sum(n == len(cpus) for n in slow_counts)
    none = sum(n == 0 for n in slow_counts)
    lines += [
        "",
        f"rounds with every CPU slow: {every}, none slow: {none}, some: "
        f"{len(readings) - every - none} (slow CPUs a round: {slow_counts})",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--interval-s", type=float, default=0.5, help="pause between rounds")
    p.add_argument("--cpus", help="CPUs to time, e.g. 0-7 (default: all this process may use)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    try:
        cpus = parse_cpus(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(report(measure(cpus, args.rounds, args.interval_s)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
