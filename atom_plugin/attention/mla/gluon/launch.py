"""The Gluon MLA decode's stage-1 launch (`run_stage1`): the cache's TMA descriptors and
the kernel of the launch's schedule (`gluon.lockstep`, `gluon.alternate`, `gluon.scorer`
or `gluon.rows16`).

Imports Gluon, through the kernels: the Triton launcher (`mla.triton`) imports this module
at the first Gluon launch, so the plan, the probe and `atom-plugin info` never do.
"""

from __future__ import annotations

import torch

from atom_plugin.attention.mla.gluon import alternate, lockstep, rows16, scorer, shapes
from atom_plugin.attention.mla.gluon.common import cache_descriptors


def run_stage1(
    q_c, q_pe, kv_cache, block_table, qsl, num_reqs, kv_len, mid_o, mid_lse, kv_scale, scale,
    launch, lora,
):  # fmt: skip
    """Launch stage 1 on the grid of `launch` (`mla.launch_plan.TritonMLALaunch`, kernel
    'gluon') in its schedule; `q_c` / `q_pe` are the query's latent and rope parts
    (`mla.checks.query_parts`), `mid_o` / `mid_lse` the merge's partials (or the output
    and lse themselves at one split). Both kernels take the same arguments but for the
    lockstep one's kv scale and stage count."""
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    grid = (launch.head_groups, launch.num_splits, num_reqs * launch.token_chunks)
    plan = (block_table, qsl, kv_len, mid_o, mid_lse)
    sizes = (float(scale), q_c.shape[1], launch.num_splits, launch.token_chunks)
    strides = (
        q_c.stride(0),
        q_c.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        block_table.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
    )
    shape = dict(
        PAGE=page, LORA=lora, ROPE=width - lora, BLOCK_H=launch.block_h, TOKENS=launch.tokens
    )
    if launch.schedule in ("alternate", "scorer"):
        kernel = alternate if launch.schedule == "alternate" else scorer
        descs = cache_descriptors(kv_cache, lora, shapes.CHUNK_COLS)
        kernel.stage1[grid](
            q_c,
            q_pe,
            *descs,
            *plan,
            *sizes,
            *strides,
            **shape,
            num_warps=shapes.ALTERNATE_NUM_WARPS,
            maxnreg=shapes.ALTERNATE_MAXNREG,
        )
        return
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if launch.schedule == "rows16":
        rows16.stage1[grid](
            q_c,
            q_pe,
            *cache_descriptors(kv_cache, lora, box_rows=launch.block_n),
            *plan,
            kv_scale,
            *sizes,
            *strides,
            **shape,
            STAGES=launch.num_stages,
            num_warps=launch.num_warps,
        )
        return
    lockstep.stage1[grid](
        q_c,
        q_pe,
        *cache_descriptors(kv_cache, lora),
        *plan,
        kv_scale if fp8 else q_c,
        *sizes,
        *strides,
        **shape,
        STAGES=launch.num_stages,
        IS_FP8=fp8,
        num_warps=shapes.NUM_WARPS,
    )
