"""benchmarks/kernels_vs_vllm.py's report without a GPU: the tables, the target rules and
their summary lines, the output judgement, and a whole run with stand-in kernels."""

import functools

import pytest
import torch

from atom_plugin.attention.mha import reference
from atom_plugin.attention.mha.params import AttentionParams
from atom_plugin.attention.mla.reference import mla_decode_reference
from benchmarks import attention
from benchmarks import kernel_cases as kc
from benchmarks import kernel_problems as kp
from benchmarks import kernel_tables as kt
from benchmarks import kernels_vs_vllm as kv

# ---------------------------------------------------------------- report


def test_tables_and_exit_status_for_failed_and_error_rows():
    ok = {"heads": 16, "q_len": 1, "batch": 1, "context": 1024, "status": "ok"}
    ok.update(flops=kp.mla_flops(1, 1024, 16, 1), bytes=kp.mla_bytes(1, 1024, 16, 1))
    ok.update(plugin_us=10.0, vllm_us=8.0, plugin_timing="graph", vllm_timing="graph")
    ok.update(kernel="gluon/lockstep", maxdiff=0.01)
    mla = dict(ok, fa3_mla_us=12.5, fa3_mla_timing="graph")
    err = dict(mla, status="ERROR: vllm: RuntimeError: nope", vllm_error="RuntimeError: nope")
    del err["vllm_us"]
    text = kt.mla_table([mla, err], copy_gbps=4000.0)
    assert "| 10.0 | 8.0 | 1.25 | 12.5 | 0.80 |" in text  # plugin / FlashMLA, / FA3-MLA
    assert "| graph | missed | ok |" in text  # the target column: FlashMLA's
    assert "| 10.0 | error | - | 12.5 | 0.80 |" in text and "| - | ERROR: vllm" in text
    assert text.endswith(
        "\n\nTarget: 0 of 2 met (1 not judged: outputs not ok or a side not timed).\n\n"
        "Target plugin/FA3-MLA <= 1.0: 1 of 2 met (1 not judged: outputs not ok or a side "
        "not timed)."
    )
    no_fa3 = dict(ok, status="ERROR: FA3-MLA: ImportError: x", fa3_mla_error="ImportError: x")
    text = kt.mla_table([no_fa3], copy_gbps=4000.0)
    assert "| 1.25 | error | - |" in text and "Target plugin/FA3-MLA <= 1.0: 0 of 1 met (1" in text
    assert kt.exit_status([ok]) == 0
    assert kt.exit_status([ok, err]) == 3
    assert kt.exit_status([err, dict(ok, status="FAILED: plugin vs FlashMLA: ...")]) == 1
    h = kp.DEFAULT_HEADS
    dec = dict(ok, heads=h, batch=8, context=4096, triton_us=12.5, triton_timing="graph")
    dec.update(flops=kp.mha_decode_flops(8, 4096), bytes=kp.mha_decode_bytes(8, 4096))
    text = kt.mha_decode_table([dec, dict(dec, plugin_us=8.0)], 4000.0)
    assert "| 32/8/128 | 8 | 4096 | 10.0 | 8.0 | 12.5 | 1.25 | 0.80 |" in text
    assert "| 32/8/128 | 8 | 4096 | 8.0 | 8.0 | 12.5 | 1.00 | 0.64 |" in text
    assert text.endswith("Target: 1 of 2 met.")
    case = kp.PrefillCase(4, 2048, 6144)
    pre = dict(ok, heads=kp.Heads(64, 8, 128), case=str(case), tokens=case.tokens)
    pre["flops"] = kp.prefill_flops(case.reqs(), pre["heads"])
    text = kt.prefill_table([pre], 800.0)
    assert "| 64/8/128 | 4 x 2048 over 6144 cached | 8192 | 10.0 | 8.0 | 1.25 |" in text
    assert text.endswith("Target: 0 of 1 met.")
    fp8 = dict(ok, heads=128, batch=32, context=8192, cache="fp8")
    fp8.update(flops=kp.mla_flops(32, 8192, 128, 1), limit_us=7.0, ref_maxdiff=None)
    fp8["bytes"] = kp.mla_bytes(32, 8192, 128, 1, kv_elem=1)
    no_flashmla = dict(fp8, status="ERROR: FlashMLA fp8: x", vllm_error="x")
    del no_flashmla["vllm_us"]
    text = kt.mla_fp8_table([fp8, no_flashmla])
    assert "| 128 | 1 | 32 | 8192 | gluon/lockstep | 10.0 | 8.0 | 1.25 | 7.0 | 70.0% |" in text
    assert "| gluon/lockstep | 10.0 | error | - | 7.0 | 70.0% |" in text
    assert "| graph | met | ok |" in text
    assert text.endswith(
        "\n\nTarget: 1 of 2 met (1 not judged: outputs not ok or a side not timed).\n\n"
        "Target plugin/FlashMLA fp8 <= 1.0: 0 of 2 met (1 not judged: outputs not ok or a "
        "side not timed)."
    )
    assert "GB/s" in kt.anchors_table({"copy_gbps": 4000.0, "matmul_tflops": 700.0})


@pytest.mark.parametrize(
    "plugin, others, want",
    [
        (8.0, {"vllm": 8.0}, True),  # exactly 1.0: met
        (8.0, {"vllm": 7.999}, False),
        (7.0, {"vllm": 8.0}, True),
        (8.0, {"vllm": 8.0, "triton": 8.0}, True),  # both edges: met
        (8.0, {"vllm": 9.0, "triton": 7.9}, False),  # faster than FA3, slower than Triton
        (8.0, {"vllm": 7.9, "triton": 9.0}, False),
        (8.0, {"vllm": 9.0}, None),  # Triton not timed: not judged
        (None, {"vllm": 9.0, "triton": 9.0}, None),
    ],
)
def test_ratio_targets(plugin, others, want):
    row = {"status": "ok", **{f"{k}_us": v for k, v in others.items()}}
    if plugin is not None:
        row["plugin_us"] = plugin
    sides = ("vllm", "triton") if "triton" in others or want is None else ("vllm",)
    assert kt.met_ratio(row, sides) is want
    if sides == ("vllm", "triton"):
        assert kt.met_decode(row) is want


def test_ratio_target_needs_ok_outputs():
    row = {"plugin_us": 1.0, "vllm_us": 9.0}
    assert kt.met_ratio(dict(row, status="ok")) is True
    assert kt.met_ratio(dict(row, status="FAILED: plugin vs FA3: ...")) is None
    assert kt.met_ratio(dict(row, status="ERROR: FA3: ...")) is None
    assert kt.target_cell(None) == "-" and kt.target_cell(False) == "missed"


@pytest.mark.parametrize(
    "us, want",
    [(10.0, True), (7.0 / 0.7 + 1e-6, False), (7.0, True), (20.0, False), (None, None)],
)
def test_fp8_limit_target(us, want):
    """Met at 70% of the limit or better: time <= limit / 0.7 (10.0 us for a 7.0 us limit,
    the edge included)."""
    row = {"status": "ok", "limit_us": 7.0}
    if us is not None:
        row["plugin_us"] = us
    assert kt.met_limit(row) is want
    assert kt.met_limit(dict(row, limit_us=None)) is None


def test_summary_line():
    rows = [{"v": True}, {"v": False}, {"v": None}, {"v": True}]
    line = kt.summary(rows, lambda r: r["v"])
    assert line == "Target: 2 of 4 met (1 not judged: outputs not ok or a side not timed)."
    assert kt.summary(rows[:2], lambda r: r["v"]) == "Target: 1 of 2 met."
    assert kt.summary([], lambda r: r["v"]) == "Target: 0 of 0 met."


def test_judge_names_the_side_that_is_off():
    good = torch.randn(4, 8)
    off = good + 1.0
    row = {}
    outs = {
        "plugin": ("plugin", good),
        "vllm": ("FA3", good.clone()),
        "triton": ("vLLM Triton", off),
    }
    kc.judge(row, outs, ref_fn=lambda: good.double())
    assert row["status"].startswith("FAILED: plugin vs vLLM Triton:")
    assert "vLLM Triton vs fp32 reference" in row["status"] and "FA3 vs" not in row["status"]
    assert row["maxdiff"] == pytest.approx(1.0)
    row = {"triton_error": "RuntimeError: nope"}
    outs["triton"] = ("vLLM Triton", None)
    kc.judge(row, outs)
    assert row["status"] == "ERROR: vLLM Triton: RuntimeError: nope"
    row = {}
    kc.judge(
        row, {"plugin": ("plugin", good), "check": ("FlashMLA (dequantized bf16 cache)", good)}
    )
    assert row["status"] == "ok" and row["maxdiff"] == 0.0


def test_judge_takes_a_sides_own_tolerance():
    """FlashMLA's fp8 path is checked within its own (looser) tolerance, against the
    plugin and against the reference; every other side keeps the default."""
    want = torch.ones(4, 8)
    near = want + 0.07  # beyond 0.03 + 0.02 * 1, within 0.06 + 0.08 * 1
    far = want + 0.5
    loose = {"vllm": kc.FLASHMLA_FP8_TOL}
    row = {}
    kc.judge(row, {"plugin": ("plugin", want), "vllm": ("FlashMLA fp8", near)}, lambda: want, loose)
    assert row["status"] == "ok" and row["maxdiff"] == pytest.approx(0.07)
    row = {}
    kc.judge(row, {"plugin": ("plugin", want), "vllm": ("FlashMLA fp8", near)}, lambda: want)
    assert row["status"].startswith("FAILED: plugin vs FlashMLA fp8:")
    row = {}
    outs = {"plugin": ("plugin", want), "vllm": ("FlashMLA fp8", far), "check": ("c", near)}
    kc.judge(row, outs, lambda: want, loose)
    failed = row["status"]
    assert "plugin vs FlashMLA fp8" in failed and "FlashMLA fp8 vs fp32 reference" in failed
    assert "plugin vs c" in failed and "c vs fp32 reference" in failed  # default tolerance


# ---------------------------------------------------------------- a whole run


@pytest.fixture
def gpu_stand_ins(monkeypatch):
    """A run's GPU pieces on the CPU: every time 10 us, no L2 flush, fixed anchors, and
    torch.cuda's calls the run makes answered."""
    monkeypatch.setattr(kc, "timed", lambda fn, flush, iters=20: (10.0, "graph"))
    monkeypatch.setattr(kv, "L2Flusher", lambda: None)
    monkeypatch.setattr(kv, "copy_bandwidth_gbps", lambda: 4000.0)
    monkeypatch.setattr(kv, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "CPU stand-in")


@pytest.mark.usefixtures("gpu_stand_ins")
def test_run_on_cpu_with_stand_in_kernels(monkeypatch, tmp_path, capsys):
    """The whole run, flags to report, with every kernel replaced by the float32
    reference rounded to bf16 on CPU and every time set to 10 us: each family's table,
    its target line, the skip note, progress on stderr and the exit status."""

    def mla_out(shape):
        ref = torch.zeros(shape.batch * shape.q_len, shape.heads, kp.LORA)
        mla_decode_reference(
            shape.q, shape.kv, shape.meta, scale=shape.scale, output=ref, kv_scale=shape.kv_scale
        )
        return lambda: ref.to(torch.bfloat16)

    def mha_out(pool, meta, q, *_):
        ref = torch.zeros(q.shape)
        params = AttentionParams(scale=q.shape[-1] ** -0.5)
        reference.paged_attention(q, pool.key_cache, pool.value_cache, meta, params, ref)
        return lambda: ref.to(torch.bfloat16)

    cpu = dict(device="cpu")
    monkeypatch.setattr(kc, "make_mla_shape", functools.partial(kp.make_mla_shape, **cpu))
    monkeypatch.setattr(kc, "peaked_mha_query", functools.partial(kp.peaked_mha_query, **cpu))
    monkeypatch.setattr(kc, "plugin_mla_call", lambda shape, plan, out: mla_out(shape))
    monkeypatch.setattr(kc, "flashmla_call", lambda shape, kv=None: mla_out(shape))
    monkeypatch.setattr(kc, "fa3_mla_call", lambda shape, num_splits: mla_out(shape))
    monkeypatch.setattr(kc, "flashmla_fp8_call", mla_out)
    for name in ("plugin_mha_call", "fa3_call", "triton_call"):
        monkeypatch.setattr(kc, name, mha_out)
    monkeypatch.setattr(attention, "KVPool", functools.partial(attention.KVPool, **cpu))
    out = tmp_path / "k.md"
    argv = ["--out", str(out), "--mla-heads", "16", "--mla-qlens", "1", "--mla-shapes", "2x100"]
    argv += ["--mha-shapes", "2x100,256x64K", "--prefill", "1x64,2x32+40", "--iters", "2"]
    argv += ["--prefill-heads", "32/8/128,32/4/64"]
    assert kv.main(argv) == 0
    text = out.read_text()
    assert text.count("| ok |") == 2 + 1 + 4  # MLA bf16 and fp8, decode, 2 x 2 prefill
    assert "Target: 1 of 1 met." in text  # MLA bf16: 10 us against 10 us
    assert "| 2 | 100 | per_token | 10.0 | 10.0 | 1.00 | 10.0 | 1.00 |" in text
    assert "Target plugin/FA3-MLA <= 1.0: 1 of 1 met." in text
    assert "FA3-MLA not run (vLLM's FLASH_ATTN_MLA takes no fp8 cache)" in text
    assert "Target: 0 of 1 met." in text  # MLA fp8: 10 us against a limit of ~0.05 us
    assert "| 2 | 100 | per_token | 10.0 | 10.0 | 1.00 |" in text  # ... and FlashMLA fp8
    assert "Target plugin/FlashMLA fp8 <= 1.0: 1 of 1 met." in text
    assert "| 32/8/128 | 2 | 100 | 10.0 | 10.0 | 10.0 | 1.00 | 1.00 |" in text
    assert "Skipped at 32/8/128 (K/V above the 40 GiB cap, --kv-cap-gib): 256 x 65536" in text
    assert "| 32/4/64 | 2 x 32 over 40 cached | 64 | 10.0 | 10.0 | 1.00 |" in text
    assert "Target: 4 of 4 met." in text and text.endswith("Result: all rows ok.\n")
    err = capsys.readouterr().err
    assert "prefill 32/4/64 [2/2] 2 x 32 over 40 cached" in err and "MLA fp8 [1/1]" in err


@pytest.mark.usefixtures("gpu_stand_ins")
def test_shared_prefix_rows_read_one_context(monkeypatch, tmp_path):
    """--mla-shared-prefix: every MLA row's shape is made with one shared context (its
    requests' block tables the same), and the report says so."""
    made = []

    def shape(*args, **kw):
        made.append(kp.make_mla_shape(*args, **{**kw, "device": "cpu"}))
        return made[-1]

    def out(shape, *_args, **_kw):
        return lambda: torch.zeros(shape.batch * shape.q_len, shape.heads, kp.LORA)

    monkeypatch.setattr(kc, "make_mla_shape", shape)
    for name in ("plugin_mla_call", "flashmla_call", "fa3_mla_call", "flashmla_fp8_call"):
        monkeypatch.setattr(kc, name, out)
    report = tmp_path / "k.md"
    argv = ["--out", str(report), "--only", "mla", "--mla-heads", "16", "--mla-qlens", "1"]
    kv.main(argv + ["--mla-shapes", "3x100", "--mla-shared-prefix", "--iters", "1"])
    assert [s.cache for s in made] == ["bf16", "fp8"]
    for s in made:
        rows = s.meta.block_table.tolist()
        assert rows[0] == rows[1] == rows[2]
    assert "--mla-shared-prefix: every request reads the same blocks" in report.read_text()


def test_mla_row_without_fa3_mla(monkeypatch):
    """Where FA3-MLA cannot run (here the real call: vLLM's CPU build has no FA3), the row
    is an ERROR naming FA3-MLA and the plugin and FlashMLA still run, timed and checked."""
    cpu = dict(device="cpu")
    monkeypatch.setattr(kc, "make_mla_shape", functools.partial(kp.make_mla_shape, **cpu))

    def mla_out(shape, *_):
        ref = torch.zeros(shape.batch * shape.q_len, shape.heads, kp.LORA)
        mla_decode_reference(shape.q, shape.kv, shape.meta, scale=shape.scale, output=ref)
        return lambda: ref.to(torch.bfloat16)

    monkeypatch.setattr(kc, "plugin_mla_call", mla_out)
    monkeypatch.setattr(kc, "flashmla_call", mla_out)
    monkeypatch.setattr(kc, "timed", lambda fn, flush, iters=20: (10.0, "graph"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    row = kc.mla_case(2, 100, 16, 1, flush=None)
    if "fa3_mla_error" not in row:
        pytest.skip("FA3 runs here")
    assert row["status"].startswith("ERROR: FA3-MLA: ")
    assert row["plugin_us"] == row["vllm_us"] == 10.0 and "fa3_mla_us" not in row
    assert row["maxdiff"] == 0.0 and row["ref_maxdiff"] is not None
    assert kt.met_ratio(row) is None and kt.met_fa3_mla(row) is None
