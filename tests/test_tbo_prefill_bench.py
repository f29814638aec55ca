"""The prefill TBO benchmark (benchmarks/tbo_prefill.py): a CPU smoke run and its bad settings.

The run proves the split steps it times went through the micro-batch runner,
cut at the token midpoint with one request in both micro-batches, and equal
the unsplit step before any timing.
"""

import json

import pytest

from atom_plugin.tbo import MicroBatchRunner
from benchmarks import tbo_prefill


def test_cpu_smoke_run_splits_at_the_midpoint_and_matches(tmp_path, monkeypatch):
    seen = []  # token counts of the two micro-batches of each runner step
    run = MicroBatchRunner.run

    def counting_run(self, fn, forward_contexts):
        if forward_contexts[0] is not None:  # not the runner-alone reference
            seen.append(tuple(m.num_actual_tokens for m in forward_contexts))
        return run(self, fn, forward_contexts)

    monkeypatch.setattr(MicroBatchRunner, "run", counting_run)
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    argv = ["--device", "cpu", "--model", "tiny", "--tokens", "16", "37", "--comm", "0"]
    assert tbo_prefill.main([*argv, "--iters", "1", "--out", str(md), "--json", str(js)]) == 0
    rows = json.loads(js.read_text())
    assert [r["tokens"] for r in rows] == [16, 37]
    for r in rows:
        t = r["tokens"]
        assert sum(r["query_lens"]) == t and len(r["query_lens"]) == 4
        assert r["straddling_request"] == 2
        assert r["ubatch_num_tokens"] == [t // 2, t - t // 2]
        assert r["split_vs_unsplit_rel_err"] <= 1e-4
        for name, *_ in tbo_prefill.SPLITS:
            assert r[f"{name}_ms"] > 0 and r[f"unsplit_over_{name}"] > 0
        assert r["runner_alone_ms"] > 0 and r["runner_alone_2s_ms"] > 0
    # each split column: one equality check and 1 + 3 warm-up timed steps, per token count
    per_size = len(tbo_prefill.SPLITS) * 5
    assert seen == [(8, 8)] * per_size + [(18, 19)] * per_size
    table = md.read_text()
    assert "TBO prefill step (eager), CPU" in table and "the runner alone" in table
    assert [line.split(" | ")[0] for line in table.splitlines() if line[:3] in ("| 1", "| 3")] == [
        "| 16",
        "| 37",
    ]


def test_query_lens_straddle_the_cut():
    for tokens in (16, 256, 1000, 8192):
        lens = tbo_prefill.prefill_query_lens(tokens)
        assert sum(lens) == tokens and min(lens) >= 1
        assert tbo_prefill.straddling_request(lens) == 2
    assert tbo_prefill.straddling_request([4, 4]) is None


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["--device", "cpu", "--comm", "0.3"], "the stand-in communication is a CUDA kernel"),
        (["--device", "cpu", "--comm", "0", "--tokens", "8"], "--tokens must be >= 16"),
        (["--device", "cpu", "--comm", "1"], "--comm fractions must be in [0, 1)"),
        (
            ["--device", "cpu", "--comm", "0", "--model", "tiny", "--ep-ranks", "8"],
            "--ep-ranks 8 does not",
        ),
    ],
)
def test_bad_settings_are_named(argv, bad, capsys):
    with pytest.raises(SystemExit):
        tbo_prefill.parse_args(argv)
    assert bad in capsys.readouterr().err
