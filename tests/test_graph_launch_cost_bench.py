"""benchmarks/graph_launch_cost.py: its flags and rows without a GPU; on a GPU, that the MLA
layer kind captures the plugin's kernels in a graph and counts its nodes (no timing is
asserted)."""

import pytest

from benchmarks import graph_launch_cost


@pytest.mark.parametrize("text", ["mla", "aten,gluon", ""])
def test_unknown_kinds_are_named_with_the_valid_ones(text, capsys):
    with pytest.raises(SystemExit) as stop:
        graph_launch_cost.main(["--kinds", text])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--kinds {text!r}" in err and "mla-layer" in err and "vllm-fa3" in err


def test_layers_and_replays_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        graph_launch_cost.main(["--layers", "0"])
    assert "--layers 0 --replays 100: both >= 1" in capsys.readouterr().err


def test_good_flags_reach_the_gpu_check(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        graph_launch_cost.main(["--kinds", "aten,mla-layer", "--layers", "4"])


def test_a_row_gives_the_call_and_its_share_a_node_and_a_failure_its_reason():
    result = {"ran": "write_mla_kv; mla_decode gluon/lockstep splits 8", "nodes": 48}
    result.update(launch_us=120.0, launch_p90_us=131.5)
    row = graph_launch_cost.row("mla-layer", result)
    assert row == (
        "| mla-layer | write_mla_kv; mla_decode gluon/lockstep splits 8 | 48 | 120.0, 131.5 "
        "| 2.50 |"
    )
    failed = graph_launch_cost.row("vllm-fa3", {"error": "ImportError: no vllm_flash_attn"})
    assert failed == "| vllm-fa3 | failed: ImportError: no vllm_flash_attn | | | |"


@pytest.mark.gpu
def test_the_mla_layer_kind_captures_the_plugins_kernels():
    result = graph_launch_cost.measure("mla-layer", layers=2, replays=3)
    assert result["ran"].startswith("write_mla_kv; mla_decode ")
    assert result["nodes"] >= 2 * 3  # a cache write and the decode's two kernels a layer
