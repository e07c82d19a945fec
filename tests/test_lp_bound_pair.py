"""The pair bound of ``dyncp.planner.lp_bound`` on a 64-rank batch where it binds.

Two sequences that each want half the ranks share a wave; the shorter one's group idles or runs
short sequences at a ring's price until the longer one ends. The bound must rise above the LP
(the pair bound is what binds) and stay at or below the seconds of a real, validated plan.
"""

from __future__ import annotations

import numpy as np
import pytest

import dyncp.planner.lp_bound as lp_bound
from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.planner import Planner


def test_pair_bound_binds_and_stays_below_a_plan(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    short = np.clip(rng.lognormal(np.log(600), 1.2, 510), 1, 8192).astype(np.int64)
    lengths = np.r_[131072, 113486, short]
    model = CostModel.load("h100-reference", 8)
    planner = Planner(model, world=64, ranks_per_node=8, capacity=8192, max_length=131072)
    plan = planner.plan(lengths)
    plan.validate()
    seconds = evaluate_plan(plan, model).step_seconds
    with_pair = lp_bound.lp_lower_bound(lengths, plan.topology, model)
    monkeypatch.setattr(lp_bound, "_pair_value", lambda *args, **kwargs: 0.0)
    without = lp_bound.lp_lower_bound(lengths, plan.topology, model)
    assert without.seconds * 1.01 < with_pair.seconds <= seconds


def test_riders_priced_at_their_own_groups_size() -> None:
    """Two groups share a wave (sizes 4 and 2 of 8 ranks, level 10 s): the size-4 group has 5
    rank-seconds of room, the size-2 group 0.5. The one other sequence (least r 1) costs 10
    rank-seconds as a rider on 4 ranks, 2 on 2. Both rooms together at its cheaper weight
    would let it ride whole (saving 1); each group's own room at its own weight saves at most
    5/10 + 0.5/2 = 0.75. The bound takes the smaller saving: ((4 + 2) 10 + 1 - 0.75) / 8."""
    inf = np.inf
    r = np.array([[inf, inf, 1.0], [inf, 19.5, 2.0], [35.0, 25.0, 10.0]])
    tables = ([1, 2, 4], 8, r, r.min(axis=0), np.zeros(3))
    value = lp_bound._pair_value((0, 1), (2, 1), (10.0, 4.0), inf, tables)
    assert value == pytest.approx((60 + 1 - 0.75) / 8, rel=1e-12)
