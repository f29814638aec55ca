"""The column relabelling of the 16-row fp8 decode (`gluon.rows16_columns`): every map a
permutation with its inverse, and the views built from a shared layout's bases put each
physical element where the maps say. The kernel itself runs on a Hopper GPU only
(tests/test_mla_gluon.py); its plan is tested here."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from atom_plugin.attention.mla import launch_plan as mla_launch_plan
from atom_plugin.attention.mla.gluon import rows16_columns as cols
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout

MAPS = [
    (cols.latent_column, cols.latent_index, 128),
    (cols.rope_column, cols.rope_index, 16),
    (cols.value_column, cols.value_index, 512),
]


@pytest.mark.parametrize("column, index, size", MAPS)
def test_each_map_is_a_permutation_undone_by_its_inverse(column, index, size):
    assert sorted(column(i) for i in range(size)) == list(range(size))
    assert all(index(column(i)) == i for i in range(size))


def test_a_threads_registers_are_16_consecutive_bytes():
    """The MMA operands' register bits (latent k0, k3, k4, k5 within one half of a warp's
    columns; value n5..n8) run over 16 consecutive cache columns: one 16-byte load each."""
    for t, half in itertools.product(range(4), (0, 1)):
        base = 2 * t + 64 * half  # lane bits k1, k2 and the half, k6
        regs = [sum(bits) for bits in itertools.product((0, 1), (0, 8), (0, 16), (0, 32))]
        run = sorted(cols.latent_column(base + r) for r in regs)
        assert run == list(range(run[0], run[0] + 16)), (t, half)
    for g in range(8):  # lane bits n0..n2
        run = sorted(cols.value_column(g + 32 * r) for r in range(16))
        assert run == list(range(16 * g, 16 * g + 16))


# Offset bases of the cache's TMA boxes in shared memory (Gluon's default NVMMA layouts, as
# `gl.to_linear_layout` gives them for 32 rows): latent [32, 512] with a 128-byte
# swizzle, rope [32, 64] with a 64-byte one.
LATENT_BOX = [
    [0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64],
    [1, 16], [2, 32], [4, 64], [8, 0], [16, 0], [0, 128], [0, 256],
]  # fmt: skip
ROPE_BOX = [
    [0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [1, 0], [2, 16], [4, 32], [8, 0], [16, 0],
]  # fmt: skip


def _apply(bases, offset):
    out = [0] * len(bases[0])
    for i, b in enumerate(bases):
        if offset >> i & 1:
            out = [o ^ v for o, v in zip(out, b, strict=True)]
    return out


@given(offset=st.integers(0, 32 * 512 - 1), rope=st.booleans())
def test_views_put_every_element_where_the_maps_say(offset, rope):
    """Any element of a latent or rope box, through each view, lands at the logical index
    whose physical column the maps give."""
    if rope:
        phys, offset, per_warp, column, kinds = (
            ROPE_BOX,
            offset % (32 * 64),
            16,
            cols.rope_column,
            ("rope", "rope_rows"),
        )
    else:
        phys, per_warp, column, kinds = (
            LATENT_BOX,
            128,
            cols.latent_column,
            ("latent", "latent_rows"),
        )
    row, col = _apply(phys, offset)
    w, kk, r = _apply(cols.view_bases(phys, kinds[0]), offset)
    assert (r, per_warp * w + column(kk)) == (row, col)
    w, r, kk = _apply(cols.view_bases(phys, kinds[1]), offset)
    assert (r, per_warp * w + column(kk)) == (row, col)
    if not rope:
        r, n = _apply(cols.view_bases(phys, "value"), offset)
        assert (r, cols.value_column(n)) == (row, col)


BF16_64 = MLAStepLayout(torch.bfloat16, 64)


def _plan(heads, q_len, fp8=True, layout=BF16_64):
    return mla_launch_plan.plan_launch(
        8, 8 * q_len, q_len, heads, 2048, torch.device("cpu"), fp8_cache=fp8,
        config={"kernel": "gluon", "schedule": "rows16"}, layout=layout,
    )  # fmt: skip


@pytest.mark.parametrize(
    "heads, q_len, groups, chunks", [(16, 1, 1, 1), (128, 1, 8, 1), (16, 2, 1, 2)]
)
def test_rows16_plan_holds_one_token_of_16_heads(monkeypatch, heads, q_len, groups, chunks):
    monkeypatch.setattr(mla_launch_plan, "gluon_mla_problems", lambda device, layout: [])
    launch = _plan(heads, q_len)
    assert (launch.kernel, launch.schedule) == ("gluon", "rows16")
    assert (launch.block_h, launch.tokens) == (16, 1)
    assert (launch.head_groups, launch.token_chunks, launch.block_n, launch.num_warps) == (
        groups, chunks, 32, 4,
    )  # fmt: skip


def test_rows16_refuses_what_it_cannot_run(monkeypatch, triton_version):
    monkeypatch.setattr(mla_launch_plan, "gluon_mla_problems", lambda device, layout: [])
    with pytest.raises(ValueError, match="rows16 schedule takes fp8 caches only"):
        _plan(16, 1, fp8=False)
    with pytest.raises(ValueError, match="512 latent and 64 rope columns, not 256 and 64"):
        _plan(16, 1, layout=MLAStepLayout(torch.bfloat16, 64, kv_lora_rank=256))
    triton_version((3, 6))
    with pytest.raises(ValueError, match="needs Triton 3.7 or newer.*this is Triton 3.6"):
        _plan(16, 1)


def _planned(reqs, q_len, heads=16, fp8=True):
    return mla_launch_plan.plan_launch(
        reqs, reqs * q_len, q_len, heads, 4096, torch.device("cpu"), fp8_cache=fp8, layout=BF16_64
    )


def test_the_plan_picks_rows16_for_one_token_of_16_heads_on_fp8(monkeypatch, triton_version):
    monkeypatch.setattr(mla_launch_plan, "gluon_mla_problems", lambda device, layout: [])
    monkeypatch.setattr(mla_launch_plan, "device_sm_count", lambda device: 132)
    launch = _planned(64, 1)
    assert (launch.kernel, launch.schedule, launch.block_h) == ("gluon", "rows16", 16)
    assert _planned(64, 1, fp8=False).kernel == "packed"  # 16-bit caches keep the packed kernel
    assert _planned(64, 2).schedule != "rows16"  # speculative tokens fill 64-row tiles
    assert _planned(64, 1, heads=128).schedule != "rows16"
    assert _planned(1, 1).kernel == "per_token"  # the smallest steps
    triton_version((3, 6))
    assert _planned(64, 1).kernel == "packed"  # where rows16 cannot compile
