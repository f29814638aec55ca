"""The one place that chooses which kernels run an attention call.

Order: AITER (ROCm with `import aiter` working), then the project's Triton
kernels (any GPU), then the torch reference (CPU tensors). `ATOM_PLUGIN_KERNELS`
forces a choice, e.g. to compare paths or to run the reference on a GPU.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

KERNEL_IMPLS: tuple[str, ...] = ("aiter", "triton", "torch")
ENV_VAR = "ATOM_PLUGIN_KERNELS"


@functools.cache
def _aiter_importable() -> bool:
    try:
        importlib.import_module("aiter")
    except Exception:  # a broken AITER install must fall back, not crash serving
        return False
    return True


@functools.cache
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True


def forced_kernel_impl() -> str | None:
    """The implementation named by ATOM_PLUGIN_KERNELS, or None when unset."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in KERNEL_IMPLS:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a kernel implementation; "
            f"choose one of {', '.join(KERNEL_IMPLS)}"
        )
    return value


def select_kernel_impl(device: torch.device) -> str:
    """'aiter', 'triton' or 'torch' for tensors on `device`."""
    forced = forced_kernel_impl()
    if forced is not None:
        return forced
    if device.type == "cpu":
        return "torch"
    if torch.version.hip is not None and _aiter_importable():
        return "aiter"
    if _triton_importable():
        return "triton"
    return "torch"
