"""Cutting fixed-width text tables into cells by the positions of their titles.

Splitting rows on whitespace does not work for these tables: cells hold spaces
(`0x74b5,   21947`, `NPS1, SPX, 0`, `126 W`) and an empty cell would shift every
cell after it. The title line tells where each column sits instead: rocm-smi
left-aligns a cell under the start of its title, amd-smi right-aligns it under
the end. A constant-width prefix on every line (a CI log's timestamps) moves
titles and cells alike, so it does not matter.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

# A title is words separated by single spaces; columns are two or more apart.
_TITLE = re.compile(r"\S+(?: \S+)*")


@dataclass(frozen=True)
class Column:
    title: str
    start: int
    end: int


def columns_of(header: str, start: int = 0) -> list[Column]:
    """The columns named on a title line from `start` (past any prefix), left to right."""
    return [Column(m.group(), m.start(), m.end()) for m in _TITLE.finditer(header, start)]


def left_aligned_cells(line: str, columns: list[Column]) -> list[str]:
    """Cells of a row whose values start where their titles start."""
    bounds = [c.start for c in columns] + [max(len(line), columns[-1].end)]
    return [line[a:b].strip() for a, b in itertools.pairwise(bounds)]


def right_aligned_cells(line: str, columns: list[Column]) -> list[str]:
    """Cells of a row whose values end where their titles end."""
    bounds = [columns[0].start] + [c.end for c in columns]
    cells = [line[a:b].strip() for a, b in itertools.pairwise(bounds)]
    # The first value may reach left of its title (a three-digit GPU index).
    cells[0] = line[: columns[0].end].strip().split(" ")[-1]
    return cells


def is_rule(line: str, offset: int = 0) -> bool:
    """A line of `=` (rocm-smi's separators), after a prefix of `offset` chars."""
    text = line[offset:].strip()
    return bool(text) and set(text) == {"="}
