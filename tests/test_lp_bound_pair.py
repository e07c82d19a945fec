"""The pair bound of ``dyncp.planner.lp_bound`` on a 64-rank batch where it binds.

Two sequences that each want half the ranks share a wave; the shorter one's group idles or runs
short sequences at a ring's price until the longer one ends. The bound must rise above the LP
(the pair bound is what binds) and stay at or below the seconds of a real, validated plan.
"""

from __future__ import annotations

import numpy as np

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
