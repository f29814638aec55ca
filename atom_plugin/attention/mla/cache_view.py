"""The paged MLA cache [blocks, page, lora + rope] viewed as rows [blocks * page, lora +
rope] for TMA: whether a TMA descriptor can read it in tiles of `block_n` rows, and the
views and descriptors of its latent and rope columns. A tile that starts at a multiple
of `block_n` and does not cross a page is one box of that view. The Triton kernels
(`mla.triton`) and the Gluon kernels (`gluon.lockstep`) read the cache through it.
"""

from __future__ import annotations

import torch

from atom_plugin.attention.dtypes import FP8_DTYPES
from atom_plugin.attention.kept import KeptPerCache, cache_key
from atom_plugin.attention.triton_common import device_has_tma

TMA_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + FP8_DTYPES

# Each layer cache's descriptors (Triton's and Gluon's, by box) and kernel checks
KEPT_PER_CACHE = KeptPerCache()


def tma_problems(kv_cache: torch.Tensor, lora: int, rope: int, block_n: int) -> list[str]:
    """Why TMA descriptors cannot read the cache as [blocks * page, lora + rope] rows
    in tiles of `block_n`; empty when they can."""
    page = kv_cache.shape[1]
    size = kv_cache.element_size()
    problems = []
    if kv_cache.dtype not in TMA_DTYPES:
        problems.append(f"cache dtype {kv_cache.dtype} (tma takes {TMA_DTYPES})")
    if page % block_n:
        problems.append(f"BLOCK_N={block_n} does not divide the block size {page}")
    if kv_cache.stride(2) != 1 or kv_cache.stride(0) != page * kv_cache.stride(1):
        problems.append(f"cache strides {kv_cache.stride()} are not rows of one 2-d view")
    if (kv_cache.stride(1) * size) % 16:
        problems.append(f"cache rows ({kv_cache.stride(1)} elements apart) are not 16-byte aligned")
    if kv_cache.data_ptr() % 16 or (kv_cache.data_ptr() + lora * size) % 16:
        problems.append("the latent or rope columns do not start 16-byte aligned")
    for name, n in (("kv_lora_rank", lora), ("rope", rope)):
        if n < 16 or n & (n - 1):
            problems.append(f"{name}={n} is not a power of two >= 16")
    if kv_cache.is_cuda and not device_has_tma(kv_cache.device):
        problems.append("the GPU has no TMA (needs CUDA compute capability 9.0 or newer)")
    return problems


def use_tma(want: bool | None, kv_cache: torch.Tensor, lora: int, rope: int, block_n: int) -> bool:
    """Whether the Triton kernels load whole tiles through TMA: `want` True requires it
    (raising where the cache rules it out), False never, None where the cache allows it
    on a CUDA GPU (the CPU interpreter takes True, for tests)."""
    if want is False or (want is None and not kv_cache.is_cuda):
        return False
    problems = tma_problems(kv_cache, lora, rope, block_n)
    if want and problems:
        raise ValueError("tma=True cannot read this cache: " + "; ".join(problems))
    return not problems


def cache_row_parts(kv_cache: torch.Tensor, lora: int) -> list[tuple]:
    """The cache viewed as rows [blocks * page, width], cut into its latent and rope
    columns: (view, shape, strides) of each, what a TMA descriptor of a part takes."""
    blocks, page, width = kv_cache.shape
    n, stride = blocks * page, kv_cache.stride(1)
    rows = kv_cache.as_strided((n, width), (stride, 1))
    return [(rows, [n, lora], [stride, 1]), (rows[:, lora:], [n, width - lora], [stride, 1])]


def tma_descriptors(kv_cache: torch.Tensor, lora: int, block_n: int):
    """Triton tensor descriptors of the latent and rope columns of the cache viewed as
    rows, in boxes of `block_n` rows (`mla.gluon.common.cache_descriptors` makes Gluon's),
    made at the first launch over the cache and kept (`attention.kept`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def make() -> list:
        return [
            TensorDescriptor(part, shape, strides, [block_n, shape[1]])
            for part, shape, strides in cache_row_parts(kv_cache, lora)
        ]

    return KEPT_PER_CACHE.get(("triton", cache_key(kv_cache), lora, block_n), make)
