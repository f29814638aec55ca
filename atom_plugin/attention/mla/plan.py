"""MLA decode planning: what the metadata builder works out once per step and every
layer's decode reads (which request each query token belongs to, how many cached rows
it sees, and the Triton kernels' launch: packing and KV split count), and the shape
checks every decode path shares. Plan on the host, run on the device: nothing here
reads the GPU back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom_plugin.attention.dtypes import FP8_DTYPES
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout


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
    if token_kv_lens is None and meta.max_query_len <= 1 and num_tokens == meta.num_reqs:
        # A uniform decode step (query_start_loc is 0, 1, ..., n): token t is request t's
        # only query and sees all of its seq_len keys. Two ops instead of some forty
        # small ones, each a kernel launch and its host cost on every decode step.
        req = torch.arange(num_tokens, device=device, dtype=torch.int32)
        return req, meta.seq_lens[:num_tokens].to(torch.int32)
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


@dataclass(frozen=True)
class MLADecodePlan:
    """One step's decode plan, shared by every layer: per query token its request row
    (-1: none) and visible cached rows (`mla_token_plan`), and the kernel path's launch
    (`mla_launch_plan.TritonMLALaunch` on the Triton path: packing, split count, tiles)."""

    kernel_impl: str
    token_req: torch.Tensor
    token_kv_len: torch.Tensor
    launch: object | None = None


def plan_mla_decode(
    meta,
    num_tokens: int,
    num_heads: int,
    *,
    kernel_impl: str,
    token_kv_lens: torch.Tensor | None = None,
    context: int | None = None,
    kv_dtype: torch.dtype | None = None,
    config: dict | None = None,
    num_splits: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    layout: MLAStepLayout | None = None,
) -> MLADecodePlan:
    """Plan a decode step once, on the host, with no device reads: the token plan and,
    for the Triton kernels, the launch. `context` is the key count the split rule plans
    for (default `meta.max_seq_len`; a CUDA-graph capture passes the longest context the
    graph may replay). `kv_dtype` is the cache's (the Triton launch differs for fp8).
    `out` holds persistent buffers the token plan is copied into, so a captured graph
    reads each step's plan at the same addresses. `layout` (query dtype, cache block
    size and widths) lets the Triton path's plan choose the Gluon kernel."""
    req, kv_len = mla_token_plan(meta, num_tokens, token_kv_lens)
    if out is not None:
        n = req.shape[0]
        if out[0].shape[0] < n:
            raise ValueError(f"plan buffers hold {out[0].shape[0]} tokens, the step has {n}")
        out[0][:n].copy_(req)
        out[1][:n].copy_(kv_len)
        req, kv_len = out[0][:n], out[1][:n]
    launch = None
    if kernel_impl == "triton":
        # imported here: Triton is optional (not installed on every platform) and the
        # torch and AITER paths plan without it
        from atom_plugin.attention.mla.launch_plan import plan_launch

        launch = plan_launch(
            meta.num_reqs,
            num_tokens,
            meta.max_query_len,
            num_heads,
            meta.max_seq_len if context is None else context,
            meta.query_start_loc.device,
            fp8_cache=kv_dtype in FP8_DTYPES,
            config=config,
            num_splits=num_splits,
            layout=layout,
        )
    return MLADecodePlan(kernel_impl, req, kv_len, launch)
