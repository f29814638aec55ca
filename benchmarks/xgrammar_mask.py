"""xgrammar's side of the K3 logits benchmark: its bitmask apply, and the int32 bitmask that
gives a boolean mask.

The apply comes from an installed xgrammar, or else from its Triton kernel file read out of
a wheel (it needs only torch and triton). A bitmask row is ceil(vocab / 32) int32 words, bit
i of word w allowing id 32w + i, as xgrammar lays it out.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import zipfile

import numpy as np
import torch

XGR_KERNEL = "xgrammar/kernels/apply_token_bitmask_inplace_triton.py"


def load_xgrammar(wheel: str | None):
    """(apply function, where it came from), or (None, why not)."""
    try:
        from importlib.metadata import version

        import xgrammar

        return xgrammar.apply_token_bitmask_inplace, f"xgrammar {version('xgrammar')}"
    except Exception as err:  # any broken install means "not available"
        why = f"import xgrammar failed: {type(err).__name__}"
    if wheel is None:
        return None, why
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(XGR_KERNEL)
    path = os.path.join(tempfile.mkdtemp(), "xgr_bitmask_triton.py")
    with open(path, "wb") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("xgr_bitmask_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.apply_token_bitmask_inplace_triton
    return (lambda logits, bitmask: kernel(logits, bitmask)), f"{os.path.basename(wheel)} kernel"


def pack_bitmask(allowed: np.ndarray, device) -> torch.Tensor:
    """xgrammar's int32 bitmask [rows, ceil(vocab / 32)] of `allowed` ([rows, vocab] bool)."""
    # little bit order: byte b's bit j is id 8b + j (the last byte's spare bits zero); the
    # bytes padded to whole words and read four at a time, little-endian
    packed = np.packbits(allowed, axis=1, bitorder="little")
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
    return torch.from_numpy(packed.view("<i4")).to(device)
