"""Judging a GPU host: pick the vendor tool, run it (or read a saved table), apply the rule.

Unhealthy when no tool is on PATH, the tool fails or times out, it prints no
GPU rows, or any GPU reports N/A temperature or power.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field

import pluggy

from atom_plugin import manager
from atom_plugin.doctor.probe import Probe, TableError
from atom_plugin.doctor.readings import GpuReading
from atom_plugin.doctor.runner import run_tool

AUTO = "auto"
DEFAULT_TIMEOUT_S = 60.0


class UsageError(ValueError):
    """A bad option value; the command line reports it and exits 2."""


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    reason: str
    tool: str | None = None  # the --smi choice that produced the rows
    gpus: list[GpuReading] = field(default_factory=list)

    @property
    def unhealthy_gpus(self) -> list[GpuReading]:
        return [gpu for gpu in self.gpus if not gpu.healthy]

    def as_dict(self) -> dict:
        return {
            "verdict": "healthy" if self.healthy else "unhealthy",
            "reason": self.reason,
            "tool": self.tool,
            "gpus": [gpu.as_dict() for gpu in self.gpus],
        }


def probe_choices(pm: pluggy.PluginManager | None = None) -> dict[str, Probe]:
    """Registered probes by their --smi name, in the order `auto` tries them."""
    probes = {}
    for spec in manager.health_probes(pm):
        if not isinstance(spec.probe, Probe):
            raise TypeError(
                f"health probe {spec.smi!r} ({spec.probe!r}) lacks executables, "
                "commands, recognises or parse"
            )
        probes[spec.smi] = spec.probe
    return probes


def judge(gpus: list[GpuReading], tool: str, label: str | None = None) -> Verdict:
    """The N/A rule over the rows of the tool chosen as `--smi tool` (shown as `label`)."""
    if not gpus:
        return Verdict(False, f"{label or tool} printed no GPU rows", tool)
    bad = [gpu for gpu in gpus if not gpu.healthy]
    if not bad:
        return Verdict(True, f"all {len(gpus)} GPUs report temperature and power", tool, gpus)
    named = "; ".join(
        f"GPU {gpu.index} (unique ID {gpu.unique_id or 'unknown'}): {', '.join(gpu.problems)}"
        for gpu in bad
    )
    return Verdict(False, f"{len(bad)} of {len(gpus)} GPUs report N/A: {named}", tool, gpus)


def check_host(
    smi: str = AUTO, timeout: float = DEFAULT_TIMEOUT_S, pm: pluggy.PluginManager | None = None
) -> Verdict:
    """Run the chosen vendor tool (or the first one on PATH) and judge its output."""
    probes = _select(smi, pm)
    found = [(name, probe, exe) for name, probe in probes.items() if (exe := _which(probe))]
    if not found:
        looked_for = ", ".join(exe for probe in probes.values() for exe in probe.executables)
        return Verdict(False, f"no GPU tool on PATH (looked for {looked_for})")
    name, probe, executable = found[0]

    deadline = time.monotonic() + timeout
    outputs = []
    for argv in probe.commands(executable):
        shown = " ".join([argv[0].rsplit("/", 1)[-1], *argv[1:]])
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = f"`{shown}` did not run: the {timeout:g} s timeout was used up"
            return Verdict(False, reason, name)
        try:
            result = run_tool(argv, remaining)
        except OSError as err:  # e.g. a broken interpreter line or a vanished binary
            return Verdict(False, f"`{shown}` could not be started: {err.strerror}", name)
        if result.timed_out:
            return Verdict(False, f"`{shown}` did not finish within {timeout:g} s; killed", name)
        if result.returncode != 0:
            detail = _last_line(result.stderr) or _last_line(result.stdout) or "no output"
            reason = f"`{shown}` failed with exit status {result.returncode}: {detail}"
            return Verdict(False, reason, name)
        outputs.append(result.stdout)
    return _judge_text("\n".join(outputs), name, probe)


def check_saved(text: str, smi: str = AUTO, pm: pluggy.PluginManager | None = None) -> Verdict:
    """Judge a saved table; with `auto`, the first probe that recognises it reads it."""
    probes = _select(smi, pm)
    if smi == AUTO:
        recognised = {name: probe for name, probe in probes.items() if probe.recognises(text)}
        if not recognised:
            known = ", ".join(probes)
            reason = f"no GPU rows: the saved output is not a table from any of {known}"
            return Verdict(False, reason)
        probes = recognised
    name, probe = next(iter(probes.items()))
    return _judge_text(text, name, probe)


def _select(smi: str, pm: pluggy.PluginManager | None) -> dict[str, Probe]:
    probes = probe_choices(pm)
    if smi == AUTO:
        return probes
    if smi not in probes:
        raise UsageError(f"--smi {smi!r} is not one of {', '.join([AUTO, *probes])}")
    return {smi: probes[smi]}


def _which(probe: Probe) -> str | None:
    return next((path for exe in probe.executables if (path := shutil.which(exe))), None)


def _judge_text(text: str, name: str, probe: Probe) -> Verdict:
    try:
        gpus = probe.parse(text)
    except TableError as err:
        return Verdict(False, str(err), name)
    return judge(gpus, name, probe.executables[0])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
