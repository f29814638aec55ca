"""rocm-smi: the concise table, plus `--showuniqueid` to name each GPU.

The concise table has had several title rows across ROCm releases, e.g.

    Device  Node  IDs              Temp        Power     Partitions ...
                  (DID,     GUID)  (Junction)  (Socket)  (Mem, Compute, ID) ...

    Device  [Model : Revision]    Temp    Power  Partitions ...
            Name (20 chars)       (Edge)  (Avg)  (Mem, Compute) ...

    GPU  Temp (DieEdge)  AvgPwr  SCLK ...

Cells are left-aligned under their titles. The temperature column is whichever
`Temp` column the table has (Junction on MI300/MI355, Edge on others).
"""

from __future__ import annotations

import re

from atom_plugin.doctor.columns import Column, columns_of, is_rule, left_aligned_cells
from atom_plugin.doctor.readings import GpuReading
from atom_plugin.doctor.saved import BundledProbe

_HEADER = re.compile(r"^(?P<prefix>.*?)(?:Device|GPU) {2,}")
_TEMPERATURE_TITLES = ("Temp",)
_POWER_TITLES = ("Power", "AvgPwr")
_UNIQUE_ID = re.compile(r"GPU\[(?P<index>\d+)\]\s*:\s*Unique ID:\s*(?P<uid>\S+)")
_SENSOR = re.compile(r"\(([^)]*)\)")


class RocmSmiProbe(BundledProbe):
    executables: tuple[str, ...] = ("rocm-smi",)
    arguments = ((), ("--showuniqueid",))

    def recognises(self, text: str) -> bool:
        lines = text.splitlines()
        return "ROCm System Management Interface" in text or _find_header(lines) is not None

    def parse(self, text: str) -> list[GpuReading]:
        lines = text.splitlines()
        found = _find_header(lines)
        if found is None:
            return []
        header_at, columns = found
        body_at = header_at + 1
        subtitles = [""] * len(columns)
        if body_at < len(lines) and _is_subtitle_line(lines[body_at], columns):
            subtitles = left_aligned_cells(lines[body_at], columns)
            body_at += 1
        titles = [f"{c.title} {s}".strip() for c, s in zip(columns, subtitles, strict=True)]
        temp_col = _first_titled(titles, _TEMPERATURE_TITLES)
        power_col = _first_titled(titles, _POWER_TITLES)
        sensor = _SENSOR.search(titles[temp_col])
        sensor_name = sensor.group(1).lower() if sensor else None
        unique_ids = {int(m["index"]): m["uid"] for m in _UNIQUE_ID.finditer(text)}

        rows = []
        offset = columns[0].start
        if body_at < len(lines) and is_rule(lines[body_at], offset):
            body_at += 1
        for line in lines[body_at:]:
            if is_rule(line, offset) or not line[offset:].strip():
                break
            cells = left_aligned_cells(line, columns)
            if not cells[0].isdigit():
                continue  # e.g. the product-name line under each GPU in ROCm 6.0
            rows.append(GpuReading.of_row(cells, temp_col, power_col, unique_ids, sensor_name))
        return rows


def _find_header(lines: list[str]) -> tuple[int, list[Column]] | None:
    """The concise table's title line: Device (or GPU) first, a Temp and a Power column."""
    for i, line in enumerate(lines):
        if not (match := _HEADER.match(line)):
            continue
        columns = columns_of(line, match.end("prefix"))
        titles = [c.title for c in columns]
        if all(
            _first_titled(titles, starts) >= 0 for starts in (_TEMPERATURE_TITLES, _POWER_TITLES)
        ):
            return i, columns
    return None


def _is_subtitle_line(line: str, columns: list[Column]) -> bool:
    """The second title line: blank under the first column, `(...)` elsewhere."""
    cells = left_aligned_cells(line, columns)
    return not cells[0] and "(" in line


def _first_titled(titles: list[str], starts: tuple[str, ...]) -> int:
    return next((i for i, title in enumerate(titles) if title.startswith(starts)), -1)
