"""The K3 serving benchmark (benchmarks/k3_serving.py) at toy scale on vLLM's CPU build.

`--smoke` takes the path the GPU run takes, with a tiny Llama and 8,192 ids: the model
folder and its synthetic K3 tokenizer, one `vllm serve` per configuration (the plugin's
`atom_kimi_k3`, and vLLM's `kimi_k3` with the plugin disabled), streamed requests of the
tool mix at each concurrency, vLLM's `/metrics`, the calls' validation. What the
channel guarantees is checked (every call it let finish validates); the figures and
the forced content's outcomes (how many requests end in a call within max_tokens) are
not.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import k3_serving
from benchmarks.k3_serving_model import build_tokenizer

pytestmark = pytest.mark.vllm


def test_smoke_run_serves_the_mix_under_both_parsers(tmp_path):
    rows_path, table_path = tmp_path / "rows.json", tmp_path / "table.md"
    configs = "atom:parameter,vllm:parameter"
    argv = ["--smoke", "--configs", configs, "--json", str(rows_path), "--out", str(table_path)]
    assert k3_serving.main(argv) == 0
    rows = json.loads(rows_path.read_text())
    assert [(r["config"], r["concurrency"]) for r in rows] == [
        ("atom:parameter", 1), ("atom:parameter", 3), ("vllm:parameter", 1), ("vllm:parameter", 3)
    ]  # fmt: skip
    for row in rows:
        assert row["errors"] == 0, row
        assert row["output_tokens"] > 0 and row["tok_s"] > 0
        assert all(v is not None for v in row["ttft_ms"] + row["tpot_ms"]), row  # /metrics
    atom = [r for r in rows if r["config"].startswith("atom")]
    assert sum(r["calls"] for r in atom) > 0
    assert all(r["valid"] == r["calls"] for r in atom), atom  # the channel's calls validate
    table = table_path.read_text()
    assert "parameter, C=1:" in table and "parameter, C=3:" in table


def test_the_mix_cycles_required_named_and_auto_with_the_biases_it_documents(tmp_path):
    tokenizer = build_tokenizer(tmp_path, 8192)
    names = ("<|open|>", "<|close|>", "<|sep|>", "tools", "response", '"')
    ids = {n: tokenizer.encode(n, add_special_tokens=False) for n in names}
    assert all(len(v) == 1 for v in ids.values()), ids
    ids = {n: v[0] for n, v in ids.items()}
    bodies = [k3_serving.request_body("m", i, 64, ids) for i in range(6)]
    choices = [b["tool_choice"] for b in bodies]
    assert choices[0] == "required" and choices[2] == "auto" and choices[3] == "required"
    assert choices[1]["function"]["name"] != choices[4]["function"]["name"]
    required, auto = bodies[0]["logit_bias"], bodies[2]["logit_bias"]
    assert required == {str(ids["<|close|>"]): 30, str(ids["response"]): 30,
                        str(ids["<|sep|>"]): 30, str(ids['"']): 20}  # fmt: skip
    assert set(auto) == {str(ids[n]) for n in ("<|open|>", "tools", "<|sep|>", "<|close|>", '"')}
    with pytest.raises(ValueError, match="is not one of atom:function"):
        k3_serving.Config.parse("atom:strict")
