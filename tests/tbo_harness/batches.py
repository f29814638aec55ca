"""Random batches for the TBO test model, and the ways to run a step: unsplit, split, by mode."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from atom_plugin.attention.metadata import PagedAttentionMetadata
from atom_plugin.tbo import ForwardMode, MicroBatchRunner, UBatchSlice, maybe_create_ubatch_slices

from .graph_buffers import pad_decode_rows
from .model import KVCaches, ModelConfig, TboTestModel
from .ubatch_metadata import ubatch_metadata


@dataclass
class Batch:
    """One rank's scheduled step: requests' new tokens and their paged metadata."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    query_lens: list[int]
    meta: PagedAttentionMetadata


def blocks_needed(seq_lens: list[int], block_size: int) -> int:
    return sum(-(-s // block_size) for s in seq_lens)


def make_batch(
    cfg: ModelConfig,
    query_lens: list[int],
    context_lens: list[int],
    max_blocks_per_req: int,
    num_blocks: int,
    device,
    seed: int,
) -> Batch:
    """Requests with `context_lens` cached tokens each get `query_lens` new ones.

    Each request owns distinct random blocks (block 0 is never handed out);
    decodes (query_len 1) must come first, as vLLM orders them.
    """
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens must have one entry per request")
    rng = random.Random(seed)
    bs = cfg.block_size
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    if max(seq_lens, default=0) > max_blocks_per_req * bs:
        raise ValueError(f"a request of {max(seq_lens)} tokens exceeds {max_blocks_per_req} blocks")
    free = list(range(1, num_blocks))
    if blocks_needed(seq_lens, bs) > len(free):
        raise ValueError(f"{blocks_needed(seq_lens, bs)} blocks needed, {len(free)} available")
    rng.shuffle(free)
    table = torch.zeros((len(query_lens), max_blocks_per_req), dtype=torch.int32)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        n = -(-s // bs)
        table[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        for pos in range(s - q, s):
            slots.append(int(table[i, pos // bs]) * bs + pos % bs)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    meta = PagedAttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=qsl[-1],
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    ids = torch.tensor([rng.randrange(1, cfg.vocab) for _ in range(qsl[-1])], device=device)
    return Batch(ids, list(query_lens), meta)


def decode_blocks(context: int, block_size: int) -> int:
    """Blocks one decoding request needs: its `context` cached tokens and the new one."""
    return blocks_needed([context + 1], block_size)


def uniform_decode_batch(cfg, requests, context, num_blocks, device, seed) -> Batch:
    """`requests` decodes with `context` cached tokens each (the benchmarks' batches)."""
    max_blocks = decode_blocks(context, cfg.block_size)
    return make_batch(
        cfg, [1] * requests, [context] * requests, max_blocks, num_blocks, device, seed
    )


def random_decode_batch(cfg, n, max_blocks_per_req, num_blocks, device, seed) -> Batch:
    rng = random.Random(seed)
    ctx = [rng.randrange(0, max_blocks_per_req * cfg.block_size) for _ in range(n)]
    return make_batch(cfg, [1] * n, ctx, max_blocks_per_req, num_blocks, device, seed)


def _pad_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    if ids.shape[0] > n:
        raise ValueError(f"{ids.shape[0]} tokens do not fit {n}")
    return torch.cat([ids, ids.new_zeros(n - ids.shape[0])])


def run_unsplit(model: TboTestModel, batch: Batch, caches: KVCaches, padded_tokens=None):
    """The reference: the whole batch in one forward (padded to `padded_tokens` for DP)."""
    ids = _pad_ids(batch.input_ids, padded_tokens or batch.input_ids.shape[0])
    return model.forward(ids, batch.meta, caches)[: batch.input_ids.shape[0]]


def run_split(
    model: TboTestModel,
    runner: MicroBatchRunner,
    input_ids: torch.Tensor,
    caches: KVCaches,
    slices: tuple[UBatchSlice, UBatchSlice],
    metas: tuple[PagedAttentionMetadata, PagedAttentionMetadata],
) -> torch.Tensor:
    """Two micro-batches on the runner; each runs its slice padded to its agreed count."""
    inputs = [_pad_ids(input_ids[s.token_slice], s.num_padded_tokens) for s in slices]

    def ubatch(ctx):
        return model.forward(inputs[ctx.id], ctx.forward_context, caches)

    outs = runner.run(ubatch, list(metas))
    full = outs[0].new_zeros(input_ids.shape[0], outs[0].shape[1])
    for s, out in zip(slices, outs, strict=True):
        full[s.token_slice] = out[: s.num_tokens]
    return full


def run_step(
    model: TboTestModel,
    runner: MicroBatchRunner,
    batch: Batch,
    caches: KVCaches,
    mode: ForwardMode,
) -> torch.Tensor:
    """One step as `mode` says, eagerly. A replay mode runs the bucket layout the graph holds."""
    n_tokens = batch.input_ids.shape[0]
    meta, ids = batch.meta, batch.input_ids
    if mode.replay:
        meta = pad_decode_rows(meta, mode.bucket)
        ids = _pad_ids(ids, mode.bucket * mode.query_len)
    if not mode.split:
        return model.forward(_pad_ids(ids, mode.num_padded_tokens), meta, caches)[:n_tokens]
    slices = maybe_create_ubatch_slices(mode, batch.query_lens)
    metas = ubatch_metadata(meta, mode, batch.query_lens)
    return run_split(model, runner, ids, caches, slices, metas)[:n_tokens]
