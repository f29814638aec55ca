"""Torch reference for MLA (DeepSeek latent attention): the cache write and the decode.

The MLA cache holds one latent row per token, `[num_blocks, block_size, kv_lora_rank + rope]`
(512 + 64 = 576 for DeepSeek): the first `kv_lora_rank` columns are `kv_c` (which is
both the key's latent part and the value), the rest `k_pe`. Absorbed decode queries
`q [T, H, kv_lora_rank + rope]` score against the whole row and read values from the
`kv_c` columns, so every head shares the same cached rows.

This module is the semantic definition every other path is tested against.
"""

from __future__ import annotations

import torch

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.mla.checks import check_mla_shapes, whole_query
from atom_plugin.attention.mla.plan import TorchMLAPlan, mla_token_plan


def write_mla_kv_reference(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    """kv_cache[slot // bs, slot % bs] = [kv_c | k_pe] for every slot >= 0 (fp8: / scale)."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    rows = torch.cat([kv_c[:n], k_pe[:n]], dim=-1)[valid]
    slots = slots[valid]
    if is_fp8(kv_cache.dtype):
        if scale is None:
            raise ValueError("an fp8 MLA cache needs a scale")
        rows = rows.float() / scale.float()
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = rows.to(kv_cache.dtype)


def mla_decode_reference(
    q,
    kv_cache,
    meta,
    plan: TorchMLAPlan | None = None,
    *,
    scale,
    output,
    kv_lora_rank=512,
    kv_scale=None,
) -> torch.Tensor:
    """Absorbed MLA decode: output[t, h] = softmax(q[t,h] . K^T * scale) @ V over the keys
    token t sees (see `mla_token_plan`); returns lse [T, H] float32 (natural log, -inf
    for tokens that see no key; their output is zero, as is that of tokens of no request:
    every row of `output` is written).
    `plan` (`plan_mla_decode`'s) supplies the token plan; without one it is the
    metadata's own (no per-token key counts).
    """
    check_mla_shapes(q, kv_cache, output, kv_lora_rank)
    q = whole_query(q)
    T, H, _ = q.shape
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    if plan is None:
        plan = TorchMLAPlan(*mla_token_plan(meta, T))
    req_l, len_l = plan.token_req.tolist(), plan.token_kv_len.tolist()
    output.zero_()
    T = min(T, len(req_l))
    block_size = kv_cache.shape[1]
    for r in sorted(set(req_l) - {-1}):
        toks = [t for t in range(T) if req_l[t] == r]
        lens = torch.tensor([len_l[t] for t in toks], device=q.device)
        n_keys = int(lens.max())
        if n_keys == 0:  # its rows stay zero
            continue
        tok_idx = torch.tensor(toks, device=q.device)
        pos = torch.arange(n_keys, device=q.device)
        blocks = meta.block_table[r, pos // block_size].to(torch.int64)
        kv = kv_cache[blocks, pos % block_size].float()
        if is_fp8(kv_cache.dtype):
            kv = kv * kv_scale.float()
        s = torch.einsum("thd,kd->thk", q[tok_idx].float(), kv) * scale
        s = s.masked_fill((pos[None, :] >= lens[:, None])[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - row_lse[..., None].clamp(min=torch.finfo(torch.float32).min))
        out = torch.einsum("thk,kd->thd", p.nan_to_num(0.0), kv[:, :kv_lora_rank])
        output[tok_idx] = out.to(output.dtype)
        lse[tok_idx] = row_lse
    return lse
