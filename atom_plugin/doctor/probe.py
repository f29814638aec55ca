"""What a health probe is: the contract a vendor tool's hook implementation fills.

A third party adds a vendor's tool by returning
`HealthProbeSpec(smi="name", probe=obj)` from an `atom_health_probes` hook,
where `obj` has the attributes below. `atom-plugin doctor` runs every command
line in order, joins their outputs with newlines and hands the text to
`parse`; a saved table (`--smi-output FILE`) goes to `parse` as it is.

A probe should also ship `saved_tables`, {name: text} of the tool's output on real
hosts: the conformance suite (`atom-plugin conformance`) parses them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from atom_plugin.doctor.readings import GpuReading


class TableError(ValueError):
    """The text has the tool's table, but not in a shape that can be judged."""


@runtime_checkable
class Probe(Protocol):
    #: Executable names to look for on PATH, preferred first.
    executables: tuple[str, ...]

    def commands(self, executable: str) -> list[list[str]]:
        """The command lines to run, `executable` being the path found on PATH."""
        ...

    def recognises(self, text: str) -> bool:
        """Whether `text` (a saved log or file) holds this tool's table."""
        ...

    def parse(self, text: str) -> list[GpuReading]:
        """One reading per GPU row in `text`; [] when there are no rows.

        Raises TableError when the table is there but cannot be read.
        """
        ...
