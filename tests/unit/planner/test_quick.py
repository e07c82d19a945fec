"""The quick construction and the fallback that uses it where the search would not fit its budget.

Properties asserted: quick plans are valid plans of the whole batch (every sequence once, within
capacity, on allowed blocks) on menus of powers of two, on menus whose sizes do not nest and
without single ranks; they are a pure function of the batch (the same digest twice); on a
Wikipedia step at 512 ranks the fallback runs the quick construction (the search's estimated
seconds, a count of sequences, exceed its budget) and its predicted step is within 6% of the
closed-form lower bound (the normal planner's is 3-4% above it there); a batch small enough for
the budget is still searched, and gets exactly the search's plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dyncp.cost_model import CostModel
from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import Topology, plan_digest
from dyncp.planner import Planner
from dyncp.planner.batch import Batch
from dyncp.planner.budget import DEFAULT_STEP_BUDGET
from dyncp.planner.construction.quick import (
    SEARCH_SECONDS_PER_SEQUENCE,
    QuickConstructor,
    quick_chosen,
)
from dyncp.service import fallback_planner


def _wikipedia(world: int, capacity: int = 8192, seed: int = 0) -> np.ndarray:
    """One global batch of 2 x world x capacity tokens of the bundled Wikipedia sample."""
    raw = load_lengths(resolve_dataset("wikipedia"))
    rng = np.random.default_rng(seed)
    tokens = 2 * world * capacity
    lengths = np.minimum(raw[rng.integers(0, len(raw), 4 * tokens // 300)], 8 * capacity)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


@pytest.mark.parametrize(
    ("world", "ranks_per_node", "sizes"),
    [(64, 8, ()), (72, 72, (1, 2, 3, 4, 6, 8, 9, 12, 18, 24, 36, 72)), (32, 8, (2, 4, 8, 16, 32))],
)
def test_quick_plans_are_valid_and_a_pure_function_of_the_batch(
    world: int, ranks_per_node: int, sizes: tuple[int, ...]
) -> None:
    model = CostModel.load("h100-reference", ranks_per_node=ranks_per_node)
    topo = Topology(world, ranks_per_node, 4096, sizes)
    lengths = _wikipedia(world, 4096, seed=world)
    plans = [QuickConstructor(Batch(lengths, topo), topo, model).best() for _ in range(2)]
    plans[0].validate()  # every sequence once, within capacity, on allowed blocks
    assert plan_digest(plans[0]) == plan_digest(plans[1])
    assert sorted(i for _, _, mb in plans[0].microbatches() for i in mb.seq_ids) == list(
        range(len(lengths))
    )


def test_the_fallback_at_scale_plans_quickly_and_close_to_the_bound() -> None:
    world = 512
    model = CostModel.load("h100-reference", ranks_per_node=8)
    normal = Planner(model, world=world, ranks_per_node=8, capacity=8192, cpsat=None)
    lengths = _wikipedia(world)
    plan = fallback_planner(normal).plan(lengths)
    budget = plan.stats["budget"]["seconds"]
    assert budget == pytest.approx(
        DEFAULT_STEP_BUDGET.seconds(plan.stats["budget"]["predicted_step_seconds"])
    )
    assert len(lengths) * SEARCH_SECONDS_PER_SEQUENCE > budget  # the search would not fit
    assert plan.stats["constructor"] == "quick"
    assert plan.stats["budget"]["units"] == "deterministic"
    bound = plan.stats["simple_lower_bound_seconds"]
    assert plan.stats.predicted_step_seconds <= 1.06 * bound, (
        plan.stats.predicted_step_seconds,
        bound,
    )


def test_a_batch_the_budget_can_search_is_searched() -> None:
    model = CostModel.load("h100-reference", ranks_per_node=8)
    normal = Planner(model, world=8, ranks_per_node=8, capacity=4096, cpsat=None)
    lengths = _wikipedia(8, 4096, seed=3)[:20]
    fallback = fallback_planner(normal)
    plan = fallback.plan(lengths)
    assert not quick_chosen("auto", len(lengths), plan.stats["budget"]["seconds"])
    assert plan.stats["constructor"] == "search"
    searched = Planner(model, dataclasses.replace(fallback.config, construction="search"))
    assert plan_digest(plan) == plan_digest(searched.plan(lengths))


def test_construction_is_checked() -> None:
    model = CostModel.load("h100-reference", ranks_per_node=8)
    with pytest.raises(ValueError, match="unknown construction 'fast'; choose one of search"):
        Planner(model, world=8, ranks_per_node=8, capacity=4096, construction="fast")


def test_quick_plans_of_the_hybrid_policy_choose_head_splits() -> None:
    model = CostModel.load("h100-reference", ranks_per_node=8)
    topo = dict(world=16, ranks_per_node=8, capacity=8192, head_sizes=(1, 2, 4, 8))
    quick = Planner(model, policy="dyncp-hybrid", deterministic=True, cpsat=None, **topo)
    quick = Planner(model, dataclasses.replace(quick.config, construction="quick"))
    plan = quick.plan(_wikipedia(16, seed=5))
    plan.validate()
    assert plan.stats["constructor"] == "quick" and plan.policy == "dyncp-hybrid"
    assert any(g.heads > 1 for _, g, _ in plan.microbatches())
