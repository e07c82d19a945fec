"""The tight LP bound (dyncp.planner.bounds.lp_bound): valid, never below the closed form, and
tighter where the closed form ignores what the LP knows (communication that is never hidden, fixed
costs per micro-batch and per rank, memory).

Validity is checked like the closed-form bound's (tests/unit/planner/test_bound.py): against random
valid plans and every policy's plans, under the table-form reference profile (overlapped ring), a
quadratic no-overlap profile, and the published FlexSP form (all-to-all, a link per group size).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_bound import (
    MODELS,
    assert_below,
    batches,
    cost_model,
    full_balanced_plan,
    random_plan,
    single_group_plans,
)

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.lp_bound import lp_lower_bound
from dyncp.planner.planner import Planner

ALL_MODELS = (*MODELS, "flexsp")


@functools.cache
def any_model(kind: str, ranks_per_node: int) -> CostModel:
    if kind == "flexsp":
        return CostModel.load("published-flexsp", ranks_per_node)
    return cost_model(kind, ranks_per_node)


@settings(max_examples=60, deadline=None)
@given(case=batches(), kind=st.sampled_from(ALL_MODELS), seed=st.integers(0, 2**32 - 1))
@example(case=(Topology(16, 8, 100), [1, 1600, 1, 1600]), kind="quadratic", seed=1)
@example(case=(Topology(4, 2, 512), [2048] * 3 + [1] * 5), kind="quadratic", seed=3)
@example(case=(Topology(8, 4, 64), [512, 512, 300, 300, 64, 64, 64]), kind="flexsp", seed=4)
def test_lp_bound_below_random_plans(
    case: tuple[Topology, list[int]], kind: str, seed: int
) -> None:
    topo, lengths = case
    model = any_model(kind, topo.ranks_per_node)
    lp = lp_lower_bound(np.asarray(lengths), topo, model)
    assert lp.status in ("OPTIMAL", "TRIVIAL")
    assert lp.seconds >= lp.simple_seconds == lower_bound(np.asarray(lengths), topo, model)
    rng = random.Random(seed)
    for _ in range(6):
        assert_below(lp.seconds, random_plan(lengths, topo, rng), model)


@settings(max_examples=25, deadline=None)
@given(case=batches(), kind=st.sampled_from(ALL_MODELS))
def test_lp_bound_below_dyncp_plans(case: tuple[Topology, list[int]], kind: str) -> None:
    topo, lengths = case
    model = any_model(kind, topo.ranks_per_node)
    planner = Planner(
        model,
        world=topo.world,
        ranks_per_node=topo.ranks_per_node,
        capacity=topo.capacity,
        group_sizes=topo.group_sizes,
        deterministic=True,
    )
    plan = planner.plan(lengths)
    assert plan.stats["bound"]["kind"] == "tight"
    assert_below(plan.stats["lower_bound_seconds"], plan, model)
    gap = plan.stats["predicted_step_seconds"] / plan.stats["lower_bound_seconds"] - 1
    assert plan.stats["gap_to_lower_bound"] == pytest.approx(gap, rel=1e-12)
    assert plan.stats["gap_to_simple_bound"] >= plan.stats["gap_to_lower_bound"]


@pytest.mark.parametrize("kind", ALL_MODELS)
@pytest.mark.parametrize("world,capacity", [(4, 64), (8, 100), (16, 512)])
def test_lp_bound_is_exact_for_one_sequence(kind: str, world: int, capacity: int) -> None:
    topo = Topology(world, 4, capacity)
    model = any_model(kind, 4)
    for length in sorted({1, 2, capacity - 1, capacity, capacity + 1, topo.max_length()}):
        best = min(evaluate_plan(p, model).step_seconds for p in single_group_plans(length, topo))
        assert lp_lower_bound(np.array([length]), topo, model).seconds == pytest.approx(
            best, rel=1e-9
        )


@pytest.mark.parametrize("kind", ALL_MODELS)
@pytest.mark.parametrize("world,capacity", [(4, 64), (8, 256), (16, 512)])
def test_lp_bound_below_full_balanced_plans(kind: str, world: int, capacity: int) -> None:
    """Full, perfectly balanced micro-batches: where the area and memory rows are tight."""
    topo = Topology(world, 4, capacity)
    model = any_model(kind, 4)
    for cp in (1, 2, world):
        for per_mb in (1, 2, 8, 64):
            for mbs in (1, 3):
                plan = full_balanced_plan(topo, cp, per_mb, mbs)
                if plan is not None:
                    bound = lp_lower_bound(np.asarray(plan.lengths), topo, model).seconds
                    assert_below(bound, plan, model)


def test_lp_bound_tight_on_a_balanced_no_overlap_plan() -> None:
    """Without overlap the protocol's split is exact, so on full, equal micro-batches at CP 2
    (each sequence's minimum size) the LP comes within 0.1% of the plan (fractional sizes keep
    it from meeting it), while the closed form, which leaves the all-to-all out, stays below."""
    topo = Topology(8, 8, 4096)
    model = CostModel.load("published-flexsp", 8)
    plan = full_balanced_plan(topo, 2, 1, 1)
    assert plan is not None
    lengths = np.asarray(plan.lengths)
    assert (lengths > topo.capacity).all()  # CP 2 is each sequence's minimum size
    seconds = evaluate_plan(plan, model).step_seconds
    lp = lp_lower_bound(lengths, topo, model)
    assert seconds * (1 - 1e-3) <= lp.seconds <= seconds * (1 + 1e-9)
    assert lp.simple_seconds < lp.seconds


def test_lp_bound_empty_batch() -> None:
    lp = lp_lower_bound(np.zeros(0, np.int64), Topology(4, 2, 64), cost_model("reference", 2))
    assert lp.seconds == 0.0 and lp.status == "TRIVIAL"


def test_lp_bound_names_a_sequence_too_long() -> None:
    with pytest.raises(ValueError, match="exceed the longest sequence"):
        lp_lower_bound(np.asarray([10_000]), Topology(4, 2, 64), cost_model("reference", 2))


def test_simple_bound_option_skips_the_lp() -> None:
    topo = Topology(8, 4, 256)
    model = cost_model("quadratic", 4)
    kw = dict(world=8, ranks_per_node=4, capacity=256, deterministic=True)
    lengths = [2048, 1000, 17, 300, 300, 1]
    simple = Planner(model, bound="simple", **kw).plan(lengths)
    tight = Planner(model, **kw).plan(lengths)
    assert simple.stats["bound"] == {"kind": "simple"}
    assert simple.stats["lower_bound_seconds"] == lower_bound(np.asarray(lengths), topo, model)
    assert tight.stats["lower_bound_seconds"] >= simple.stats["lower_bound_seconds"]
    with pytest.raises(ValueError, match="unknown bound 'exact'; choose one of tight, simple"):
        Planner(model, bound="exact", **kw)
