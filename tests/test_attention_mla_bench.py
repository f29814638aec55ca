"""benchmarks/attention_mla.py without a GPU: `--configs`, checked as the plan checks a
configuration, and the table's columns for it."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks import attention_mla


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{BLOCK_N: 64}", "is not JSON"),
        ('{"BLOCK_N": 64}', "a JSON list of objects"),
        ('[{"BLOCKN": 64}]', "unknown packed MLA decode config keys ['BLOCKN']"),
        ('[{"kernel": "fast"}]', "kernel must be one of"),
        ('[{"kernel": "per_token", "tma": true}]', "fp8 tiles through pointer loads only"),
        ('[{"num_splits": 0}]', "num_splits=0 must be an int in [1, 256]"),
        ('[{"num_splits": "8"}]', "num_splits='8' must be an int in [1, 256]"),
        ('[{"num_splits": 8, "BLOCKN": 64}]', "unknown packed MLA decode config keys"),
    ],
)
def test_bad_configs_are_refused_naming_what_is_wrong(text, named, capsys):
    with pytest.raises(SystemExit) as stop:
        attention_mla.main(["--caches", "bf16,fp8", "--configs", text])
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_good_configs_pass_the_check():
    text = '[{"BLOCK_N": 64, "num_warps": 8}, {}, {"num_splits": 16}]'
    configs = attention_mla.parse_configs(text, ["fp8"])
    assert configs == [{"BLOCK_N": 64, "num_warps": 8}, {}, {"num_splits": 16}]


class _RecordingShape:
    """Stands in for a GPU shape: records what the plan was asked for."""

    def __init__(self):
        self.asked = []

    def time_new(self, flush, config=None, num_splits=None):
        self.asked.append((config, num_splits))
        launch = SimpleNamespace(name="gluon/rows16", num_splits=num_splits or 32)
        return 50.0, torch.zeros(2), SimpleNamespace(launch=launch)


@pytest.mark.parametrize(
    ("config", "asked"),
    [
        ({"num_splits": 16}, (None, 16)),
        ({"kernel": "gluon", "schedule": "rows16", "num_splits": 8},
         ({"kernel": "gluon", "schedule": "rows16"}, 8)),
        ({"BLOCK_N": 64}, ({"BLOCK_N": 64}, None)),
    ],
)  # fmt: skip
def test_a_configs_split_count_goes_to_the_plan_and_the_rest_as_its_config(config, asked):
    shape = _RecordingShape()
    timed = attention_mla._time_config(shape, None, config, torch.zeros(2))
    assert shape.asked == [asked]
    assert timed["config"] == config and timed["num_splits"] == (asked[1] or 32)


def test_shared_reaches_every_shape(monkeypatch):
    made = []

    def shape(*args, **kwargs):
        made.append(kwargs.get("shared"))
        return object()

    monkeypatch.setattr(attention_mla, "Shape", shape)
    monkeypatch.setattr(attention_mla, "bench_shape", lambda *a, **k: {})
    monkeypatch.setattr(attention_mla, "_row_line", lambda row: "")
    monkeypatch.setattr(attention_mla.torch.cuda, "empty_cache", lambda: None)
    attention_mla.run_mla_benchmarks(
        (16,), (1, 8), (8192,), ("fp8",), (), copy_gbps=1.0, matmul_rate=1.0, flush=object(),
        device="cpu", shared=True,
    )  # fmt: skip
    assert made == [True, True]


def _row(**extra):
    row = {
        "heads": 16, "cache": "fp8", "batch": 64, "context": 2048, "q_len": 1,
        "kernel": "packed", "us": 100.0, "kv_gbps": 1500.0, "frac_copy": 0.5, "tflops": 20.0,
        "frac_matmul": 0.03, "frac_limit": 0.5, "target": None, "met": None,
    }  # fmt: skip
    return {**row, **extra}


def test_the_table_gives_each_config_its_column_and_its_legend():
    configs = [
        {"config": {"BLOCK_N": 64}, "us": 80.0, "kernel": "packed", "num_splits": 4,
         "maxdiff": 0.0},
        {"config": {"kernel": "gluon"}, "error": "ValueError: cannot run"},
    ]  # fmt: skip
    table = attention_mla.format_table([_row(configs=configs)])
    header, _, line, *rest = table.splitlines()
    assert header.endswith("| config 1 us | config 2 us |")
    assert line.endswith("| 80.0 (0.80x, packed x 4) | cannot run |")
    assert rest == ["", 'config 1: `{"BLOCK_N": 64}`', 'config 2: `{"kernel": "gluon"}`']


def test_without_configs_the_table_is_as_before():
    table = attention_mla.format_table([_row()])
    assert "config" not in table and len(table.splitlines()) == 3
