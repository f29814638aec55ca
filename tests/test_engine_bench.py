"""The engine benchmark's own rules (benchmarks/engine.py): cases, workloads, the report."""

from __future__ import annotations

import pytest

from benchmarks.engine import parse_case, report
from benchmarks.engine_shapes import parse_workloads, write_shape


def test_a_case_is_a_backend_and_an_optional_variant():
    assert parse_case("FLASH_ATTN") == ("FLASH_ATTN", "")
    assert parse_case("FLASH_ATTN@disabled") == ("FLASH_ATTN", "disabled")
    with pytest.raises(ValueError, match=r"'nightly'.*'@disabled', '@old'"):
        parse_case("ATOM_AITER@nightly")


def test_unknown_workloads_and_shapes_are_named_with_the_choices(tmp_path):
    assert [w.name for w in parse_workloads("thr-512, lat-1")] == ["thr-512", "lat-1"]
    with pytest.raises(ValueError, match=r"\['thr-2k'\].*thr-512"):
        parse_workloads("thr-512,thr-2k")
    with pytest.raises(ValueError, match="'llama-70b'.*llama-3.1-8b"):
        write_shape("llama-70b", tmp_path)


def _result(case: str, tok_s: float) -> dict:
    run = {
        "workload": "thr-512",
        "output_tok_s": tok_s,
        "decode_step_ms": 8.0,
        "prefill_phase_s": 1,
    }
    return {"case": case, "runs": [run], "startup_s": 60.0}


def test_ratios_are_against_the_best_vllm_backend_not_the_plugin_or_a_variant():
    table = report(
        [
            _result("ATOM_AITER", 6600.0),
            _result("FLASH_ATTN@disabled", 9000.0),  # a variant: never the "best"
            _result("FLASH_ATTN", 6000.0),
            _result("TRITON_ATTN", 5000.0),
        ]
    )
    row = next(line for line in table.splitlines() if line.startswith("| thr-512 output"))
    assert "6,600 (1.10x)" in row and "5,000 (0.83x)" in row
    assert row.rstrip().endswith("| FLASH_ATTN |")


@pytest.mark.vllm
def test_a_wave_runs_on_vllms_cpu_build_and_the_disabled_variant_has_no_plugin(tmp_path):
    """The whole harness on the CPU build: a wave of two engines, one with the plugin off."""
    import json
    import subprocess
    import sys

    from tests.engine import engine_env

    out = tmp_path / "out"
    args = [
        *("--shape", "tiny-llama", "--cases", "default,default@disabled", "--workloads", "lat-1"),
        *("--wave", "2", "--repeats", "1", "--kv-gib", "0.25", "--max-model-len", "2048"),
        *("--eager", "--out-dir", str(out)),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", *args],
        capture_output=True,
        text=True,
        env=engine_env(ATOM_PLUGIN_DISABLE=None),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| lat-1 output tok/s |" in proc.stdout and "| lat-1 TTFT ms |" in proc.stdout
    results = {json.loads(p.read_text())["case"]: p for p in out.glob("*.json")}
    assert set(results) == {"default", "default@disabled"}
    for path in results.values():
        result = json.loads(path.read_text())
        [run] = [r for r in result["runs"] if r["workload"] == "lat-1"]
        assert run["steps"] >= run["output_len"] and result["cold"]["workload"] == "lat-1"
    # The plugin's platform logs what it installed in the plugin's case only.
    assert "atom-plugin logits processors" in (out / "default.log").read_text()
    assert "atom-plugin" not in (out / "default-disabled.log").read_text()
