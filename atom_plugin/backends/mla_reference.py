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

from atom_plugin.backends.checks import is_fp8


def mla_token_plan(
    meta, num_tokens: int, token_kv_lens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token: its request row (-1: not covered by any request) and how many
    cached keys it sees (int32, on the metadata's device, no host sync).

    Token t of request r (qsl[r] <= t < qsl[r+1]) is query j = t - qsl[r] of q_len, at
    position seq_len - q_len + j, so it sees seq_len - q_len + j + 1 keys. Rows with
    seq_len 0 are inert and see none. `token_kv_lens` replaces the visible counts (decode
    context parallelism, where the cache holds only this rank's share of each context).
    """
    qsl = meta.query_start_loc[: meta.num_reqs + 1]
    device = qsl.device
    t = torch.arange(num_tokens, device=device, dtype=qsl.dtype)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    covered = (req < meta.num_reqs) & (t >= qsl[0])
    req = req.clamp(max=max(meta.num_reqs - 1, 0))
    if token_kv_lens is not None:
        if token_kv_lens.shape[0] < num_tokens:
            raise ValueError(
                f"token_kv_lens has {token_kv_lens.shape[0]} entries for {num_tokens} query tokens"
            )
        kv_len = token_kv_lens[:num_tokens].to(torch.int32)
    else:
        seq = meta.seq_lens[: meta.num_reqs].to(torch.int64)
        q_start = qsl[req].to(torch.int64)
        q_len = qsl[req + 1].to(torch.int64) - q_start
        kv_len = seq[req] - q_len + (t.to(torch.int64) - q_start) + 1
        kv_len = torch.where(seq[req] > 0, kv_len, torch.zeros_like(kv_len))
    kv_len = torch.where(covered, kv_len.clamp(min=0), torch.zeros_like(kv_len)).to(torch.int32)
    req = torch.where(covered, req, torch.full_like(req, -1)).to(torch.int32)
    return req, kv_len


def check_mla_shapes(
    q: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, kv_lora_rank: int
):
    if kv_cache.dim() != 3:
        raise ValueError(
            "MLA cache must be [num_blocks, block_size, kv_lora_rank + rope], "
            f"got {tuple(kv_cache.shape)}"
        )
    width = kv_cache.shape[-1]
    if not 0 < kv_lora_rank < width:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank} must lie in (0, {width}) for a {width}-wide cache"
        )
    if q.dim() != 3 or q.shape[-1] != width:
        raise ValueError(f"q must be [T, H, {width}], got {tuple(q.shape)}")
    if tuple(output.shape) != (q.shape[0], q.shape[1], kv_lora_rank):
        raise ValueError(
            f"output must be [{q.shape[0]}, {q.shape[1]}, {kv_lora_rank}], "
            f"got {tuple(output.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("the MLA cache's last dimension must be contiguous (stride 1)")


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
    *,
    scale,
    output,
    kv_lora_rank=512,
    kv_scale=None,
    token_kv_lens=None,
    token_plan=None,
) -> torch.Tensor:
    """Absorbed MLA decode: output[t, h] = softmax(q[t,h] . K^T * scale) @ V over the keys
    token t sees (see `mla_token_plan`); returns lse [T, H] float32 (natural log, -inf
    for tokens that see no key; their output is zero). Tokens of no request are untouched.
    """
    check_mla_shapes(q, kv_cache, output, kv_lora_rank)
    T, H, _ = q.shape
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    req, kv_len = token_plan if token_plan is not None else mla_token_plan(meta, T, token_kv_lens)
    req_l, len_l = req.tolist(), kv_len.tolist()
    T = min(T, len(req_l))
    block_size = kv_cache.shape[1]
    for r in sorted(set(req_l) - {-1}):
        toks = [t for t in range(T) if req_l[t] == r]
        lens = torch.tensor([len_l[t] for t in toks], device=q.device)
        n_keys = int(lens.max())
        tok_idx = torch.tensor(toks, device=q.device)
        if n_keys == 0:
            output[tok_idx] = 0
            continue
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
