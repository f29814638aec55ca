"""The Triton MLA decode's launch policy (`launch_plan`): split counts, merge columns
and the stage-1 kernel choice, against the H200 measurements behind them."""

import pytest
import torch

from atom_plugin.attention.mla import launch_plan as mla_launch_plan


@pytest.mark.parametrize(
    "programs,tiles,want",
    [
        (64, 64, 2),  # batch 32 x 4K on 132 SMs: one full wave, the sweep's fastest
        (64, 512, 2),  # batch 32 x 32K
        (256, 64, 1),  # batch 128 x 4K: two waves already
        (2, 64, 64),  # batch 1 x 4K: as many splits as there are key tiles (capped: 64)
        (2, 512, 64),  # batch 1 x 32K: 128 programs, one wave
        (1, 512, 128),  # one head group at batch 1 x 32K
        (4096, 8, 1),
        (1, 1, 1),
    ],
)
def test_split_count_fills_whole_waves(programs, tiles, want):
    assert mla_launch_plan.best_num_splits(programs, tiles, 132) == want


@pytest.mark.parametrize(
    "rows,splits,want",
    [
        (16, 64, 32),
        (16, 256, 32),
        (1, 8, 32),
        (64, 128, 64),
        (65, 2, 64),
        (66, 64, 512),
        (128, 64, 512),
        (128, 65, 128),
        (132, 256, 512),
        (4096, 8, 512),
    ],
)
def test_merge_columns_narrow_only_for_few_rows(rows, splits, want):
    """132 SMs: below half the SMs' worth of rows, programs narrowed to two waves;
    above, whole rows, except 128 columns for fewer rows than SMs in chunked merges."""
    assert mla_launch_plan.merge_block_dv(rows, splits, 132) == want


@pytest.mark.parametrize(
    "splits,want",
    [(1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (33, 64), (64, 64), (65, 64), (256, 64)],
)
def test_merge_tile_is_the_split_counts_power_of_two(splits, want):
    """The merge's split tile holds the splits in one pass up to MERGE_BLOCK_S (no 64-row
    tile for 2 splits, issue #26); above, 64 at a time; the plan carries it."""
    assert mla_launch_plan.merge_block_s(splits) == want
    cpu = torch.device("cpu")
    for cfg in ({"kernel": "packed"}, {"kernel": "per_token"}):
        launch = mla_launch_plan.plan_launch(4, 4, 1, 16, 32768, cpu, config=cfg, num_splits=splits)
        assert launch.num_splits == splits and launch.merge_block_s == want


def test_split_count_keeps_64_keys_per_split():
    """Batch 1 x 4K at 16 heads (128 tiles of 32 keys, two programs per SM): 64 splits,
    not the 128 the wave rule alone would take."""
    assert mla_launch_plan.best_num_splits(1, 128, 264) == 128
    assert mla_launch_plan.best_num_splits(1, 128, 264, most=64) == 64
    launch = mla_launch_plan.plan_launch(1, 1, 1, 16, 4096, torch.device("cpu"), config={})
    assert launch.num_splits <= 4096 // mla_launch_plan.MIN_KEYS_PER_SPLIT


@pytest.mark.parametrize(
    "heads,reqs,context,packed_splits,want",
    [
        (16, 1, 4096, 64, "per_token"),  # the smallest step: the older kernel was 5% faster
        (16, 1, 32768, 128, "packed"),
        (16, 32, 4096, 8, "packed"),
        (64, 1, 32768, 128, "packed"),  # more splits than the per-token merge takes
        (64, 32, 32768, 4, "per_token"),
        (128, 1, 32768, 64, "per_token"),
    ],
)
def test_kernel_choice_follows_the_measurements(heads, reqs, context, packed_splits, want):
    assert mla_launch_plan.choose_kernel(heads, reqs, context, packed_splits) == want


def test_plan_names_the_kernel_it_chose():
    """Auto picks per the rule; a config naming no kernel tunes the packed one; a bad
    name or an fp8 TMA request on the per-token kernel is refused."""
    cpu = torch.device("cpu")
    assert mla_launch_plan.plan_launch(1, 1, 1, 16, 4096, cpu).kernel == "per_token"
    assert mla_launch_plan.plan_launch(1, 1, 1, 16, 4096, cpu, config={"num_stages": 2}).kernel == (
        "packed"
    )
    with pytest.raises(ValueError, match="kernel must be one of"):
        mla_launch_plan.plan_launch(1, 1, 1, 16, 4096, cpu, config={"kernel": "fast"})
    with pytest.raises(ValueError, match="pointer loads only"):
        mla_launch_plan.plan_launch(
            1, 1, 1, 64, 4096, cpu, fp8_cache=True, config={"kernel": "per_token", "tma": None}
        )
    with pytest.raises(ValueError, match=r"unknown per_token .* \['BLOCK_M'\]"):
        mla_launch_plan.plan_launch(
            1, 1, 1, 64, 4096, cpu, config={"kernel": "per_token", "BLOCK_M": 8}
        )


def test_every_planned_triton_variant_fits_a_hopper_sm():
    """The Triton MLA kernels, compiled for sm_90 without a GPU (Triton's compiler and
    ptxas only) on the plan's default configurations: 16 and 128 heads, one, two and
    four query tokens a request, 16-bit and fp8 caches. None may need more shared memory
    than an SM grants (a 16-bit cache at four tokens asked 296 KB once). With `--loops`
    each variant's tile loops are printed too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "gluon_sm90_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(script), "--triton", "--loops"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "OVER THE LIMIT" not in proc.stdout
    # the four-token 16-bit variant ran through the compiler
    assert "BLOCK_H=16 TOKENS=4 BLOCK_N=64 IS_FP8=False" in proc.stdout
    # --loops: each variant's KV-tile loops, disassembled and counted
    assert any("HMMA" in line for line in proc.stdout.splitlines() if "  loop at 0x" in line)
