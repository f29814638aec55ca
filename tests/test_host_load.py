"""benchmarks/host_load.py on this host's /proc: busy cores and the measuring tree's share."""

import os
import subprocess
import sys
import time

import pytest

from benchmarks import host_load
from benchmarks.host_load import HostLoad

pytestmark = pytest.mark.skipif(host_load.cpu_ticks() is None, reason="needs Linux's /proc")


def test_a_child_process_spinning_counts_as_the_engines_own_load():
    # vLLM's engine core may run in a child of the measuring process: its CPU time counts
    code = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass"
    with HostLoad() as load:
        child = subprocess.Popen([sys.executable, "-c", code])
        child.wait()  # reaped: its time moves to this process's children's time
    s = load.summary
    assert s is not None and s["cpus"] >= 1
    assert 0.3 <= s["own_cores"] <= s["cpus"]
    assert s["own_cores"] <= s["busy_cores"] + 0.5  # the host saw at least the tree's load


def test_an_idle_process_has_no_load_of_its_own_and_the_cell_reads_it():
    with HostLoad() as load:
        time.sleep(0.3)
    assert load.summary["own_cores"] < 0.3
    assert host_load.cell({"busy_cores": 3.14, "own_cores": 1.0, "cpus": 16}) == "3.1 (1.0) of 16"
    assert host_load.cell(None) == "-"
    assert host_load.cpu_model().endswith(f", {os.cpu_count()} cores")


def test_the_fixed_python_work_is_timed_at_both_ends_of_a_pass():
    with HostLoad() as load:
        time.sleep(0.05)
    start, end = load.summary["pace_us"]
    assert 1 < start < 1e6 and 1 < end < 1e6
    start_cpu, end_cpu = load.summary["pace_cpu"]  # where each reading ran
    assert {start_cpu, end_cpu} <= os.sched_getaffinity(0)
    assert host_load.pace_cell(load.summary) == f"{start:.0f}@{start_cpu}/{end:.0f}@{end_cpu}"
    assert host_load.pace_cell(None) == "-"
    assert 0.0 <= load.summary["steal_cores"] <= load.summary["cpus"]


def test_a_grandchild_spinning_counts_in_its_grandparents_tree():
    code = (
        "import subprocess, sys\n"
        "spin = 'import time\\nend = time.monotonic() + 0.6\\nwhile time.monotonic() < end: pass'\n"
        "p = subprocess.Popen([sys.executable, '-c', spin])\n"
        "print('up', flush=True)\n"
        "p.wait()\n"
        "print('done', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "up"
        with HostLoad(pid=child.pid) as load:
            assert child.stdout.readline().strip() == "done"
    finally:
        child.stdin.close()
        child.wait()
    assert load.summary["own_cores"] >= 0.3


def test_the_cpu_a_thread_runs_on_follows_its_affinity():
    before = os.sched_getaffinity(0)
    try:
        for cpu in sorted(before):
            os.sched_setaffinity(0, {cpu})
            assert host_load.current_cpu() == cpu
    finally:
        os.sched_setaffinity(0, before)
