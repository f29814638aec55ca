"""When vLLM's runner replays split decode graphs, and why not otherwise (`split_decode_graphs`)."""

import re

import pytest
from tbo_harness.fault_plugin import fault_plugin_env
from tbo_harness.rerun_graphs import RerunGraphs, split_decode_rerun_graphs

from atom_plugin.tbo import TboConfig
from atom_plugin.vllm.tbo.decode_graphs import split_decode_graphs

CONFIG = TboConfig(decode_min_requests=8)
OURS = ["ATOM_AITER", "ATOM_AITER_MLA"]


def no_pool():
    raise AssertionError("no CUDA graph pool is asked for unless graphs are recorded")


def choose(device="cuda", graphs_on=True, sizes=(1, 2, 4, 8, 16), backends=OURS, config=CONFIG):
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
def test_split_decode_steps_stay_eager_and_say_why(kwargs, why):
    graphs, reason = choose(**kwargs)
    assert graphs is None and why in reason


def test_cpu_stand_in_records_the_named_buckets_on_rerun_graphs():
    choose_rerun = split_decode_rerun_graphs([4, 8, 16, 64])
    graphs, reason = choose_rerun(CONFIG, "cpu", False, [1, 2], 16, OURS, no_pool)
    assert reason == "" and isinstance(graphs.graphs, RerunGraphs)
    assert [k.bucket for k in graphs.keys] == [4, 8, 16]  # 64 exceeds max_num_reqs 16
    assert graphs.split_buckets == [8, 16]  # tbo_decode_min_requests=8


@pytest.mark.parametrize("buckets", [[4, "8"], [], [0, 8]])
def test_bad_stand_in_buckets_are_refused_with_their_value(tmp_path, buckets):
    with pytest.raises(ValueError, match=re.escape(f"rerun_graphs={buckets!r}")):
        fault_plugin_env(tmp_path, rerun_graphs=buckets)
