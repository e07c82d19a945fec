"""dyncp is never slower than a baseline policy: the baselines are candidates of its pipeline."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import assert_exactly_once

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan
from dyncp.plan import Topology
from dyncp.planner import Planner
from dyncp.planner.baselines import BASELINES, BaselineCandidates

HEADS = (1, 2, 4, 8)


def sparse_batch(seed: int, n: int) -> np.ndarray:
    """Megatron's example lengths (lognormal mean 1,024, sigma 1.5, clipped to [128, 8192])."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1024) - 1.125, 1.5, n), 128, 8192).astype(np.int64)


def dense_batch(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(900), 1.5, n), 1, 60000).astype(np.int64)


# (profile, world, ranks per node, capacity, max length, batch): about 2 documents per rank on
# 4-GPU nodes (where dyncp's own construction lost to Megatron's scheduler), and a dense batch.
CASES = {
    "sparse": ("h100-megatron-dcp-gpt-plain", 64, 4, 2048, 8192, lambda s: sparse_batch(s, 128)),
    "dense": ("h100-reference", 16, 8, 4096, 16 * 4096, lambda s: dense_batch(s, 96)),
}


def planners(case: str, timing: str, **kw: object) -> tuple[CostModel, dict[str, Planner]]:
    profile, world, per_node, capacity, max_length, _ = CASES[case]
    model = CostModel.load(profile, per_node)
    common = dict(world=world, ranks_per_node=per_node, capacity=capacity, max_length=max_length)
    out = {
        p: Planner(model, policy=p, timing=timing, deterministic=True, cpsat=None, **common, **kw)
        for p in (*BASELINES, "dyncp")
    }
    return model, out


@pytest.mark.parametrize("timing", TIMINGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_dyncp_is_never_slower_than_the_best_baseline(case: str, timing: str) -> None:
    model, ps = planners(case, timing)
    make = CASES[case][5]
    for seed in range(2):
        lengths = make(seed)
        plans = {p: planner.plan(lengths) for p, planner in ps.items()}
        seconds = {p: evaluate_plan(x, model, timing=timing).step_seconds for p, x in plans.items()}
        plans["dyncp"].validate()
        assert_exactly_once(plans["dyncp"], len(lengths))
        assert plans["dyncp"].policy == "dyncp"
        best = min(seconds[p] for p in BASELINES)
        assert seconds["dyncp"] <= best * (1 + 1e-12), (seed, seconds)
        assert set(plans["dyncp"].stats["baseline_seconds"]) == set(BASELINES)


def test_the_pipeline_hands_out_a_baseline_where_its_search_loses() -> None:
    """On sparse batches the search alone ties or loses to a baseline on some steps (measured:
    15 of 30 at 64 GPUs, by at most 0.4%); the pipeline then takes the baseline, and its plan
    is never slower than the search's own."""
    model, ps = planners("sparse", "dataflow")
    _, alone = planners("sparse", "dataflow", baselines=False)
    chosen = []
    for seed in (1, 2):  # seed 2: the search's own plan is 0.1% slower than Megatron's
        lengths = sparse_batch(seed, 128)
        plan = ps["dyncp"].plan(lengths)
        own = alone["dyncp"].plan(lengths)
        mine = evaluate_plan(plan, model, timing="dataflow").step_seconds
        assert mine <= evaluate_plan(own, model, timing="dataflow").step_seconds * (1 + 1e-12)
        assert "baseline_seconds" not in own.stats
        chosen.append(plan.stats.get("chosen", ""))
    assert any(c.startswith("baseline:") for c in chosen), chosen


def test_the_hybrid_policy_is_never_slower_than_a_baseline() -> None:
    model = CostModel.load("h100-reference", 8)
    common = dict(world=16, ranks_per_node=8, capacity=4096, max_length=16 * 4096)
    hybrid = Planner(
        model, policy="dyncp-hybrid", head_sizes=HEADS, deterministic=True, cpsat=None, **common
    )
    bases = [Planner(model, policy=p, deterministic=True, **common) for p in BASELINES]
    for seed in range(2):
        lengths = dense_batch(seed, 64)
        plan = hybrid.plan(lengths)
        plan.validate()
        mine = evaluate_plan(plan, model, timing=hybrid.timing).step_seconds
        best = min(
            evaluate_plan(b.plan(lengths), model, timing=hybrid.timing).step_seconds for b in bases
        )
        assert mine <= best * (1 + 1e-12)


def test_baselines_that_cannot_plan_a_batch_are_no_candidates() -> None:
    """Megatron's scheduler plans on powers of two; on a menu of 1, 3 and 6 ranks a sequence
    that needs 6 ranks has no power of two to run on."""
    topo = Topology(6, 6, 1000, (1, 3, 6))
    model = CostModel.load("h100-reference", 6)
    lengths = np.array([5500, 300, 200, 100])
    got = dict(BaselineCandidates(topo).plans(lengths, model))
    assert "megatron" not in got and set(got) <= set(BASELINES) and got
    plan = Planner(
        model, world=6, ranks_per_node=6, capacity=1000, group_sizes=(1, 3, 6), deterministic=True
    ).plan(lengths)
    plan.validate()
    assert_exactly_once(plan, len(lengths))


def test_a_deadline_skips_baselines_expected_to_finish_late() -> None:
    topo = Topology(16, 8, 4096)
    model = CostModel.load("h100-reference", 8)
    candidates = BaselineCandidates(topo)
    lengths = dense_batch(0, 64)
    assert list(candidates.plans(lengths, model, deadline=0.0)) == []  # long past
    assert [n for n, _ in candidates.plans(lengths, model)] == list(BASELINES)
    assert set(candidates.per_sequence) == set(BASELINES)
