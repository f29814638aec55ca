"""A test-only vLLM general plugin that puts faults and stand-ins into the engines a test starts.

The engine under test runs in processes of its own (a fresh `python -c` per run, or
`vllm serve` with its engine cores), which a monkeypatch in pytest's process never
reaches. `fault_plugin_env` writes a distribution's metadata into a directory and
returns the PYTHONPATH that puts it on an engine's path: it lists
`tests.tbo_harness.engine_faults:install` under vLLM's `vllm.general_plugins` entry
points, which vLLM calls in every process it starts, and names the faults
(`faults.json`, read back by `install`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

DIST = "atom-plugin-test-faults"
FAULTS = "faults.json"
ENTRY_POINT = "tests.tbo_harness.engine_faults:install"
REPO_ROOT = Path(__file__).resolve().parents[2]  # where `tests.tbo_harness` imports from


def fault_plugin_env(
    root: Path, *, miscut: bool = False, rerun_graphs: Sequence[int] | None = None
) -> dict[str, str]:
    """The PYTHONPATH of an engine with these faults; `root`: an empty directory to write into.

    `miscut`: micro-batch 1 of the plugin's MHA backend attends with each request's
    neighbour's context (ATOM's bug). `rerun_graphs`: the split decode buckets the
    runner records on `RerunGraphs` (the CPU build has no CUDA graphs).
    """
    if rerun_graphs is not None and (
        not rerun_graphs or not all(isinstance(b, int) and b >= 1 for b in rerun_graphs)
    ):
        raise ValueError(f"rerun_graphs={rerun_graphs!r}: buckets must be ints >= 1")
    dist_info = Path(root) / "atom_plugin_test_faults-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\natom_plugin_test_faults = {ENTRY_POINT}\n"
    )
    faults = {"miscut": miscut, "rerun_graphs": list(rerun_graphs or [])}
    (dist_info / FAULTS).write_text(json.dumps(faults))
    path = [str(root), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
