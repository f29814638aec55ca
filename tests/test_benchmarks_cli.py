"""`python -m benchmarks`: the list it prints, the benchmark it runs, and the modules it names."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS, main

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
# modules with a __main__ block that are not benchmarks of their own
STARTED_BY_OTHERS = {"engine_case", "__main__"}  # engine_case: one process of benchmarks.engine


def _runnable_modules() -> set[str]:
    return {
        path.stem
        for path in BENCH_DIR.glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }


def test_every_runnable_module_is_listed_and_every_listed_one_exists():
    assert set(BENCHMARKS) == _runnable_modules() - STARTED_BY_OTHERS


def test_help_lists_each_benchmark_with_its_question(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the questions wrap over lines
    for name, question in BENCHMARKS.items():
        assert f" {name} " in out
        assert " ".join(question.split()) in out


def test_no_name_prints_the_list_and_fails(capsys):
    assert main([]) == 2
    assert "tbo_prefill" in capsys.readouterr().out


def test_an_unknown_name_is_refused_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["engines"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'engines'" in err and "kernels_vs_vllm" in err


def test_a_name_runs_that_benchmark_with_the_remaining_arguments(tmp_path, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "benchmarks.compare_runs", raising=False)  # run it afresh
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"prefill": [{"case": "8K fresh", "us": 100.0}]}))
    after.write_text(json.dumps({"prefill": [{"case": "8K fresh", "us": 110.0}]}))
    with pytest.raises(SystemExit) as exc:
        main(["compare_runs", str(before), str(after), "--tolerance", "0.2"])
    assert exc.value.code == 0
    assert "| prefill | 8K fresh | 100.0 | 110.0 | 1.100 | yes |" in capsys.readouterr().out


def test_the_module_runs_from_the_command_line():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "compare_runs", "--help"],
        cwd=BENCH_DIR.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "--tolerance" in run.stdout
