"""benchmarks/gpu_clocks.py with a stand-in for NVML: what a pass's samples summarize to."""

import itertools

from benchmarks import gpu_clocks
from benchmarks.gpu_clocks import ClockSampler


class FakeNVML:
    NVML_CLOCK_SM = 1

    def __init__(self, clocks, reasons):
        self.clocks, self.reasons = itertools.cycle(clocks), itertools.cycle(reasons)
        self.handles = []

    def nvmlDeviceGetHandleByIndex(self, index):
        self.handles.append(index)
        return "gpu"

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert (handle, kind) == ("gpu", self.NVML_CLOCK_SM)
        return next(self.clocks)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return next(self.reasons)


def test_a_pass_under_a_power_cap_reports_its_clocks_and_the_cap(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    nvml = FakeNVML([1980, 1980, 1410], [0x1, 0x4])  # idle bit, then the power cap
    with ClockSampler(period_s=0.001, nvml=nvml) as clocks:
        while len(clocks.mhz) < 6:
            pass
    s = clocks.summary
    assert nvml.handles == [3]  # NVML counts the host's GPUs
    assert s["sm_mhz_min"] == 1410 and s["sm_mhz_median"] == 1980
    assert s["slowdowns"] == ["power cap"]  # the idle bit is not a slowdown
    assert gpu_clocks.cell(s) == "1980 / 1410 (power cap)"


def test_without_nvml_there_is_no_summary_and_the_cell_says_so(monkeypatch):
    monkeypatch.setattr(gpu_clocks, "_nvml", lambda: None)
    with ClockSampler() as clocks:
        pass
    assert clocks.summary is None
    assert gpu_clocks.cell(None) == "-"
    assert gpu_clocks.cell(gpu_clocks.summarize([1755], 0)) == "1755 / 1755"
