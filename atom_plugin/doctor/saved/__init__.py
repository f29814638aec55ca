"""Saved outputs of each vendor tool on a healthy host (the commands' outputs joined by
newlines, as `atom-plugin doctor` hands them to `parse`); the probes ship them for the
conformance suite."""

from __future__ import annotations

from importlib import resources


def saved_tables(tool: str) -> dict[str, str]:
    """`tool`-*.txt of this folder, by file name."""
    folder = resources.files(__name__)
    return {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.startswith(f"{tool}-") and entry.name.endswith(".txt")
    }


class BundledProbe:
    """A probe of a tool this package ships saved tables of: `saved_tables` are this
    folder's files named after its first executable; `commands` run the executable
    with each of `arguments`."""

    executables: tuple[str, ...]
    arguments: tuple[tuple[str, ...], ...]

    def commands(self, executable: str) -> list[list[str]]:
        return [[executable, *args] for args in self.arguments]

    @property
    def saved_tables(self) -> dict[str, str]:
        return saved_tables(self.executables[0])
