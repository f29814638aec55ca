"""The dtypes the attention kernels take (MHA and MLA), and fp8 helpers."""

from __future__ import annotations

import torch

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
CACHE_DTYPES = ACTIVATION_DTYPES + FP8_DTYPES
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernels read them as float32


def dtype_names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)
