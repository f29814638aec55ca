"""When vLLM's runner replays split decode graphs, and why not otherwise (`split_decode_graphs`)."""

import pytest

from atom_plugin.tbo import TboConfig
from atom_plugin.tbo.graphs import RerunGraphs
from atom_plugin.vllm.tbo_graphs import TEST_GRAPHS_ENV, split_decode_graphs

CONFIG = TboConfig(decode_min_requests=8)
OURS = ["ATOM_AITER", "ATOM_AITER_MLA"]


def choose(device="cuda", graphs_on=True, sizes=(1, 2, 4, 8, 16), backends=OURS, config=CONFIG):
    def no_pool():
        raise AssertionError("no CUDA graph pool is asked for unless graphs are recorded")

    return split_decode_graphs(config, device, graphs_on, list(sizes), 16, backends, no_pool)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"config": TboConfig(decode=False)}, "decode steps do not split"),
        ({"device": "cpu"}, "no CUDA graphs on cpu"),
        ({"graphs_on": False}, "--enforce-eager"),
        ({"backends": ["ATOM_AITER", "FLASH_ATTN"]}, "attention backend FLASH_ATTN is not one of"),
        ({"sizes": (1, 2, 4)}, "no capture size of [1, 2, 4] reaches tbo_decode_min_requests=8"),
    ],
)
def test_split_decode_steps_stay_eager_and_say_why(monkeypatch, kwargs, why):
    monkeypatch.delenv(TEST_GRAPHS_ENV, raising=False)
    graphs, reason = choose(**kwargs)
    assert graphs is None and why in reason


def test_cpu_test_switch_records_the_named_buckets_on_the_rerun_stand_in(monkeypatch):
    monkeypatch.setenv(TEST_GRAPHS_ENV, "4,8,16,64")
    graphs, reason = choose(device="cpu")
    assert reason == "" and isinstance(graphs.graphs, RerunGraphs)
    assert [k.bucket for k in graphs.keys] == [4, 8, 16]  # 64 exceeds max_num_reqs 16
    assert graphs.split_buckets == [8, 16]  # tbo_decode_min_requests=8


@pytest.mark.parametrize("value", ["4,x", "", "0,8"])
def test_bad_test_switch_is_refused_with_its_value(monkeypatch, value):
    monkeypatch.setenv(TEST_GRAPHS_ENV, value)
    if value == "":
        assert choose(device="cpu")[0] is None  # unset and empty are the same: off
        return
    with pytest.raises(ValueError, match=f"{TEST_GRAPHS_ENV}={value!r}"):
        choose(device="cpu")
