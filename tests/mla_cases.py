"""Random MLA decode batches (DeepSeek latent cache) shared by the MLA tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from attention_cases import paged_layout

from atom_plugin.attention.dtypes import FP8_DTYPES as FP8
from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.attention.mla.plan import plan_mla_decode


@dataclass
class MLABatch:
    meta: PagedAttentionMetadata
    q: torch.Tensor  # [T (+ padding), H, lora + rope]
    kv_cache: torch.Tensor  # [num_blocks, block_size, lora + rope], strided view
    kv_scale: torch.Tensor | None


def make_mla_batch(
    reqs,
    *,
    heads,
    lora=512,
    rope=64,
    block_size=16,
    dtype=torch.float32,
    cache_dtype=None,
    device="cpu",
    seed=0,
    pad_tokens=0,
    pad_rows=0,
    col_offset=8,
    nan_unused=False,
) -> MLABatch:
    """reqs: [(query_len, seq_len)], laid out by `attention_cases.paged_layout`; the
    cache is a strided view (each row padded by 16 columns, the view starting
    `col_offset` columns in) so kernels must honour strides; 8 keeps 16-bit rows
    16-byte aligned, as TMA needs. `pad_rows` adds inert rows (seq_len 0, no queries);
    `pad_tokens` adds query rows past the requests (their output must be zeros). `nan_unused`
    fills every cache row outside the requests' contexts with NaN, so a kernel that
    reads one past its mask turns its output NaN."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    width = lora + rope
    num_blocks, table, qsl, slots = paged_layout(reqs, block_size, gen, pad_rows=pad_rows)
    backing = torch.randn(num_blocks, block_size, width + 16, generator=gen)
    if nan_unused:
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for r, (_, s) in enumerate(reqs):
            used[context_rows(table, r, s, block_size)] = True
        backing[~used] = float("nan")
    kv_scale = None
    if cache_dtype in FP8:
        kv_scale = torch.tensor([0.5])
        backing = (backing / kv_scale).clamp(-200, 200)
    backing = backing.to(cache_dtype).to(device)
    kv_cache = backing[..., col_offset : col_offset + width]
    t = qsl[-1]
    meta = PagedAttentionMetadata(
        num_reqs=len(reqs) + pad_rows,
        num_actual_tokens=t,
        max_query_len=max((q for q, _ in reqs), default=0),
        max_seq_len=max((s for _, s in reqs), default=0),
        num_decodes=len(reqs) + pad_rows,
        num_decode_tokens=t,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(
            [s for _, s in reqs] + [0] * pad_rows, dtype=torch.int32, device=device
        ),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    q = (torch.randn(t + pad_tokens, heads, width, generator=gen) * 0.5).to(dtype).to(device)
    return MLABatch(meta, q, kv_cache, None if kv_scale is None else kv_scale.to(device))


def context_rows(table: torch.Tensor, r: int, n: int, page: int):
    """Request r's first n cache rows as (block, row in block) index tensors, through its
    row of the block table (a CPU tensor)."""
    pos = torch.arange(n)
    return table[r, pos // page].long(), pos % page


def tolerance(dtype, cache_dtype=None):
    if cache_dtype in FP8:
        return dict(atol=3e-2, rtol=3e-2)
    if dtype == torch.float32:
        return dict(atol=2e-4, rtol=2e-4)
    return dict(atol=2e-2, rtol=2e-2)


# Contexts 1, page - 1, page, page + 1 and long; one- and two-token rows (page 64).
EDGE_REQS = [(1, 1), (1, 63), (1, 64), (1, 65), (1, 9000), (1, 777), (2, 2051), (2, 64), (2, 65)]


def gpu_edge_batch(reqs, heads, cache, block_size=64):
    """A bf16 batch on the GPU with a bf16 or fp8 cache ("bf16" / "fp8"): 2 padding
    rows, 3 padding tokens, NaN in every unused cache row, 16-byte aligned columns."""
    return make_mla_batch(
        reqs,
        heads=heads,
        block_size=block_size,
        dtype=torch.bfloat16,
        cache_dtype=FP8[0] if cache == "fp8" else None,
        device="cuda",
        pad_rows=2,
        pad_tokens=3,
        nan_unused=True,
        col_offset=16 if cache == "fp8" else 8,  # 16-byte aligned columns either way
    )


def ramp_scores(batch: MLABatch, slopes, scale=0.3, tile=64) -> None:
    """Rewrite `batch` in place so that request r's scores move by about `slopes[r]` in
    log2 units every `tile` keys: every query row becomes one vector u (plus 10% noise)
    and each used cache row at position p a small random row plus a_p u / (u . u),
    a_p = p * slopes[r] / tile / (scale * log2 e). A decode that keeps a running max
    must move it (and rescale) as the scores grow; one that never did would take exp2
    of scores far past any float's range."""
    gen = torch.Generator().manual_seed(1)
    q, cache = batch.q, batch.kv_cache
    width = q.shape[-1]
    u = torch.randint(0, 2, (width,), generator=gen).float() * 2 - 1
    noise = torch.randn(q.shape, generator=gen) * 0.1
    q.copy_((u + noise).to(q.dtype))
    unit = 1.0 if batch.kv_scale is None else float(batch.kv_scale)
    page = cache.shape[1]
    table = batch.meta.block_table.cpu()
    for r, slope in enumerate(slopes):
        n = int(batch.meta.seq_lens[r])
        pos = torch.arange(n, dtype=torch.float32)
        a = pos * slope / tile / (scale * 1.4426950408889634)
        rows = torch.randn(n, width, generator=gen) * 0.1 + a[:, None] * u / width
        blocks, slots = context_rows(table, r, n, page)
        cache[blocks.to(cache.device), slots.to(cache.device)] = (rows / unit).to(
            cache.device, cache.dtype
        )


def query_in_parts(q: torch.Tensor, lora: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query as vLLM's MLA layer hands it over: the latent part contiguous, the rope
    part a view into a wider row (vLLM splits it off [T, H, nope + rope])."""
    latent = q[..., :lora].contiguous()
    wide = torch.zeros(*q.shape[:2], 8 + q.shape[-1] - lora, dtype=q.dtype, device=q.device)
    wide[..., 8:] = q[..., lora:]
    return latent, wide[..., 8:]


def plan_for(batch: MLABatch, kernel_impl: str, **kw):
    """`plan_mla_decode` on `kernel_impl` for every query row and head of `batch`, over
    its cache's dtype."""
    T, H, _ = batch.q.shape
    return plan_mla_decode(
        batch.meta, T, H, kernel_impl=kernel_impl, kv_dtype=batch.kv_cache.dtype, **kw
    )


SENTINEL = 7.0  # what an output holds before a decode writes it


def run_decode(path, batch, lora, plan=None, **plan_kw):
    """The decode on `path` ('torch', 'triton', or 'ops': `mla.ops.mla_decode`, which
    plans the step itself when handed no plan), planned from `plan_kw` unless handed
    `plan`; the output starts as SENTINEL."""
    from atom_plugin.attention.mla import ops as mla_ops
    from atom_plugin.attention.mla.reference import mla_decode_reference
    from atom_plugin.attention.mla.triton import mla_decode_triton

    fn = {"torch": mla_decode_reference, "triton": mla_decode_triton, "ops": mla_ops.mla_decode}
    if plan is None and path != "ops":
        plan = plan_for(batch, path, **plan_kw)
    T, H, _ = batch.q.shape
    out = torch.full((T, H, lora), SENTINEL, dtype=batch.q.dtype, device=batch.q.device)
    lse = fn[path](
        batch.q,
        batch.kv_cache,
        batch.meta,
        plan,
        scale=0.3,
        output=out,
        kv_lora_rank=lora,
        kv_scale=batch.kv_scale,
    )
    return out, lse


def check_splits_without_keys(partials, num_tokens: int) -> None:
    """The one decode call's stage-1 partials, as the nan_partials fixture kept them: over
    half the splits had no key, their partials stayed NaN (unwritten), the rest were
    written. Stage 1 visits no padding token, so only the first `num_tokens` rows count."""
    ((mid_o, mid_lse),) = partials
    mid_o, keyless = mid_o[:num_tokens], mid_lse[:num_tokens] == float("-inf")
    assert keyless.sum() > keyless.numel() // 2
    assert mid_o[keyless].isnan().all()  # left unwritten
    assert not mid_o[~keyless].isnan().any()  # written where keyed
