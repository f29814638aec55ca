"""atom_plugin/vllm/ is the only package of atom-plugin that imports vLLM: every other
module imports (and is tested) without it."""

from __future__ import annotations

import ast
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
