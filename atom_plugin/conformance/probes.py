"""Health probes through `atom-plugin doctor`'s probe contract (`atom_plugin.doctor.probe`).

Contract items:
- shape: the object has `executables`, `commands`, `recognises` and `parse`;
- saved tables: every table of its `saved_tables` is recognised and parses into GPU
  rows, and doctor's verdict on it is a verdict;
- bad text is a verdict: prefixes of the saved tables and noise parse into rows or
  raise `TableError`, nothing else;
- missing tool / hanging tool / failing tool: `check_host` with the tool absent from
  PATH, with a stand-in that never finishes (a 1 s timeout), and with one that exits 3,
  returns an unhealthy verdict and raises nothing (a hang is killed in time).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path

from atom_plugin.conformance.findings import Check, Finding, checks_of
from atom_plugin.specs import HealthProbeSpec

HOOK = "atom_health_probes"
HANG_TIMEOUT_S = 1.0
NOISE = ("", "\n\n", "GPU\n", "Device  Temp  Power\n0  N/A\n", "\x00\xff garbage |||", "ERROR")


def checks_for(module, plugin: str) -> list[Check]:
    return checks_of(module, plugin, HOOK, lambda spec: f"health probe {spec.smi}", check_probe)


def _only(spec: HealthProbeSpec):
    """A plugin manager holding just this probe, so doctor runs it and nothing else."""
    import pluggy

    from atom_plugin import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    plugin = types.SimpleNamespace(atom_health_probes=hookspecs.hookimpl(lambda: [spec]))
    pm.register(plugin, name=f"conformance:{spec.smi}")
    return pm


@contextlib.contextmanager
def _path(folder: str) -> Iterator[None]:
    old = os.environ.get("PATH")
    os.environ["PATH"] = folder
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def check_probe(spec: HealthProbeSpec, label: str) -> Iterator[Finding]:
    from atom_plugin.doctor.check import Verdict, check_host, check_saved
    from atom_plugin.doctor.probe import Probe, TableError

    def finding(item, ok, detail="", case="-"):
        return Finding(label, item, case, ok, detail)

    probe = spec.probe
    if not isinstance(probe, Probe):
        yield finding("shape", False, f"{probe!r} lacks executables, commands, recognises or parse")
        return
    yield finding("shape", True)
    pm = _only(spec)
    tables = dict(getattr(probe, "saved_tables", {}) or {})
    if not tables:
        yield finding("saved tables", False, "the probe ships no saved_tables")
    for name, text in tables.items():
        try:
            problem = None
            if not probe.recognises(text):
                problem = "recognises() says no"
            elif not probe.parse(text):
                problem = "parse() found no GPU rows"
            elif not isinstance(check_saved(text, spec.smi, pm), Verdict):
                problem = "check_saved gave no verdict"
        except Exception as exc:
            problem = f"raised {exc!r}"
        yield finding("saved tables", problem is None, problem or "", name)

    bad_texts = [(f"noise {i}", t) for i, t in enumerate(NOISE)]
    for name, text in tables.items():
        step = max(1, len(text) // 25)
        bad_texts += [(f"{name} cut at {n}", text[:n]) for n in range(0, len(text), step)]
    failure = None
    for case, text in bad_texts:
        try:
            probe.parse(text)
        except TableError:
            pass
        except Exception as exc:
            failure = (case, exc)
            break
    if failure:
        yield finding("bad text is a verdict", False, f"parse raised {failure[1]!r}", failure[0])
    else:
        yield finding("bad text is a verdict", True, f"{len(bad_texts)} texts")

    tool = probe.executables[0] if probe.executables else "missing-tool"
    sleep = shutil.which("sleep") or "/bin/sleep"  # found before PATH is emptied
    for case, body, timeout in (
        ("missing tool", None, 5.0),
        ("hanging tool", f"exec {sleep} 30", HANG_TIMEOUT_S),
        ("failing tool", "echo 'driver not loaded' >&2; exit 3", 5.0),
    ):
        with tempfile.TemporaryDirectory() as folder:
            if body is not None:
                _stand_in(Path(folder), tool, body)
            started = time.monotonic()
            try:
                with _path(folder):
                    verdict = check_host(spec.smi, timeout=timeout, pm=pm)
            except Exception as exc:
                yield finding(f"{case} is a verdict", False, f"check_host raised {exc!r}", case)
                continue
            took = time.monotonic() - started
            ok = isinstance(verdict, Verdict) and not verdict.healthy and took < timeout + 5
            yield finding(f"{case} is a verdict", ok, f"{verdict.reason} ({took:.1f} s)", case)
