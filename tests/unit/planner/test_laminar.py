"""The layout search of small batches (``dyncp.planner.improvement.laminar``) and its place in the
planner."""

from __future__ import annotations

import numpy as np
import pytest

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner import Planner
from dyncp.planner.bounds.lp_bound import lp_lower_bound
from dyncp.planner.improvement.laminar import MAX_SEQUENCES, LaminarImprover

PLAIN = "h100-megatron-dcp-gpt-plain"  # micro-batch seconds = fixed + sum of r / c exactly


def serial_plan(lengths: list[int], topo: Topology) -> StepPlan:
    """Every sequence alone on all ranks, one wave each: valid, and slow."""
    waves = tuple(
        Wave(groups=(Group(start=0, size=topo.world, microbatches=(MicroBatch(seq_ids=(i,)),)),))
        for i in range(len(lengths))
    )
    return StepPlan(topology=topo, lengths=tuple(lengths), waves=waves)


def sparse_batch(n: int, seed: int) -> list[int]:
    """Megatron's sparse lengths (``bench/planner_bench.py``): lognormal mean 1,024, sigma 1.5,
    clipped to [128, 8192]."""
    rng = np.random.RandomState(seed)
    x = np.clip(rng.lognormal(np.log(1024) - 1.5**2 / 2, 1.5, n), 128, 8192)
    return x.astype(np.int64).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_is_valid_and_priced_as_modelled(seed: int) -> None:
    """8 ranks on 4-rank nodes, 20 sparse documents: the plan covers every sequence once within
    capacity (validate), its groups nest, so under the plain profile (no overlap: the model's
    micro-batch terms are exact) its dataflow step is at most the model's objective (which may
    also count an empty micro-batch or a slack maximum) up to the microsecond rounding, and no
    plan beats the tight bound."""
    topo = Topology(8, 4, 2048)
    model = CostModel.load(PLAIN, ranks_per_node=4)
    lengths = sparse_batch(20, seed)
    start = serial_plan(lengths, topo)
    plan, result = LaminarImprover(deterministic=True).solve(start, model, 2.0)
    assert plan is not None and result.objective_seconds is not None
    plan.validate()
    ids = sorted(i for _, _, mb in plan.microbatches() for i in mb.seq_ids)
    assert ids == list(range(len(lengths)))
    step = evaluate_plan(plan, model, timing="dataflow").step_seconds
    assert step <= result.objective_seconds + 1e-6 * (len(lengths) + 16)
    bound = lp_lower_bound(np.asarray(lengths), topo, model, timing="dataflow").seconds
    assert bound <= step * (1 + 1e-9)
    assert step < evaluate_plan(start, model, timing="dataflow").step_seconds


def test_nested_groups_run_biggest_first() -> None:
    """Realised groups: each rank meets its groups in descending size, and two groups that share
    a rank are in different waves."""
    topo = Topology(8, 4, 2048)
    model = CostModel.load(PLAIN, ranks_per_node=4)
    lengths = [8000, 6000, 3000, 2500, 1500, 900, 700, 400, 300, 200, 128, 128]
    plan, _ = LaminarImprover(deterministic=True).solve(serial_plan(lengths, topo), model, 2.0)
    assert plan is not None
    plan.validate()
    for rank in range(topo.world):
        sizes = [g.size for w in plan.waves for g in w.groups if g.start <= rank < g.start + g.size]
        assert sizes == sorted(sizes, reverse=True)


def test_large_batches_are_skipped() -> None:
    topo = Topology(8, 4, 2048)
    model = CostModel.load(PLAIN, ranks_per_node=4)
    lengths = [128] * (MAX_SEQUENCES + 1)
    plan, result = LaminarImprover().solve(serial_plan(lengths, topo), model, 1.0)
    assert plan is None and result.status.startswith("SKIPPED")


def test_planner_keeps_the_layout_only_when_faster() -> None:
    """Deterministic planners with and without the layout search on small sparse batches: the
    plan with it is never slower, and on one of these it is faster (the constructor's waves miss
    the nested layout); at the default time limit the search does not run."""
    kw = dict(world=8, ranks_per_node=4, capacity=2048, max_length=8192, deterministic=True)
    model = CostModel.load(PLAIN, ranks_per_node=4)
    faster = 0
    for seed in range(3):
        lengths = sparse_batch(24, seed)
        with_it = Planner(model, time_limit=1.0, **kw)
        without = Planner(model, time_limit=1.0, layout=False, **kw)
        a = with_it.plan(lengths)
        b = without.plan(lengths)
        assert "layout" in a.stats and "layout" not in b.stats
        assert a.stats["predicted_step_seconds"] <= b.stats["predicted_step_seconds"] * (1 + 1e-12)
        faster += a.stats["predicted_step_seconds"] < b.stats["predicted_step_seconds"]
    assert faster >= 1
    quick = Planner(model, time_limit=0.1, **kw).plan(sparse_batch(24, 0))
    assert quick.stats["layout"]["status"].startswith("SKIPPED")


def test_deterministic_layouts_repeat() -> None:
    """Deterministic mode (one worker, deterministic time, fixed seed): the same batch gives the
    same plan from two planners."""
    kw = dict(world=8, ranks_per_node=4, capacity=2048, max_length=8192, deterministic=True)
    model = CostModel.load(PLAIN, ranks_per_node=4)
    lengths = sparse_batch(24, 1)
    a = Planner(model, time_limit=1.0, **kw).plan(lengths)
    b = Planner(model, time_limit=1.0, **kw).plan(lengths)
    assert a.stats["layout"]["status"] in ("OPTIMAL", "FEASIBLE")
    assert a.waves == b.waves
