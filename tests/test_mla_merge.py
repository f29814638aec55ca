"""The Triton MLA decode's split merge (`_mla_decode_stage2`) at every split count, in
the plan's split tile (`launch_plan.merge_block_s`), against the torch reference; under
TRITON_INTERPRET=1 on CPU."""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from mla_cases import check_splits_without_keys, make_mla_batch, tolerance  # noqa: E402

from atom_plugin.attention.mla.plan import plan_mla_decode  # noqa: E402
from atom_plugin.attention.mla.reference import mla_decode_reference  # noqa: E402
from atom_plugin.attention.mla.triton import mla_decode_triton  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors for the Triton interpreter"
)

SENTINEL = 7.0
REQS = [(1, 300), (2, 41)]  # 300 keys: up to 19 non-empty 16-key splits
LORA = 32


def _batch():
    return make_mla_batch(REQS, heads=16, lora=LORA, rope=16, pad_rows=1, pad_tokens=2)


def _plan(b, splits):
    T, H, _ = b.q.shape
    return plan_mla_decode(
        b.meta, T, H, kernel_impl="triton", config={"BLOCK_N": 16}, num_splits=splits
    )


def _check(b, plan):
    """The Triton decode under `plan` against the reference; padding rows zeroed (every
    row is written: the outputs start as a sentinel)."""
    T, H, _ = b.q.shape
    outs = []
    for fn in (mla_decode_reference, mla_decode_triton):
        out = torch.full((T, H, LORA), SENTINEL)
        lse = fn(b.q, b.kv_cache, b.meta, plan, scale=0.3, output=out, kv_lora_rank=LORA)
        outs.append((out, lse))
    (want_out, want_lse), (out, lse) = outs
    torch.testing.assert_close(out, want_out, **tolerance(torch.float32))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))
    assert (out[b.meta.num_actual_tokens :] == 0).all()
    assert (lse[b.meta.num_actual_tokens :] == float("-inf")).all()


@pytest.mark.parametrize("splits", range(2, 71))
def test_merge_over_split_counts(splits):
    """Every split count from 2 to 70: one pass in the plan's power-of-two tile (which
    must hold every split: a smaller one-pass tile would drop the rest), the chunked loop
    above 64; empty splits (-inf lse) from 20 on."""
    b = _batch()
    plan = _plan(b, splits)
    block_s = plan.launch.merge_block_s
    assert block_s == min(64, 1 << (splits - 1).bit_length())
    _check(b, plan)


@pytest.mark.parametrize("splits,block_s", [(5, 2), (9, 4), (19, 8)])
def test_merge_chunks_a_narrow_tile(splits, block_s):
    """A tile narrower than the split count (a plan changed by hand) takes the chunked
    loop, its last chunk partly masked, and still merges every split."""
    b = _batch()
    plan = _plan(b, splits)
    launch = dataclasses.replace(plan.launch, merge_block_s=block_s)
    _check(b, dataclasses.replace(plan, make_launch=lambda: launch))


@pytest.mark.parametrize("kernel", ["per_token", "packed"])
def test_splits_without_keys_are_neither_written_nor_read(nan_partials, kernel):
    """Many more splits than keys (as a graph planned for a long context replays a short
    one): splits past a row's keys write only lse -inf, their partials stay as they were
    (NaN here) and the merge, which does not read them, still matches the reference."""
    b = _batch()
    T, H, _ = b.q.shape
    plan = plan_mla_decode(
        b.meta, T, H, kernel_impl="triton", config={"kernel": kernel, "BLOCK_N": 16},
        num_splits=64,
    )  # fmt: skip
    _check(b, plan)
    # 300 keys fill 19 of 64 16-key splits
    check_splits_without_keys(nan_partials, b.meta.num_actual_tokens)
