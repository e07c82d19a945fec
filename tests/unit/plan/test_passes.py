"""A plan read as passes: counts, empty passes, and the lockstep property the runners rely on."""

from __future__ import annotations

import numpy as np
import pytest

from dyncp.cost_model import CostModel, load_profile
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave, pass_schedule
from dyncp.planner import Planner


def hand_plan() -> StepPlan:
    mb = lambda *ids: MicroBatch(tuple(ids))  # noqa: E731
    waves = (
        Wave((Group(0, 1, (mb(0), mb(1), mb(2))), Group(2, 2, (mb(3),)))),  # rank 1 idle
        Wave((Group(0, 4, (mb(4), mb(5))),)),
    )
    plan = StepPlan(Topology(world=4, ranks_per_node=4, capacity=1000), (10,) * 6, waves)
    plan.validate()
    return plan


def test_passes_follow_the_busiest_group_of_each_wave():
    s = pass_schedule(hand_plan())
    assert s.per_wave == (3, 2) and s.passes == 5 and s.rank_passes == 20
    assert s.busy == 3 + 2 * 1 + 4 * 2 and s.empty == 7 and not s.aligned
    assert [s.empty_of_rank(r) for r in range(4)] == [0, 3, 2, 2]
    r2 = s.of_rank(2)
    assert [(p.wave, p.index, p.empty) for p in r2] == [
        (0, 0, False),
        (0, 1, True),
        (0, 2, True),
        (1, 0, False),
        (1, 1, False),
    ]
    assert all(p.group is None for p in s.of_rank(1)[:3])
    with pytest.raises(ValueError, match="rank must be in"):
        s.of_rank(4)


def test_every_rank_runs_as_many_passes_and_group_members_meet_at_the_same_index():
    rng = np.random.default_rng(3)
    model = CostModel(load_profile("h100-reference"), 8)
    planner = Planner(model, world=8, ranks_per_node=8, capacity=4096, deterministic=True)
    for _ in range(3):
        plan = planner.plan(rng.integers(16, 9000, size=40).tolist())
        s = pass_schedule(plan)
        per_rank = [s.of_rank(r) for r in range(8)]
        assert {len(p) for p in per_rank} == {s.passes}
        seen = {}
        for passes in per_rank:
            for k, p in enumerate(passes):
                if not p.empty:
                    seen.setdefault(id(p.microbatch), set()).add(k)
        assert all(len(ks) == 1 for ks in seen.values())  # one pass index per micro-batch
        assert len(seen) == sum(1 for _ in plan.microbatches())
        assert s.empty == s.rank_passes - sum(g.size for _, g, _ in plan.microbatches())
