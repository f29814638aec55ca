"""atom_plugin/vllm/ is the only package of atom-plugin that imports vLLM: every other
module imports (and is tested) without it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "atom_plugin"
ADAPTER = PACKAGE / "vllm"


def vllm_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each `import vllm...` / `from vllm... import` in `source`, at any
    depth (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == "vllm" or n.startswith("vllm.")]
    return sorted(found)


def test_only_the_vllm_adapter_imports_vllm():
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if ADAPTER not in p.parents]
    assert len(outside) > 20
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {module}"
        for path in outside
        for line, module in vllm_imports(path.read_text())
    ]
    assert not offenders, "import vLLM only under atom_plugin/vllm/:\n" + "\n".join(offenders)


def test_the_walk_sees_imports_inside_functions():
    source = "import os\ndef f():\n    from vllm.config import X\n    import vllm.v1, json\n"
    assert vllm_imports(source) == [(3, "vllm.config"), (4, "vllm.v1")]


def test_conformance_without_vllm_says_what_it_could_not_check():
    """With vLLM absent the suite still imports; the checks that need vLLM stop with a
    missing dependency (attention) or fail at `resolves` naming the import error."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["vllm"] = None  # as if vLLM were not installed
        from atom_plugin import manager
        from atom_plugin.conformance import MissingDependency, checks
        for check in checks(manager.new_plugin_manager(load_entry_points=False)):
            try:
                failed = [f for f in check.run() if not f.ok]
            except MissingDependency as exc:
                print(check.implementation, "| missing:", exc)
            else:
                print(check.implementation, "|", "; ".join(f"{f.item}: {f.detail}" for f in failed))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(" (")[0]: line for line in proc.stdout.splitlines()}
    for backend in ("ATOM_AITER", "ATOM_AITER_MLA"):
        assert (
            "| missing: attention backends are checked inside vLLM"
            in lines[f"attention backend {backend}"]
        )
    for name in (
        "tool parser atom_kimi_k3",
        "logits processor atom_k3_required_channel [v1]",
        "logits processor atom_k3_required_channel [mrv2]",
    ):
        assert "| resolves: " in lines[name] and "vllm" in lines[name], lines[name]
    assert lines["health probe nvidia"].endswith("| ")  # needs no vLLM: passes
