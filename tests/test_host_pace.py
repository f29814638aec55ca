"""benchmarks/host_pace.py: the fixed Python work pinned to each CPU in turn, and the CPU
lists the engine benchmark pins its cases to."""

import os

import pytest

from benchmarks import host_load, host_pace

pytestmark = pytest.mark.skipif(host_load.cpu_ticks() is None, reason="needs Linux's /proc")


def test_cpu_lists_read_ranges_and_name_bad_values_with_the_cpus_there_are():
    assert host_pace.parse_cpus("0-2,5", allowed={0, 1, 2, 3, 5}) == [0, 1, 2, 5]
    assert host_pace.parse_cpus("3", allowed={3}) == [3]
    assert host_pace.cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError, match=r"CPUs \[9\] are not among this process's CPUs 0-3"):
        host_pace.parse_cpus("2,9", allowed={0, 1, 2, 3})
    with pytest.raises(ValueError, match="'x' is not a CPU or a range like 0-3"):
        host_pace.parse_cpus("0,x", allowed={0})
    with pytest.raises(ValueError, match="'3-1' runs backwards"):
        host_pace.parse_cpus("3-1", allowed={1, 2, 3})


def test_each_reading_ran_on_the_cpu_it_is_filed_under_and_the_affinity_comes_back(monkeypatch):
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    seen = []
    real_pace = host_pace.python_pace_us

    def pace_and_where():
        seen.append(host_load.current_cpu())
        return real_pace(repeats=1)

    monkeypatch.setattr(host_pace, "python_pace_us", pace_and_where)
    readings = host_pace.measure(cpus, rounds=2, interval_s=0.0)
    assert os.sched_getaffinity(0) == before
    assert seen == cpus * 2
    assert [sorted(row) for row in readings] == [cpus, cpus]


def test_the_report_counts_slow_readings_by_cpu_and_by_round():
    # CPU 1 slow in every round, CPU 0 in none: the slow readings stay with a CPU
    readings = [{0: 250.0, 1: 520.0}, {0: 260.0, 1: 530.0}, {0: 255.0, 1: 300.0}]
    text = host_pace.report(readings)
    assert "slow: over 382 us (1.5x the fastest CPU's median, 255 us)" in text
    assert "| 0 |" in text and "| 255 | 250 | 260 | 0 of 3 |" in text
    assert "| 520 | 300 | 530 | 2 of 3 |" in text
    assert (
        "rounds with every CPU slow: 0, none slow: 1, some: 2 (slow CPUs a round: [1, 1, 0])"
        in text
    )


def test_the_command_line_times_the_cpus_asked_for(capsys):
    cpu = min(os.sched_getaffinity(0))
    assert host_pace.main(["--rounds", "2", "--interval-s", "0", "--cpus", str(cpu)]) == 0
    out = capsys.readouterr().out
    assert "2 rounds over 1 CPUs" in out and f"| {cpu} |" in out
    with pytest.raises(SystemExit, match="not among this process's CPUs"):
        host_pace.main(["--cpus", "4096"])
