"""DP agreement over gloo with 2 and 4 processes (invariant 3).

One all_gather per step; every rank reaches the same split decision and
per-micro-batch token counts as the pure `ForwardMode.decide` on the gathered
table; different TBO settings raise on every rank (rather than some ranks
entering per-micro-batch collectives the others skip).
"""

import pytest
import torch
from tbo_harness.dp_workers import agreement_worker, spawn

from atom_plugin.tbo import BatchShape, ForwardMode, TboConfig, plan_request_graphs

ON = TboConfig()


def dec(n):
    return BatchShape(n, n, 1 if n else None)


def pre(tokens, reqs=2):
    return BatchShape(reqs, tokens, None)


KEYS = [k for k, _ in plan_request_graphs([8, 16, 32, 64], 1, ON)]

SCENARIOS_4 = [
    ([dec(25), dec(30), dec(3), dec(17)], KEYS),  # replay split at 32 on every rank
    ([dec(25), dec(30), dec(3), dec(17)], []),  # eager split, counts = max halves
    ([dec(25), dec(30), dec(0), dec(17)], []),  # an idle rank: nobody splits eagerly
    ([dec(25), dec(30), dec(0), dec(17)], KEYS),  # ... but it joins a split replay
    ([dec(25), pre(40), dec(3), dec(17)], KEYS),  # a prefill rank: nobody splits
    ([pre(40), pre(9, 3), pre(100, 5), pre(2, 1)], []),  # prefill split, counts = max halves
    ([dec(100), dec(2), dec(64), dec(70)], KEYS),  # past the largest bucket: eager, 2 < 3
    # one rank's step must stay whole (a prefix hit on blocks written now): nobody splits
    ([pre(40), BatchShape(3, 90, None, splittable=False), pre(100, 5), pre(9, 3)], []),
]
SCENARIOS_2 = [(shapes[:2], keys) for shapes, keys in SCENARIOS_4]


MISMATCH = ([dec(25), dec(30)], KEYS, [TboConfig(), TboConfig(prefill=False)])


@pytest.mark.parametrize(("world", "scenarios"), [(2, SCENARIOS_2), (4, SCENARIOS_4)])
def test_ranks_agree_through_one_all_gather(world, scenarios, tmp_path):
    jobs = [(shapes, keys, [ON] * world) for shapes, keys in scenarios]
    if world == 2:
        jobs.append(MISMATCH)  # one spawn per world size keeps the test fast
    spawn(agreement_worker, world, jobs, str(tmp_path))
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for i, (shapes, keys) in enumerate(scenarios):
        modes = []
        for rank in range(world):
            mode, collectives = per_rank[rank][i]
            assert collectives == 1
            assert mode == ForwardMode.decide(shapes, rank, ON, keys)
            modes.append(mode)
        assert len({(m.split, m.replay, m.bucket, m.ubatch_num_tokens) for m in modes}) == 1
    if world == 4:
        split = [per_rank[0][i][0].split for i in range(len(scenarios))]
        assert split == [True, True, False, True, False, True, False, False]
    if world == 2:
        # Different TBO settings raise on every rank, after the same one collective.
        for rank in range(2):
            mode, collectives = per_rank[rank][-1]
            assert collectives == 1
            assert mode.startswith("ValueError: data-parallel ranks run different")
