"""The planner's objective is the dataflow timing (``timing=``), and the re-layout it uses.

What the design guarantees, and nothing more: in deterministic mode without CP-SAT, the dataflow
planner's plan is never slower, timed as dataflow, than the plan the same planner makes under the
barrier objective (it keeps the barrier's pick as a candidate and runs the local search on it
too); every plan is valid and priced under the planner's timing; deterministic plans repeat.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology, plan_digest
from dyncp.planner.construction.dataflow import relayout
from dyncp.planner.planner import POLICIES, Planner

REL = 1e-12


@functools.cache
def model(ranks_per_node: int = 4) -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node)


def planner(timing: str, *, world: int = 16, capacity: int = 2048, **kw) -> Planner:
    kw.setdefault("deterministic", True)
    kw.setdefault("max_length", world * capacity // 2)
    return Planner(model(), world=world, ranks_per_node=4, capacity=capacity, timing=timing, **kw)


def batch(seed: int, n: int = 40, world: int = 16, capacity: int = 2048) -> np.ndarray:
    """Mostly short documents with a long tail (some need groups of several ranks)."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(np.log(capacity / 3), 1.3, n)
    return np.clip(np.rint(x), 1, world * capacity // 2).astype(np.int64)


def groups_of(plan) -> list[Counter]:
    """Per wave, the multiset of (size, heads, micro-batches) of its groups: what relayout keeps."""
    return [Counter((g.size, g.heads, g.microbatches) for g in w.groups) for w in plan.waves]


@pytest.mark.parametrize("seed", range(6))
def test_dataflow_plan_never_slower_than_the_barrier_plan(seed: int) -> None:
    lengths = batch(seed)
    made = {t: planner(t, cpsat=None).plan(lengths) for t in TIMINGS}
    for plan in made.values():
        plan.validate()
        assert sorted(i for _, _, mb in plan.microbatches() for i in mb.seq_ids) == list(
            range(len(lengths))
        )
    dataflow = evaluate_plan(made["dataflow"], model(), timing="dataflow").step_seconds
    barrier_made = evaluate_plan(made["barrier"], model(), timing="dataflow").step_seconds
    assert dataflow <= barrier_made * (1 + REL)
    assert made["dataflow"].stats["predicted_step_seconds"] == pytest.approx(dataflow, rel=REL)
    assert made["dataflow"].stats["timing"] == "dataflow"
    assert made["barrier"].stats["timing"] == "barrier"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("timing", TIMINGS)
def test_every_policy_is_priced_under_the_planners_timing(policy: str, timing: str) -> None:
    plan = planner(timing, policy=policy).plan(batch(11))
    plan.validate()
    cost = evaluate_plan(plan, model(), timing=timing)
    st = plan.stats
    assert st["timing"] == timing
    assert st["predicted_step_seconds"] == pytest.approx(cost.step_seconds, rel=REL)
    assert st["imbalance"] == pytest.approx(cost.imbalance, rel=REL)
    assert st["efficiency"] == pytest.approx(cost.efficiency, rel=REL)


def test_default_timing_is_dataflow_and_unknown_timing_is_refused() -> None:
    p = Planner(model(), world=16, ranks_per_node=4, capacity=2048)
    assert p.timing == "dataflow"
    with pytest.raises(ValueError, match="unknown timing 'async'.*barrier, dataflow"):
        Planner(model(), world=16, ranks_per_node=4, capacity=2048, timing="async")


def test_deterministic_dataflow_plans_repeat() -> None:
    lengths = batch(3, n=60)
    first = plan_digest(planner("dataflow").plan(lengths))
    assert plan_digest(planner("dataflow").plan(lengths)) == first


@pytest.mark.parametrize("seed", range(4))
def test_relayout_keeps_the_groups_and_prices_itself_exactly(seed: int) -> None:
    lengths = batch(seed, n=60)
    plan = planner("barrier", cpsat=None).plan(lengths)
    cost = evaluate_plan(plan, model(), timing="dataflow")
    out = relayout(plan, cost, model().wave_overhead)
    if out is None:  # nothing to move: every group already on the ranks free first
        return
    seconds, moved = out
    moved.validate()
    assert groups_of(moved) == groups_of(plan)
    again = evaluate_plan(moved, model(), timing="dataflow")
    assert seconds == pytest.approx(again.step_seconds, rel=REL)
    # Each wave keeps its groups, so the barrier price does not change.
    assert evaluate_plan(moved, model(), timing="barrier").step_seconds == pytest.approx(
        evaluate_plan(plan, model(), timing="barrier").step_seconds, rel=REL
    )


def test_relayout_moves_a_late_wave_onto_the_ranks_free_first() -> None:
    """Wave 0: a long group on ranks 0-3 and a short one on 4-7; wave 1: one group of 4. Laid
    out at ranks 0-3 it waits for the long group; relayout moves it to 4-7."""
    from dyncp.plan import Group, MicroBatch, StepPlan, Wave

    topo = Topology(8, 4, 4096, (1, 2, 4, 8))
    lengths = (16000, 2000, 8000)
    plan = StepPlan(
        topo,
        lengths,
        (
            Wave((Group(0, 4, (MicroBatch((0,)),)), Group(4, 4, (MicroBatch((1,)),)))),
            Wave((Group(0, 4, (MicroBatch((2,)),)),)),
        ),
    )
    plan.validate()
    cost = evaluate_plan(plan, model(), timing="dataflow")
    out = relayout(plan, cost, model().wave_overhead)
    assert out is not None
    seconds, moved = out
    assert moved.waves[1].groups[0].start == 4
    assert seconds < cost.step_seconds
    assert seconds == pytest.approx(
        evaluate_plan(moved, model(), timing="dataflow").step_seconds, rel=REL
    )


def test_the_services_fallback_planner_keeps_the_timing() -> None:
    from dyncp.service import fallback_planner

    for timing in TIMINGS:
        fallback = fallback_planner(planner(timing, deterministic=False))
        assert fallback.timing == timing and fallback.deterministic
