"""benchmarks/attention_mla.py without a GPU: `--configs`, checked as the plan checks a
configuration, and the table's columns for it."""

import pytest

from benchmarks import attention_mla


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{BLOCK_N: 64}", "is not JSON"),
        ('{"BLOCK_N": 64}', "a JSON list of objects"),
        ('[{"BLOCKN": 64}]', "unknown packed MLA decode config keys ['BLOCKN']"),
        ('[{"kernel": "fast"}]', "kernel must be one of"),
        ('[{"kernel": "per_token", "tma": true}]', "fp8 tiles through pointer loads only"),
    ],
)
def test_bad_configs_are_refused_naming_what_is_wrong(text, named, capsys):
    with pytest.raises(SystemExit) as stop:
        attention_mla.main(["--caches", "bf16,fp8", "--configs", text])
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_good_configs_pass_the_check():
    configs = attention_mla.parse_configs('[{"BLOCK_N": 64, "num_warps": 8}, {}]', ["fp8"])
    assert configs == [{"BLOCK_N": 64, "num_warps": 8}, {}]


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
