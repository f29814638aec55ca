"""What every Gluon kernel here shares: the CTA-wide barrier across Triton versions and the
host's TMA descriptors in the default shared layout of their box.

Imports Gluon, which exists only in newer Tritons: only kernel modules and their
launchers import this module, at the first launch.
"""

from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# The CTA-wide barrier is gl.thread_barrier up to Triton 3.6 and gl.barrier from 3.7.
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

_GLUON_DTYPES = {  # a torch dtype -> Gluon's name of it
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8e4nv",
}


def tma_descriptor(base: torch.Tensor, shape: list, strides: list, box: list):
    """A Gluon TMA descriptor of `shape` / `strides` from `base`'s first element, read in
    boxes of `box` laid out in shared memory as Gluon's default for the box."""
    gdt = getattr(gl, _GLUON_DTYPES[base.dtype])
    layout = gl.NVMMASharedLayout.get_default_for(box, gdt)
    return TensorDescriptor(base, shape, strides, box, layout)
