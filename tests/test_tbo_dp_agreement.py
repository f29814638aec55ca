"""Both model runners' DP agreement (`atom_plugin.vllm.tbo.dp_agreement`): the one
all_gather over vLLM's DP CPU group, and none in a step vLLM runs without DP
coordination (the other ranks would never join it)."""

import pytest
from vllm.distributed import parallel_state
from vllm.v1.worker.dp_utils import skip_dp_coordination

from atom_plugin.tbo import BatchShape, ForwardMode, TboConfig, plan_request_graphs
from atom_plugin.tbo import dp as tbo_dp
from atom_plugin.vllm.tbo import dp_agreement, model_runner, mrv2_runner

CONFIG = TboConfig()
KEYS = [k for k, _ in plan_request_graphs([8, 16, 32], 1, CONFIG)]
SHAPE = BatchShape(25, 25, 1)


@pytest.fixture
def gathers(monkeypatch):
    """The DP group's CPU group each agreement gathered over (a stand-in group)."""
    seen = []
    group = object()
    monkeypatch.setattr(
        parallel_state, "get_dp_group", lambda: type("DP", (), {"cpu_group": group})()
    )

    def decide(shape, config, graph_keys, group):
        seen.append(group)
        return ForwardMode.decide([shape, shape], 0, config, graph_keys)

    monkeypatch.setattr(tbo_dp, "decide_across_dp", decide)
    return seen, group


def test_both_runners_take_the_one_agreement():
    assert model_runner.agree_across_dp is dp_agreement.agree_across_dp
    assert mrv2_runner.agree_across_dp is dp_agreement.agree_across_dp


def test_a_coordinated_step_gathers_over_the_dp_cpu_group(gathers):
    seen, group = gathers
    mode = dp_agreement.agree_across_dp(SHAPE, CONFIG, KEYS)
    assert seen == [group]
    assert mode == ForwardMode.decide([SHAPE, SHAPE], 0, CONFIG, KEYS)


def test_a_step_without_dp_coordination_decides_alone(gathers):
    seen, _ = gathers
    with skip_dp_coordination():
        mode = dp_agreement.agree_across_dp(SHAPE, CONFIG, KEYS)
    assert seen == []
    assert mode == ForwardMode.decide([SHAPE], 0, CONFIG, KEYS)
