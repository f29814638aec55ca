"""A Hopper Gluon MHA causal prefill (`gluon_prefill_kernel`), a prototype beside
`triton_prefill.paged_prefill` with its semantics for what it supports, not wired into
the plan: `gluon_problems` says why inputs cannot take it (without importing Gluon), and
`gluon_paged_prefill` launches it (or its warp-specialized schedule, `gluon_prefill_ws`,
with config WS), importing the kernel modules at its first launch.
"""

from __future__ import annotations

import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mha.params import AttentionParams

# keys per tile, tiles in flight, S of tile i beside P V of tile i - 1, the warp-specialized
# schedule (`gluon_prefill_ws`, which always overlaps); none timed on a GPU yet
CONFIG = {"BLOCK_N": 128, "STAGES": 2, "OVERLAP": True, "WS": False}
HEAD_SIZES = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)


def gluon_problems(query, key_cache, value_cache, params: AttentionParams, output) -> list[str]:
    """What in these inputs the Gluon prefill does not support; empty when it runs them."""
    problems = []
    if params.sliding_window is not None:
        problems.append(f"sliding_window={params.sliding_window} (no sliding window support)")
    if params.sinks is not None:
        problems.append("sinks (no attention-sink support)")
    if not params.scale > 0:
        problems.append(f"scale={params.scale!r} (needs scale > 0)")
    if key_cache.dtype not in DTYPES or value_cache.dtype not in DTYPES:
        problems.append(
            f"cache dtype {key_cache.dtype}/{value_cache.dtype} (fp8 or other: takes {DTYPES})"
        )
    if query.dtype != key_cache.dtype or output.dtype != query.dtype:
        problems.append(
            f"query/cache/output dtypes {query.dtype}/{key_cache.dtype}/{output.dtype} differ"
        )
    d = query.shape[-1]
    if d not in HEAD_SIZES or key_cache.shape[-1] != d:
        problems.append(f"head size {d} (cache {key_cache.shape[-1]}; takes {HEAD_SIZES})")
    hq, hkv = query.shape[1], key_cache.shape[2]
    if hq % hkv or hq // hkv > 64:
        problems.append(f"{hq} query heads over {hkv} kv heads (needs a group of 1-64)")
    page = key_cache.shape[1]
    if page < 8 or page > 128 or page & (page - 1) or page > CONFIG["BLOCK_N"]:
        problems.append(f"block size {page} (needs a power of two 8-{CONFIG['BLOCK_N']})")
    if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
        problems.append("key and value caches differ in shape or strides")
    st = key_cache.stride()
    if st[3] != 1 or st[0] % st[1] or st[0] // st[1] < page or st[1] % 8 or st[2] % 8:
        problems.append(f"cache strides {st} (needs 16-byte aligned pages of rows, D contiguous)")
    if query.stride(2) != 1 or output.stride(2) != 1:
        problems.append("query or output head dim not contiguous")
    if query.is_cuda and torch.cuda.get_device_capability(query.device)[0] != 9:
        problems.append("the GPU is not a Hopper (needs compute capability 9.x)")
    return problems


def gluon_paged_prefill(
    query,
    key_cache,
    value_cache,
    meta: PagedAttentionMetadata,
    params: AttentionParams,
    output,
    *,
    first_req: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention for rows [first_req, num_reqs) (default: after the decodes), as
    `triton_prefill.paged_prefill`; raises ValueError naming what this kernel lacks."""
    problems = gluon_problems(query, key_cache, value_cache, params, output)
    if problems:
        raise ValueError("gluon_paged_prefill does not support: " + "; ".join(problems))
    first = meta.num_decodes if first_req is None else first_req
    num = meta.num_reqs - first
    if num <= 0 or meta.max_query_len == 0:
        return output
    from atom_plugin.attention.mha import gluon_prefill_kernel

    cfg = {**CONFIG, **(config or {})}
    page = key_cache.shape[1]
    if set(cfg) != set(CONFIG) or cfg["BLOCK_N"] not in (64, 128) or cfg["BLOCK_N"] % page:
        raise ValueError(f"gluon_paged_prefill config {config} (keys {list(CONFIG)}, BLOCK_N 64 "
                         f"or 128 and a multiple of the block size {page})")  # fmt: skip
    gluon_prefill_kernel.launch(
        query, key_cache, value_cache, output, meta, params.scale, first, num, cfg
    )
    return output
