"""The GPU's SM clock while an engine-benchmark pass runs, and what held it down.

A thread samples NVML every `period_s` during the pass: the SM clock and the driver's
clock-event reasons (power cap, thermal or hardware slowdown, ...). A pass slower than
its neighbours under a lower clock or a slowdown reason was measured on a slower GPU,
not on slower code. NVML comes from nvidia-ml-py or vLLM's own copy; without it or an
NVIDIA GPU the summary is None.
"""

from __future__ import annotations

import os
import statistics
import threading

# NVML's clock-event reason bits that mean the clock was held below what the load asked
# for (0x1, the GPU idle, is not one).
SLOWDOWNS = {
    0x2: "applications clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
    0x100: "display clock",
}


def _nvml():
    try:
        import pynvml
    except ImportError:
        try:  # vLLM ships its own copy
            from vllm.third_party import pynvml
        except ImportError:
            return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return None
    return pynvml


def _physical_index() -> int:
    """NVML counts every GPU of the host; CUDA only the visible ones, from the first."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class ClockSampler:
    """`with ClockSampler() as clocks: ...` then `clocks.summary`."""

    def __init__(self, period_s: float = 0.05, nvml=None):
        self.period_s = period_s
        self.nvml = nvml if nvml is not None else _nvml()
        self.mhz: list[int] = []
        self.reasons = 0
        self.summary: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        if self.nvml is not None:
            self._handle = self.nvml.nvmlDeviceGetHandleByIndex(_physical_index())
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self.summary = summarize(self.mhz, self.reasons)

    def _sample(self) -> None:
        nvml = self.nvml
        # renamed in newer NVML; older bindings have only the "throttle" name
        read_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if read_reasons is None:
            read_reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while True:
            self.mhz.append(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
            self.reasons |= read_reasons(self._handle)
            if self._stop.wait(self.period_s):
                return


def summarize(mhz: list[int], reasons: int) -> dict | None:
    """Median and lowest SM clock of the samples, and the slowdowns seen in any."""
    if not mhz:
        return None
    return {
        "sm_mhz_median": statistics.median(mhz),
        "sm_mhz_min": min(mhz),
        "samples": len(mhz),
        "slowdowns": [name for bit, name in SLOWDOWNS.items() if reasons & bit],
    }


def cell(summary: dict | None) -> str:
    """A table cell: `median / lowest` MHz, with the slowdowns seen."""
    if not summary:
        return "-"
    text = f"{summary['sm_mhz_median']:.0f} / {summary['sm_mhz_min']:.0f}"
    if summary["slowdowns"]:
        text += f" ({', '.join(summary['slowdowns'])})"
    return text
