"""benchmarks/mha_variants.py without a GPU: the candidate lists, the flags, the table."""

import pytest

from benchmarks import mha_variants as mv


def test_candidate_lists_are_valid():
    mv.validate_all()
    assert mv.PREFILL_CANDIDATES[0] == ("default", None)
    assert mv.DECODE_CANDIDATES[0] == ("default", None)


@pytest.mark.parametrize(
    "cands, match",
    [
        ([("a", dict(mv.DECODE_BASE))], "first candidate"),
        ([("default", None), ("a", dict(BLOCK_N=64))], "missing"),
        ([("default", None), ("a", dict(mv.DECODE_BASE, maxnreg=128))], "unknown"),
        ([("default", None), ("a", dict(mv.DECODE_BASE)), ("a", mv.DECODE_BASE)], "duplicate"),
    ],
)
def test_bad_candidate_lists_are_refused(cands, match):
    from atom_plugin.attention.mha import triton_decode

    with pytest.raises(ValueError, match=match):
        mv.validate(cands, triton_decode.CONFIG_KEYS, tuple(mv.DECODE_BASE))


def test_flags_pick_cases_and_variants():
    a = mv.parse_args(
        ["--families", "decode", "--decode-cases", "8 x 16K,1 x 32K", "--decode-variants",
         "table_blocks", "--budget", "60"]
    )  # fmt: skip
    assert a.families == ["decode"]
    assert list(a.decode_cases) == ["8 x 16K", "1 x 32K"]
    assert [n for n, _ in a.decode_variants] == ["default", "table_blocks"]
    assert a.budget == 60
    d = mv.parse_args([])
    assert d.prefill_variants == mv.PREFILL_CANDIDATES and d.decode_cases == mv.DECODE_CASES


@pytest.mark.parametrize(
    "argv", [["--families", "mla"], ["--decode-variants", "nope"], ["--budget", "0"]]
)
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        mv.parse_args(argv)


def test_table_ratios_and_statuses():
    rows = [
        {"variant": "FA3", "config": None, "status": "ok", "us": 100.0},
        {"variant": "default", "config": None, "status": "ok", "us": 200.0},
        {"variant": "x", "config": dict(BLOCK_N=64, table_blocks=True), "status": "ok", "us": 150},
        {"variant": "y", "config": dict(BLOCK_N=64), "status": "ERROR: boom"},
    ]
    text = mv.table({"c": rows}, lambda case: 3e8, "TFLOP/s")
    lines = text.splitlines()
    assert lines[4] == "| c | x | n64 table_blocks | 150.0 | 2 | 1.50 | 0.75 | ok |"
    assert lines[5].endswith("| - | - | - | - | ERROR: boom |")


def test_run_case_checks_every_candidate_on_cpu(monkeypatch):
    """run_case through the interpreter, FA3 replaced by the torch reference and the timer
    by a constant: every candidate's output is asserted, a broken one is an ERROR row."""
    import torch

    from atom_plugin.attention.mha import reference
    from atom_plugin.attention.mha.params import AttentionParams
    from benchmarks import _timing, attention
    from benchmarks import kernel_problems as kp

    def fa3_call(pool, meta, q, num_splits):
        def call():
            out = torch.zeros(q.shape, dtype=torch.float32)
            params = AttentionParams(scale=kp.MHA_SCALE)
            reference.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, out)
            return out.to(q.dtype)

        return call

    monkeypatch.setattr(kp, "fa3_call", fa3_call)
    monkeypatch.setattr(kp, "peaked_mha_query", lambda n: torch.randn(n, kp.HQ, kp.D) * 0.1)
    monkeypatch.setattr(_timing, "time_us", lambda fn, **kw: 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    torch.manual_seed(0)
    pool = attention.KVPool(128, kp.MHA_BLOCK_SIZE, device="cpu")
    cands = [
        ("default", None),
        ("table_blocks", dict(mv.DECODE_BASE, BLOCK_N=32, table_blocks=True)),
        ("broken", dict(mv.DECODE_BASE, BLOCK_N=8, table_blocks=True)),  # BLOCK_N < block 16
    ]
    rows = mv.run_case(pool, [(1, 40), (1, 17)], cands, True, None, 1, float("inf"), 0)
    assert [(r["variant"], r["status"][:5]) for r in rows] == [
        ("FA3", "ok"),
        ("default", "ok"),
        ("table_blocks", "ok"),
        ("broken", "ERROR"),
    ]
    small = dict(BLOCK_Q=4, BLOCK_N=16, num_warps=4, num_stages=1)
    pre = [("default", None), ("r128", dict(small, maxnreg=128))]
    rows = mv.run_case(pool, [(5, 20), (3, 3)], pre, False, None, 1, float("inf"), 0)
    assert [r["status"] for r in rows] == ["ok"] * 3
    skipped = mv.run_case(pool, [(1, 40)], cands[:1], True, None, 1, 0.0, 0)
    assert {r["status"] for r in skipped} == {"SKIPPED: budget spent"}
