"""benchmarks/graph_node_cost.py: its flags and table without a GPU; on a GPU, that each
MLA trigger runs the kernel path it names (no timing is asserted)."""

import pytest

from benchmarks import graph_node_cost


@pytest.mark.parametrize("text", ["mla", "none,gluon", ""])
def test_unknown_triggers_are_named_with_the_valid_ones(text, capsys):
    with pytest.raises(SystemExit) as stop:
        graph_node_cost.main(["--triggers", text])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--triggers {text!r}" in err and "mla-packed" in err and "idle-contexts" in err


def test_good_flags_reach_the_gpu_check(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        graph_node_cost.main(["--triggers", "none,mla-write", "--pairs", "4"])


def test_a_row_shows_both_graphs_after_the_trigger_and_a_failure_its_reason():
    result = {
        "ran": "mla_decode packed/lockstep splits 4",
        "before": {"us_per_node": 3.1},
        "after": {"us_per_node_same": 3.5, "us_per_node": 3.52, "median_gap_us": 0.448},
    }
    row = graph_node_cost._row("mla-packed", result)
    assert (
        row
        == "| mla-packed | mla_decode packed/lockstep splits 4 | 3.100 | 3.500 | 3.520 | 0.448 |"
    )
    failed = graph_node_cost._row("mla-gluon", {"error": "exit 1: no Gluon"})
    assert failed.startswith("| mla-gluon | failed: 'exit 1: no Gluon' |")


@pytest.mark.gpu
def test_the_mla_triggers_run_the_paths_they_name():
    ran, cleanup = graph_node_cost.run_trigger("mla-all")
    cleanup()
    assert "write_mla_kv" in ran
    assert "mla_decode packed/" in ran and "mla_decode gluon/" in ran
