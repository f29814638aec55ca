"""A vLLM that lacks what the adapter relies on, in every process a test starts.

vLLM 0.34 removed `VllmConfig.use_v2_model_runner`, and every start with the plugin
installed then failed in the platform's config check. The CPU build is vLLM 0.32, whose
own code still reads that property, so these faults take a name away from the adapter
alone: `missing_for_adapter` makes a class attribute raise AttributeError when code of
`atom_plugin` reads it (vLLM's own reads still work), and `broken_imports` makes modules
fail to import, as a module that imports a name a release dropped would.

`host_faults_env` writes a `sitecustomize.py` that installs the faults at interpreter
start, before vLLM resolves its platform or loads any plugin, and returns the
PYTHONPATH that puts it on a vLLM process's path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FAULTS_ENV = "ATOM_TEST_HOST_FAULTS"
ADAPTER = "atom_plugin."


def host_faults_env(
    root: Path,
    *,
    missing_for_adapter: tuple[tuple[str, str, str], ...] = (),
    broken_imports: tuple[str, ...] = (),
) -> dict[str, str]:
    """The environment of a vLLM process with these faults; `root`: an empty directory.

    `missing_for_adapter`: (module, class, attribute) the adapter cannot read.
    `broken_imports`: modules whose import raises ImportError.
    """
    hook = "from tests.host_faults import install\ninstall()\n"
    (Path(root) / "sitecustomize.py").write_text(hook)
    faults = {"missing_for_adapter": list(missing_for_adapter), "broken_imports": broken_imports}
    path = [str(root), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), FAULTS_ENV: json.dumps(faults)}


def install() -> None:
    """Install the faults named in FAULTS_ENV (sitecustomize calls this at start)."""
    faults = json.loads(os.environ.get(FAULTS_ENV, "{}"))
    missing: dict[str, list[tuple[str, str]]] = {}
    for module, cls, attr in faults.get("missing_for_adapter", []):
        missing.setdefault(module, []).append((cls, attr))
    broken = set(faults.get("broken_imports", []))
    if missing or broken:
        sys.meta_path.insert(0, _Faults(missing, broken))


def _read_by_adapter() -> bool:
    """True when the attribute read comes from the plugin's code (two frames up: the
    property's getter, then the reader)."""
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", "").startswith(ADAPTER)


def _hide(cls: type, attr: str) -> None:
    original = cls.__dict__[attr]

    def getter(self):
        if _read_by_adapter():
            raise AttributeError(f"'{cls.__name__}' object has no attribute '{attr}'")
        return original.__get__(self, type(self))

    setattr(cls, attr, property(getter))


class _Faults(importlib.abc.MetaPathFinder):
    def __init__(self, missing: dict, broken: set[str]) -> None:
        self.missing = missing
        self.broken = broken

    def find_spec(self, name, path=None, target=None):
        if name in self.broken:
            raise ImportError(f"cannot import {name} (a fault of tests.host_faults)")
        if name not in self.missing:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, hidden = spec.loader.exec_module, self.missing[name]

        def exec_module(module):
            run(module)
            for cls, attr in hidden:
                _hide(getattr(module, cls), attr)

        spec.loader.exec_module = exec_module
        return spec
