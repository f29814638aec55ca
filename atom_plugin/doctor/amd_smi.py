"""amd-smi: `amd-smi monitor -p -t` for power and temperature, `amd-smi list`
for each GPU's UUID.

The monitor table's titles differ between releases (`GPU_TEMP` or `GPU_T`, an
`XCP` column on partitioned GPUs); cells are right-aligned under their titles:

    GPU  XCP  POWER   GPU_T   MEM_T
      0    0  201 W   46 °C   42 °C

The GPU (hotspot) temperature is judged; MEM_T is memory, not the GPU.
"""

from __future__ import annotations

import re

from atom_plugin.doctor.columns import columns_of, right_aligned_cells
from atom_plugin.doctor.probe import TableError
from atom_plugin.doctor.readings import GpuReading
from atom_plugin.doctor.saved import BundledProbe

_HEADER = re.compile(r"^(?P<prefix>.*?)\bGPU {2,}(?:XCP {2,})?POWER\b")
_TEMPERATURE_TITLES = ("GPU_T", "GPU_TEMP")
_LIST_GPU = re.compile(r"^\s*GPU:\s*(\d+)\s*$")
_LIST_UUID = re.compile(r"^\s*UUID:\s*(\S+)\s*$")


class AmdSmiProbe(BundledProbe):
    executables: tuple[str, ...] = ("amd-smi",)
    arguments = (("monitor", "-p", "-t"), ("list",))

    def recognises(self, text: str) -> bool:
        return _find_header(text.splitlines()) >= 0

    def parse(self, text: str) -> list[GpuReading]:
        lines = text.splitlines()
        header_at = _find_header(lines)
        if header_at < 0:
            return []
        columns = columns_of(lines[header_at], _HEADER.match(lines[header_at]).end("prefix"))
        titles = [c.title for c in columns]
        temp_col = _column_index(titles, _TEMPERATURE_TITLES, "GPU temperature")
        power_col = _column_index(titles, ("POWER",), "power")
        unique_ids = _list_uuids(lines)

        rows = []
        for line in lines[header_at + 1 :]:
            if not line.strip():
                if rows:
                    break
                continue  # some releases print a blank line under the titles
            cells = right_aligned_cells(line, columns)
            if not cells[0].isdigit():
                break
            rows.append(GpuReading.of_row(cells, temp_col, power_col, unique_ids, "hotspot"))
        return rows


def _find_header(lines: list[str]) -> int:
    return next((i for i, line in enumerate(lines) if _HEADER.match(line)), -1)


def _column_index(titles: list[str], names: tuple[str, ...], what: str) -> int:
    for i, title in enumerate(titles):
        if title in names:
            return i
    raise TableError(f"the amd-smi table has no {what} column (columns: {', '.join(titles)})")


def _list_uuids(lines: list[str]) -> dict[int, str]:
    """GPU index -> UUID from `amd-smi list` blocks (`GPU: 0` then `UUID: ...`)."""
    found: dict[int, str] = {}
    current = None
    for line in lines:
        if m := _LIST_GPU.match(line):
            current = int(m.group(1))
        elif (m := _LIST_UUID.match(line)) and current is not None:
            found.setdefault(current, m.group(1))
    return found
