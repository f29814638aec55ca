"""benchmarks.compare_runs pairs the rows of two benchmark reports by what names them."""

import json

from benchmarks import compare_runs

BEFORE = {
    "decode": [
        {"batch": 1, "context": 1024, "us": 10.0},
        {"batch": 8, "context": 1024, "us": 20.0},
    ],
    "prefill": [{"case": "8K fresh", "us": 100.0}],
}
AFTER = {
    "decode": [
        {"batch": 1, "context": 1024, "us": 10.2},
        {"batch": 8, "context": 1024, "us": 25.0},
    ],
    "prefill": [{"case": "8K chunked", "us": 90.0}],
}
MLA = {"rows": [{"heads": 16, "cache": "bf16", "batch": 1, "context": 4096, "q_len": 1, "us": 8.0}]}


def test_rows_pair_by_their_names_and_ratios_are_after_over_before():
    table, unmatched = compare_runs.compare(BEFORE, AFTER)
    assert [(k, r) for k, _, _, r in table] == [
        (("decode", 1, 1024), 10.2 / 10.0),
        (("decode", 8, 1024), 25.0 / 20.0),
    ]
    assert unmatched == [("prefill", "8K chunked"), ("prefill", "8K fresh")]


def test_the_table_marks_rows_outside_the_tolerance(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(BEFORE))
    (tmp_path / "a.json").write_text(json.dumps(AFTER))
    assert compare_runs.main([str(tmp_path / "b.json"), str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "| decode | 1 1024 | 10.0 | 10.2 | 1.020 | yes |" in out
    assert "| decode | 8 1024 | 20.0 | 25.0 | 1.250 | **no** |" in out
    assert "2 rows; after / before 1.020-1.250; 1 outside +-3%" in out


def test_mla_rows_are_keyed_by_heads_cache_batch_context_and_query_tokens():
    assert compare_runs.keyed_rows(MLA) == {("rows", 16, "bf16", 1, 4096, 1): 8.0}
