"""Paged-attention batches: the builders every MHA test uses and the named batch specs
the conformance suite runs each registered backend on (decodes first, as vLLM orders
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom_plugin.attention.dtypes import is_fp8
from atom_plugin.attention.metadata import PagedAttentionMetadata


def paged_layout(reqs, block_size, gen, *, extra_blocks=3, pad_rows=0):
    """Block tables, query starts and slots for reqs [(query_len, seq_len)].

    Blocks are a shuffled permutation of a pool of `extra_blocks` more than needed, so
    tables are neither contiguous nor ordered; entries past a context point at a junk
    block that must never be read. `pad_rows` rows follow the requests, with no queries
    and another junk block. Returns (num_blocks, table, qsl, slots).
    """
    blocks_per_req = [max(1, -(-s // block_size)) for _, s in reqs]
    max_blocks = max(blocks_per_req, default=1)
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(reqs) + pad_rows, max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_req):
        table[i, :nb] = perm[used : used + nb].to(torch.int32)
        table[i, nb:] = int(perm[-1])
        used += nb
    if pad_rows:
        table[len(reqs) :] = int(perm[-2])
    qsl, slots = [0], []
    for i, (q, s) in enumerate(reqs):
        qsl.append(qsl[-1] + q)
        for p in range(s - q, s):
            slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
    qsl += [qsl[-1]] * pad_rows
    return num_blocks, table, qsl, slots


def vllm_kv_cache(num_blocks, block_size, hkv, d, dtype, device="cpu", gen=None):
    """A cache laid out as vLLM 0.32 hands it, [nb, Hkv, bs, 2D], split into K/V views.

    Returns (raw, key_cache, value_cache); the views are [nb, bs, Hkv, D] and strided.
    """
    raw = torch.randn(num_blocks, hkv, block_size, 2 * d, generator=gen)
    if is_fp8(dtype):
        raw = raw.clamp(-8, 8)
    raw = raw.to(dtype).to(device)
    key_cache, value_cache = raw.transpose(1, 2).split(d, dim=-1)
    return raw, key_cache, value_cache


@dataclass
class Batch:
    meta: PagedAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor  # the new tokens' K [T, Hkv, D]
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    raw_cache: torch.Tensor


def make_batch(
    reqs,
    *,
    hq,
    hkv,
    d,
    block_size,
    dtype=torch.float32,
    cache_dtype=None,
    device="cpu",
    seed=0,
    extra_blocks=3,
    pad_tokens=0,
    drop_slots=(),
) -> Batch:
    """reqs: [(query_len, seq_len)], decodes (query_len 1) first.

    The paged layout is `paged_layout`'s; `pad_tokens` adds query rows past
    num_actual_tokens; `drop_slots` marks those token indices' slots negative.
    """
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    num_blocks, table, qsl, slots = paged_layout(reqs, block_size, gen, extra_blocks=extra_blocks)
    t = qsl[-1]
    for j in drop_slots:
        slots[j] = -1
    raw, key_cache, value_cache = vllm_kv_cache(
        num_blocks, block_size, hkv, d, cache_dtype, device, gen
    )
    num_decodes = 0
    for q, _ in reqs:
        if q != 1:
            break
        num_decodes += 1
    meta = PagedAttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=t,
        max_query_len=max((q for q, _ in reqs), default=0),
        max_seq_len=max((s for _, s in reqs), default=0),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    query = torch.randn(t + pad_tokens, hq, d, generator=gen).to(dtype).to(device)
    key = torch.randn(t + pad_tokens, hkv, d, generator=gen).to(dtype).to(device)
    value = torch.randn(t + pad_tokens, hkv, d, generator=gen).to(dtype).to(device)
    return Batch(meta, query, key, value, key_cache, value_cache, raw)


def tolerance(dtype, cache_dtype=None):
    if cache_dtype is not None and is_fp8(cache_dtype):
        return dict(atol=3e-2, rtol=3e-2)
    if dtype == torch.float32:
        return dict(atol=2e-4, rtol=2e-4)
    if dtype == torch.bfloat16:
        return dict(atol=2e-2, rtol=2e-2)
    return dict(atol=5e-3, rtol=5e-3)


@dataclass(frozen=True)
class BatchSpec:
    """One shared case: requests [(query_len, seq_len)], heads, and padding.

    `pad_tokens` query rows follow the scheduled tokens, as in a padded (graph) batch:
    their slots are -1, and no request covers them.
    """

    name: str
    reqs: tuple[tuple[int, int], ...]
    hq: int = 4
    hkv: int = 4
    pad_tokens: int = 0
    seed: int = 0
    notes: str = field(default="", compare=False)

    def build(self, *, d: int, block_size: int, dtype=torch.float32, device="cpu") -> Batch:
        return make_batch(
            list(self.reqs),
            hq=self.hq,
            hkv=self.hkv,
            d=d,
            block_size=block_size,
            dtype=dtype,
            device=device,
            seed=self.seed,
            pad_tokens=self.pad_tokens,
        )


ATTENTION_CASES: tuple[BatchSpec, ...] = (
    BatchSpec("decode", ((1, 17), (1, 33), (1, 5)), notes="one new token per request"),
    BatchSpec("prefill", ((7, 7), (13, 13)), seed=1, notes="whole prompts, no cache"),
    BatchSpec("chunked_prefill", ((5, 21), (9, 40)), seed=2, notes="new chunks over cached rows"),
    BatchSpec("mixed", ((1, 20), (1, 3), (6, 19), (4, 4)), seed=3, notes="decodes then prefills"),
    BatchSpec("gqa", ((1, 30), (5, 18)), hq=8, hkv=2, seed=4, notes="4 query heads per kv head"),
    BatchSpec("odd_lengths", ((1, 1), (3, 31), (1, 47), (11, 11)), seed=5, notes="odd sizes"),
    BatchSpec(
        "padding_rows",
        ((1, 9), (1, 26), (3, 14)),
        pad_tokens=5,
        seed=6,
        notes="5 padded query rows past the scheduled tokens, slots -1",
    ),
)
