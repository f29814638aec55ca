"""Issue 7: the two-rank TBO benchmark (smoke run over gloo) and TBO on == off on replay.

The benchmark runs on CPU with two gloo processes at a tiny size: every batch
and execution gets a row, and TBO on equals TBO off on both ranks before any
timing. The replay tests step two ranks through request graphs with each
step's mode agreed across them, including ranks that schedule different
numbers of requests (or none) into one bucket: on CPU the recorded step is
re-run on its static buffers, on two GPUs the NCCL collectives are captured
inside CUDA graphs from the runner's worker threads.
"""

import json

import pytest
import torch
from tbo_harness.dp_workers import replay_worker, spawn

from benchmarks import tbo_dp


@pytest.mark.parametrize("overlap", ["per_comm", "staged"])
def test_benchmark_two_gloo_ranks_rows_and_equality(tmp_path, overlap):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    argv = ["--backend", "gloo", "--device", "cpu", "--batches", "3", "8", "--iters", "1"]
    argv += ["--overlap", overlap]
    assert tbo_dp.main([*argv, "--out", str(md), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    rows = report["rows"]
    assert [(r["batch"], r["execution"]) for r in rows] == [
        (3, "eager"),
        (3, "replay"),
        (8, "eager"),
        (8, "replay"),
    ]
    for r in rows:
        assert r["rel_err"] <= 1e-4
        assert r["ubatch_num_tokens"] == [r["batch"] // 2, r["batch"] - r["batch"] // 2]
        for key in ("tbo_off_ms", "tbo_on_ms", "compute_alone_ms", "comm_alone_ms"):
            assert r[key] > 0
        assert r["ideal_overlap_ms"] == max(r["compute_alone_ms"], r["comm_alone_ms"])
    assert report["devices"] == ["cpu", "cpu"]
    assert report["env"] == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert report["setting"]["backend"] == "gloo" and report["setting"]["world"] == 2
    assert report["setting"]["overlap"] == overlap
    table = md.read_text()
    assert "rank 0: cpu, rank 1: cpu" in table and "backend gloo" in table
    assert f"hand-over {overlap}" in table
    body = [line for line in table.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [line.split(" | ")[:2] for line in body] == [
        ["| 3", "eager"],
        ["| 3", "replay"],
        ["| 8", "eager"],
        ["| 8", "replay"],
    ]


def test_mismatch_aborts_naming_the_rank():
    assert tbo_dp.check_equal([0.0, 1e-6], 1e-4, "x") == 1e-6
    with pytest.raises(tbo_dp.Mismatch, match=r"batch 8.*\{1: 0\.5\}"):
        tbo_dp.check_equal([0.0, 0.5], 1e-4, "batch 8")
    with pytest.raises(tbo_dp.Mismatch, match="nan"):
        tbo_dp.check_equal([float("nan"), 0.0], 1e-4, "batch 8")
    ref = torch.tensor([[2.0, -4.0]])
    assert tbo_dp.rel_error(ref + torch.tensor([[0.0, 1.0]]), ref) == 0.25


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["--backend", "gloo"], "--backend gloo with --device cuda"),
        (["--device", "cpu", "--backend", "gloo", "--batches", "2"], "--batches must be >= 3"),
        (["--device", "cpu", "--backend", "gloo", "--world", "3"], "do not shard over --world 3"),
        (["--device", "cpu", "--backend", "gloo", "--world", "1"], "--world must be >= 2"),
    ],
)
def test_bad_settings_are_named(argv, bad, capsys):
    with pytest.raises(SystemExit):
        tbo_dp.parse_args(argv)
    assert bad in capsys.readouterr().err


BUCKETS = [8, 16, 32, 64]
REPLAY_CASES = [[25, 30], [3, 17], [2, 40], [0, 5]]  # per-rank requests; one agreed bucket each
EXPECT_BUCKETS = [32, 32, 64, 8]


def _check_replay(tmp_path, tol):
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, bucket in enumerate(EXPECT_BUCKETS):
        for r in range(2):
            res = per_rank[r][i]
            on, off = res["mode_on"], res["mode_off"]
            assert on.replay and on.split and on.bucket == bucket and on.ubatch_split_bs == bucket
            assert off.replay and not off.split and off.bucket == bucket
            assert res["out_diff"] < tol and res["cache_diff"] < tol, (REPLAY_CASES[i], r, res)
            if REPLAY_CASES[i][r]:
                assert res["scale"] > 0.1  # the outputs are not trivially zero


def test_two_gloo_ranks_replay_tbo_on_equals_off(tmp_path):
    spawn(replay_worker, 2, REPLAY_CASES, BUCKETS, str(tmp_path))
    _check_replay(tmp_path, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_two_gpus_nccl_replay_tbo_on_equals_off(tmp_path):
    """CUDA graphs holding NCCL collectives issued from the runner's worker threads."""
    spawn(replay_worker, 2, REPLAY_CASES, BUCKETS, str(tmp_path), "nccl")
    _check_replay(tmp_path, 2e-3)
