"""One GPU's row from a vendor table, and the N/A rule that judges it.

Why the rule: in ATOM's CI, every one of the 30 jobs that later hung with
`HW Exception ... GPU Hang` had shown a GPU reporting N/A power or N/A
temperature in the table printed before the server started; none of the 163
other jobs (83 other failures, 80 successes) did.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def reading(raw: str) -> float | None:
    """The number in a table cell, or None when the cell holds no reading.

    No reading: what the tools print for a sensor that did not answer (`N/A`,
    `[N/A]`, a blank cell) and any other cell without a number, such as
    nvidia-smi's `[Not Supported]`, `[Unknown Error]` or `[GPU is lost]`.
    """
    match = _NUMBER.search(raw)
    return float(match.group()) if match else None


@dataclass(frozen=True)
class GpuReading:
    """A GPU as one vendor table shows it; cells are kept as printed."""

    index: int
    unique_id: str | None
    temperature: str
    power: str
    temperature_sensor: str | None = None

    @classmethod
    def of_row(
        cls, cells: list[str], temperature_at: int, power_at: int, unique_ids, sensor
    ) -> GpuReading:
        """The reading of a table row whose first cell is the GPU index; `unique_ids`
        maps indexes to the ids another listing printed."""
        index = int(cells[0])
        return cls(index, unique_ids.get(index), cells[temperature_at], cells[power_at], sensor)

    @property
    def temperature_c(self) -> float | None:
        return reading(self.temperature)

    @property
    def power_w(self) -> float | None:
        return reading(self.power)

    @property
    def problems(self) -> list[str]:
        """What is wrong with this GPU under the N/A rule (empty when healthy)."""
        found = []
        if self.temperature_c is None:
            found.append("N/A temperature")
        if self.power_w is None:
            found.append("N/A power")
        return found

    @property
    def healthy(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "unique_id": self.unique_id,
            "temperature": self.temperature,
            "temperature_c": self.temperature_c,
            "temperature_sensor": self.temperature_sensor,
            "power": self.power,
            "power_w": self.power_w,
            "healthy": self.healthy,
            "problems": self.problems,
        }
