"""What hardware and kernel libraries this process can use (no vLLM import)."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def detect_platform() -> str:
    """'rocm', 'cuda' or 'cpu', from the torch build and the devices it sees."""
    import torch

    if torch.version.hip is not None and torch.cuda.is_available():
        return "rocm"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def aiter_available() -> bool:
    return importlib.util.find_spec("aiter") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
