"""benchmarks/decode_splits.py without a GPU: the flags, the counts run, the tables."""

import pytest

from benchmarks import decode_splits as ds
from benchmarks.kernel_problems import Heads


def test_shapes_and_splits_parse():
    assert ds.parse_shapes("32/8/128:8x16384, 32/4/64:1X1024") == [
        (Heads(32, 8, 128), 8, 16384),
        (Heads(32, 4, 64), 1, 1024),
    ]
    assert ds.parse_splits("4,1,4,2") == [1, 2, 4]
    assert len(ds.parse_shapes(ds.DEFAULT_SHAPES)) == 12
    assert ds.parse_splits(ds.DEFAULT_SPLITS)[0] == 1


@pytest.mark.parametrize("text", ["32/8:8x16", "32/5/128:8x16", "32/8/128:8", "32/8/128:0x16"])
def test_bad_shapes_name_the_item(text):
    with pytest.raises(ValueError, match="bad item"):
        ds.parse_shapes(text)


@pytest.mark.parametrize("text", ["", "0,2", "a"])
def test_bad_splits_are_refused(text):
    with pytest.raises(ValueError, match="--splits"):
        ds.parse_splits(text)


def test_bad_flags_exit_before_touching_a_gpu(capsys):
    with pytest.raises(SystemExit):
        ds.main(["--splits", "0"])
    assert "--splits" in capsys.readouterr().err


def test_counts_run_respect_the_kernels_bounds():
    # 256 keys a split at least, 64 splits at most, one split always
    assert ds.runnable_splits([1, 2, 4, 5, 64], 1024) == [1, 2, 4]
    assert ds.runnable_splits([1, 2], 100) == [1]
    assert ds.runnable_splits([32, 64, 65], 1 << 20) == [32, 64]


def _row(splits, us, rule=False, status="ok"):
    return dict(splits=splits, programs=8 * splits, per_sm=8 * splits / 132, bytes=4e8, us=us,
                rule=rule, status=status)  # fmt: skip


def test_summary_sets_the_rules_pick_against_the_best():
    shapes = {
        (Heads(32, 8, 128), 8, 16384): [_row(4, 120.0), _row(5, 150.0, rule=True)],
        (Heads(32, 4, 128), 1, 1024): [_row(1, 10.0, status="FAILED: x")],
    }
    lines = ds.summary(shapes).splitlines()
    assert lines[2] == "| 32/8/128 | 8 | 16384 | 4 | 120.0 | 5 | 150.0 | 1.25 |"
    assert lines[3] == "| 32/4/128 | 1 | 1024 | - | - | - | - | - |"


def test_shape_table_marks_the_pick_and_failures():
    rows = [_row(4, 100.0, rule=True), _row(8, 200.0), _row(16, None, status="FAILED: boom")]
    lines = ds.shape_table(rows, copy_gbps=4000.0).splitlines()
    assert lines[2] == "| 4 | 32 | 0.24 | 100.0 | 4000 | 100.0% | 1.00 | picked | ok |"
    assert lines[3].startswith("| 8 | 64 | 0.48 | 200.0 | 2000 | 50.0% | 2.00 |  | ok |")
    assert lines[4] == "| 16 | 128 | 0.97 | - | - | - | - |  | FAILED: boom |"
