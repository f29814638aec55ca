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
