"""Issue 7, CPU part: two ranks over gloo, a real collective in every layer, TBO on == off.

Each rank runs the test model with experts sharded over the two ranks
(all-gather dispatch, all-reduce combine per layer), once with TBO off and
once on, and checks its own outputs and KV cache. Cases include ranks that
schedule different numbers of requests into one bucket; a rank that split
while the other did not would wait on a collective that never comes and
fail on the gloo timeout.
"""

import pytest
import torch
from tbo_harness.dp_workers import model_worker, spawn

BUCKETS = [8, 16, 32, 64]
CASES = [
    ("decode", [25, 30], BUCKETS),  # different counts in bucket 32: replay layout, cut at 16
    ("decode", [3, 17], BUCKETS),  # 3 and 17 in bucket 32
    ("decode", [25, 30], []),  # eager split: cut at 12 and 15, padded to (15, 15)
    ("decode", [2, 40], []),  # rank 0 cannot split eagerly: nobody splits
    ("prefill", [[5, 9, 2], [1, 1, 20, 3]], []),  # token midpoints 8 and 12, padded to (12, 13)
]
EXPECT_SPLIT = [True, True, True, False, True]


def _check(tmp_path, tol):
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, expect in enumerate(EXPECT_SPLIT):
        modes = [per_rank[r][i]["mode_on"] for r in range(2)]
        assert [m.split for m in modes] == [expect, expect]
        assert modes[0].ubatch_num_tokens == modes[1].ubatch_num_tokens
        for r in range(2):
            res = per_rank[r][i]
            assert not res["mode_off"].split
            assert res["scale"] > 0.1  # the outputs are not trivially zero
            assert res["out_diff"] < tol and res["cache_diff"] < tol, (CASES[i], r, res)
    assert [per_rank[r][0]["mode_on"].ubatch_split_bs for r in range(2)] == [32, 32]
    assert per_rank[0][2]["mode_on"].ubatch_num_tokens == (15, 15)


def test_two_ranks_tbo_on_equals_off(tmp_path):
    spawn(model_worker, 2, CASES, str(tmp_path))
    _check(tmp_path, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_two_gpus_nccl_tbo_on_equals_off(tmp_path):
    """Issue 7 on two GPUs (eager): NCCL collectives on the comm stream from the worker threads."""
    spawn(model_worker, 2, CASES, str(tmp_path), "nccl")
    _check(tmp_path, 2e-3)
