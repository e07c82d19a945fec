"""Pass alignment under a budget: it never spends more than it was given, a spent budget hands
out the unaligned plan priced in lockstep (never an exception), deterministic mode is
reproducible and bounded by work, and an unlimited budget finds what a full run finds."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from planner_helpers import assert_exactly_once

from dyncp.cost_model import CostModel
from dyncp.cost_model.pass_timing import price_passes
from dyncp.cost_model.sharding import ShardingCost
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.plan import pass_schedule
from dyncp.planner import Planner
from dyncp.planner.improvement.pass_align import AlignBudget, align_best, align_passes
from dyncp.planner.planner import ALIGN_SHARE, ALIGN_WORK_PER_SECOND

BLOCK = 218_112_000  # a Llama-3-8B-like block, as in test_pass_align


@functools.cache
def model() -> CostModel:
    return CostModel.load("h100-reference", 8)


def sharding(world: int) -> ShardingCost:
    return ShardingCost.from_profile(
        model().profile, world=world, ranks_per_node=8, unit_params=(BLOCK,) * 32
    )


@functools.cache
def batch(world: int, capacity: int = 8192, seed: int = 0) -> tuple[int, ...]:
    # Short Wikipedia documents, 12 a rank: the unaligned plans have empty passes.
    lengths = load_lengths(resolve_dataset("wikipedia"))
    lengths = lengths[lengths <= capacity]
    return tuple(int(n) for n in np.random.default_rng(seed).choice(lengths, 12 * world))


def free_plan(world: int):
    return Planner(
        model(), world=world, ranks_per_node=8, capacity=8192, deterministic=True, cpsat=None
    ).plan(batch(world))


def test_a_spent_budget_hands_out_the_unaligned_plan_priced_in_lockstep():
    plan = free_plan(16)
    cost = price_passes(plan, model(), sharding(16))
    assert cost.empty > 0
    for budget in (AlignBudget(work=0), AlignBudget(deadline=time.perf_counter() - 1.0)):
        index, out, report = align_best([plan, plan], model(), sharding(16), budget)
        assert index == 0 and out.waves == plan.waves
        assert not report.complete and report.work == 0
        assert report.empty_after == report.empty_before == cost.empty
        assert report.seconds_after == pytest.approx(cost.step_seconds, rel=1e-12)


@pytest.mark.parametrize("work", [1, 40, 200, 1000])
def test_alignment_never_spends_more_than_its_work_and_improves_with_more(work):
    plan = free_plan(16)
    full_plan, full = align_passes(plan, model(), sharding(16))
    assert full.complete and full.empty_after == 0
    out, report = align_passes(plan, model(), sharding(16), AlignBudget(work=work))
    out.validate()
    assert_exactly_once(out, len(plan.lengths))
    assert report.work <= work
    assert report.empty_after <= report.empty_before
    if report.complete:  # the same drafts as the unlimited run, so the same plan
        assert out.waves == full_plan.waves
    # Drafts tried under a smaller budget are a prefix of those under a larger one.
    _, less = align_passes(plan, model(), sharding(16), AlignBudget(work=work // 2))
    assert less.empty_after >= report.empty_after


def test_deterministic_alignment_is_bounded_by_work_and_reproducible():
    world = 64
    options = dict(
        world=world,
        ranks_per_node=8,
        capacity=8192,
        deterministic=True,
        cpsat=None,
        passes="aligned",
        sharding=sharding(world),
    )
    plans = []
    for limit in (0.001, 0.001, 1.0):
        plan = Planner(model(), time_limit=limit, **options).plan(batch(world))
        plan.validate()
        assert_exactly_once(plan, len(batch(world)))
        report = plan.stats.alignment
        assert report["work"] <= ALIGN_SHARE * limit * ALIGN_WORK_PER_SECOND
        assert plan.stats.predicted_step_seconds == pytest.approx(
            price_passes(plan, model(), sharding(world)).step_seconds, rel=1e-12
        )
        plans.append(plan)
    small, again, large = plans
    assert small.waves == again.waves  # no clock: the same plan on every rank
    assert not small.stats.alignment["complete"]
    assert small.stats.alignment["empty_after"] == small.stats.alignment["empty_before"] > 0
    assert large.stats.alignment["complete"] and pass_schedule(large).empty == 0


def test_a_wall_clock_planner_hands_out_a_valid_plan_whatever_time_is_left():
    # 1 ms for the whole step at 64 ranks: the construction overruns it, so alignment finds
    # its deadline passed; the plan handed out is the unaligned one, priced in lockstep.
    world = 64
    planner = Planner(
        model(),
        world=world,
        ranks_per_node=8,
        capacity=8192,
        time_limit=0.001,
        passes="aligned",
        sharding=sharding(world),
    )
    plan = planner.plan(batch(world))
    plan.validate()
    assert_exactly_once(plan, len(batch(world)))
    report = plan.stats.alignment
    assert report["empty_after"] <= report["empty_before"]
    assert plan.stats.predicted_step_seconds == pytest.approx(
        price_passes(plan, model(), sharding(world)).step_seconds, rel=1e-12
    )
