"""MLA decode planning: what the metadata builder works out once per step and every
layer's decode reads (which request each query token belongs to, how many cached rows
it sees), and the shape checks every decode path shares. No kernel lives here.
"""

from __future__ import annotations

import torch


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
