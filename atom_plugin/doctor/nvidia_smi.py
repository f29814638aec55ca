"""nvidia-smi: `--query-gpu=index,uuid,temperature.gpu,power.draw --format=csv`.

    index, uuid, temperature.gpu, power.draw [W]
    0, GPU-3a1f9e02-4c11-4b8a-9e2d-7f6b1c0a55e1, 34, 68.21 W

A sensor without a reading shows as `[N/A]`, `[Not Supported]` or an error in
brackets (`[Unknown Error]`, `[GPU is lost]`).
"""

from __future__ import annotations

import csv
import re

from atom_plugin.doctor.readings import GpuReading
from atom_plugin.doctor.saved import BundledProbe

QUERY_FIELDS: tuple[str, ...] = ("index", "uuid", "temperature.gpu", "power.draw")
# Where the CSV starts on its title line (a saved CI log puts timestamps before it).
_HEADER_START = re.compile(r"(?:^|\s)(index\s*,)")


class NvidiaSmiProbe(BundledProbe):
    executables: tuple[str, ...] = ("nvidia-smi",)
    arguments = ((f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv"),)

    def recognises(self, text: str) -> bool:
        return _find_header(text.splitlines()) is not None

    def parse(self, text: str) -> list[GpuReading]:
        lines = text.splitlines()
        found = _find_header(lines)
        if found is None:
            return []
        header_at, prefix, names = found
        at = {field: names.index(field) for field in QUERY_FIELDS}
        rows = []
        for line in lines[header_at + 1 :]:
            cells = _fields(line[prefix:])
            if len(cells) != len(names) or not cells[at["index"]].isdigit():
                break
            rows.append(
                GpuReading(
                    index=int(cells[at["index"]]),
                    unique_id=cells[at["uuid"]] or None,
                    temperature=cells[at["temperature.gpu"]],
                    power=cells[at["power.draw"]],
                    temperature_sensor="gpu",
                )
            )
        return rows


def _fields(line: str) -> list[str]:
    return [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True), [])]


def _find_header(lines: list[str]) -> tuple[int, int, list[str]] | None:
    """The CSV title line, the width of the prefix before it, and its field names
    (units such as ` [W]` dropped)."""
    for i, line in enumerate(lines):
        start = _HEADER_START.search(line)
        if not start:
            continue
        names = [cell.split(" [")[0] for cell in _fields(line[start.start(1) :])]
        if all(field in names for field in QUERY_FIELDS):
            return i, start.start(1), names
    return None
