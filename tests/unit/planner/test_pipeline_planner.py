"""Pipelined planning: slots from any plan, the count aligned, the order searched, the PP
baselines, and ``Planner(pipeline=...)``'s guarantees (valid, never slower than the baselines or
than verl's order, deterministic)."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from planner_helpers import assert_exactly_once

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.pipeline_timing import price_pipeline
from dyncp.plan import Pipeline, PlanError, StepPlan, Topology, plan_digest
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.pipeline import (
    align_groups,
    megatron_pp_plan,
    static_pp_plan,
)
from dyncp.planner.baselines.static import fixed_cp_plan
from dyncp.planner.batch import Batch
from dyncp.planner.pipeline import (
    OrderSearch,
    by_plan,
    ends_small_order,
    repack,
    slot_seconds,
    split_steps,
    split_to,
    to_slots,
    with_order,
)
from dyncp.planner.pipeline.search import slotted
from dyncp.planner.pipeline.stage import PipelineStats, priced_stage, reordering_pricer
from dyncp.planner.planner import Planner

REL = 1e-9
TOPO = Topology(16, 8, 8192, (1, 2, 4, 8, 16))


@functools.cache
def model() -> CostModel:
    return CostModel.load("h100-reference", 8)


def batch(seed: int, n: int = 60) -> np.ndarray:
    """Long-tailed lengths (many short documents, a few long), as the bench's datasets."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(7.5, 1.2, size=n).astype(np.int64) + 16, 60_000)


def planner(pipeline: Pipeline, **kw) -> Planner:
    kw.setdefault("deterministic", True)
    kw.setdefault("time_limit", 0.2)
    return Planner(
        model(),
        world=TOPO.world,
        ranks_per_node=TOPO.ranks_per_node,
        capacity=TOPO.capacity,
        group_sizes=TOPO.group_sizes,
        cpsat=None,
        bound="simple",
        pipeline=pipeline,
        **kw,
    )


def cp_of(lengths: np.ndarray) -> int:
    """Static CP's size for ``lengths``: the smallest that holds the longest."""
    return TOPO.min_cp(int(lengths.max()))


def price(plan: StepPlan) -> float:
    return price_pipeline(plan, model()).step_seconds


def assert_pipelined(plan: StepPlan, pipeline: Pipeline, n: int) -> None:
    """Valid, every sequence exactly once, one micro-batch per group, the count allowed."""
    plan.validate()
    assert plan.pipeline == pipeline
    assert_exactly_once(plan, n)
    assert all(len(g.microbatches) == 1 for w in plan.waves for g in w.groups)
    assert len(plan.waves) % pipeline.slot_multiple() == 0


# ------------------------------------------------------------------------------ slots


def test_slots_keep_every_columns_micro_batch_order():
    plan = fixed_cp_plan(batch(1), TOPO, model(), cp_of(batch(1)))
    slots = to_slots(plan, Pipeline(4))
    slots.validate()
    for g in plan.waves[0].groups:
        ran = [h.microbatches[0] for w in slots.waves for h in w.groups if h.start == g.start]
        assert ran == list(g.microbatches)


@pytest.mark.parametrize("seed", range(4))
def test_split_to_reaches_the_count_and_keeps_every_sequence(seed):
    lengths = batch(seed)
    slots = to_slots(fixed_cp_plan(lengths, TOPO, model(), cp_of(lengths)), Pipeline(4, 2))
    want = -(-(len(slots.waves) + 5) // 4) * 4  # (interleaved over 4 stages: a multiple of 4)
    split = split_to(slots, want, model())
    assert len(split.waves) == want
    split.validate()
    assert_exactly_once(split, len(lengths))


@pytest.mark.parametrize("seed", range(3))
def test_split_to_any_count_is_the_same_split_stopped_there(seed):
    # Each split depends only on the ones before it, so the plan split to n slots is the one
    # split further, stopped at n: what lets ``slotted`` split once and read two counts. (An
    # unsplittable slot recognised by an id Python reused for a new slot broke this.)
    lengths = batch(seed)
    slots = to_slots(fixed_cp_plan(lengths, TOPO, model(), cp_of(lengths)), Pipeline(4, 1))
    m = len(slots.waves)
    steps = split_steps(slots, m + 12, model())
    assert [len(s) for s in steps] == list(range(m, m + len(steps)))
    for n in range(m, m + len(steps)):
        assert split_to(slots, n, model(), partial=True).waves == steps[n - m]


def test_split_to_names_a_batch_too_small_to_split():
    lengths = np.array([30_000, 20_000])
    slots = to_slots(fixed_cp_plan(lengths, TOPO, model(), 8), Pipeline(4, 2))
    with pytest.raises(ValueError, match="cannot reach 4 slots"):
        split_to(slots, 4, model())


def test_repack_keeps_the_groups_and_packs_within_the_smaller_budget():
    lengths = batch(4)
    plan = fixed_cp_plan(lengths, TOPO, model(), cp_of(lengths))
    small = repack(plan, TOPO.capacity // 4)
    small.validate()
    assert_exactly_once(small, len(lengths))
    before = [(g.start, g.size) for w in plan.waves for g in w.groups]
    assert [(g.start, g.size) for w in small.waves for g in w.groups] == before
    assert sum(len(g.microbatches) for w in small.waves for g in w.groups) > sum(
        len(g.microbatches) for w in plan.waves for g in w.groups
    )
    for w in small.waves:
        for g in w.groups:
            for mb in g.microbatches:
                tokens = model().memory_tokens(g.size, lengths[list(mb.seq_ids)])
                assert len(mb.seq_ids) == 1 or tokens <= TOPO.capacity // 4


def test_ends_small_order_puts_the_smallest_at_both_ends():
    order = ends_small_order([5.0, 1.0, 3.0, 2.0, 4.0])
    weights = [[5.0, 1.0, 3.0, 2.0, 4.0][i] for i in order]
    assert weights == [1.0, 3.0, 5.0, 4.0, 2.0]


def test_with_order_rejects_a_non_permutation():
    slots = to_slots(fixed_cp_plan(batch(0), TOPO, model(), cp_of(batch(0))), Pipeline(2))
    with pytest.raises(ValueError, match="permutation"):
        with_order(slots, [0, 0])


def test_the_reordering_pricer_prices_as_the_reordered_plan():
    slots = static_pp_plan(batch(3), TOPO, model(), cp_of(batch(3)), Pipeline(4, 2))
    order = list(range(len(slots.waves)))
    random.Random(0).shuffle(order)
    fast = reordering_pricer(model())(slots)(order)
    assert fast == pytest.approx(price(with_order(slots, order)), rel=REL)


# ------------------------------------------------------------------------------ order search


@pytest.mark.parametrize("seed", range(3))
def test_order_search_is_never_slower_than_its_start_and_deterministic(seed):
    lengths = batch(seed, 80)
    slots = static_pp_plan(lengths, TOPO, model(), cp_of(lengths), Pipeline(4))
    start = ends_small_order(slot_seconds(slots, model()))
    pricer = by_plan(price)(slots)
    search = OrderSearch(evaluations=40, seed=seed)
    result = search.run(len(slots.waves), pricer, start=start)
    assert result.seconds <= result.start_seconds
    assert result.seconds == pytest.approx(pricer(result.order), rel=REL)
    assert sorted(result.order) == list(range(len(slots.waves)))
    assert search.run(len(slots.waves), pricer, start=start) == result


def test_order_search_rejects_a_negative_budget():
    with pytest.raises(ValueError, match="evaluations must be an integer >= 0"):
        OrderSearch(evaluations=-1)


# ------------------------------------------------------------------------------ baselines


@pytest.mark.parametrize("virtual", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_pp_baselines_are_valid_pipelined_plans(seed, virtual):
    lengths = batch(seed)
    pipeline = Pipeline(4, virtual)
    for plan in (
        megatron_pp_plan(lengths, TOPO, pipeline),
        static_pp_plan(lengths, TOPO, model(), cp_of(lengths), pipeline),
    ):
        assert_pipelined(plan, pipeline, len(lengths))
        assert price(plan) > 0


def test_megatron_alignment_cuts_micro_batches_until_the_count_is_a_multiple():
    lengths = batch(5)
    base = to_slots(megatron_plan(lengths, TOPO), Pipeline(4, 2))
    aligned = align_groups(base, 4)
    assert len(aligned.waves) % 4 == 0 and len(aligned.waves) >= len(base.waves)
    assert_exactly_once(aligned, len(lengths))
    # Megatron appends the cut-off head groups at the end; the earlier slots are untouched.
    k = len(base.waves) - (len(aligned.waves) - len(base.waves))
    assert aligned.waves[: max(k - 1, 0)] == base.waves[: max(k - 1, 0)]


# ------------------------------------------------------------------------------ the planner


@pytest.mark.parametrize("virtual", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_planner_plans_are_valid_and_never_slower_than_the_baselines_or_verls_order(seed, virtual):
    lengths = batch(seed)
    pipeline = Pipeline(4, virtual)
    plan = planner(pipeline).plan(lengths)
    assert_pipelined(plan, pipeline, len(lengths))
    seconds = plan.stats.predicted_step_seconds
    assert seconds == pytest.approx(price(plan), rel=REL)
    assert plan.stats.waves == len(plan.waves) == plan.stats["pipeline"]["slots"]
    bound = plan.stats.lower_bound_seconds
    assert 0 < bound <= seconds * (1 + REL)
    assert plan.stats.gap_to_lower_bound == pytest.approx(seconds / bound - 1, rel=1e-6)
    typed = PipelineStats.of(plan)
    assert typed.slots == len(plan.waves) and typed.predicted_step_seconds == seconds
    assert 0 <= typed.bubble_fraction < 1
    for base in (
        megatron_pp_plan(lengths, TOPO, pipeline),
        static_pp_plan(lengths, TOPO, model(), cp_of(lengths), pipeline),
    ):
        assert seconds <= price(base) * (1 + REL)
    ordered = with_order(plan, ends_small_order(slot_seconds(plan, model())))
    assert seconds <= price(ordered) * (1 + REL)
    assert seconds <= plan.stats["pipeline"]["rule_step_seconds"] * (1 + REL)


def test_the_stage_out_of_time_still_takes_a_faster_pp_baseline():
    """Past its deadline the stage prices only the search's plan and the PP baselines made from
    the search's baseline plans: from a poor plan (every micro-batch on all 16 ranks) it must
    hand out the faster baseline."""
    lengths = batch(6)
    pipeline = Pipeline(4)
    poor = fixed_cp_plan(lengths, TOPO, model(), 16)
    stage = priced_stage(pipeline, TOPO, model())
    plan, stats = stage.run(
        Batch(lengths, TOPO),
        [("dyncp", poor), ("megatron", megatron_plan(lengths, TOPO))],
        search=True,
        evaluations=0,
        deadline=0.0,
    )
    assert_pipelined(plan, pipeline, len(lengths))
    mega = price(megatron_pp_plan(lengths, TOPO, pipeline))
    assert price(slotted(poor, pipeline, model(), 1)) > mega  # (the premise)
    assert stats.predicted_step_seconds <= mega * (1 + REL)
    assert stats.predicted_step_seconds == pytest.approx(price(plan), rel=REL)


def test_planner_is_deterministic():
    lengths = batch(7)
    a = planner(Pipeline(4, 2)).plan(lengths)
    b = planner(Pipeline(4, 2)).plan(lengths)
    assert plan_digest(a) == plan_digest(b)
    assert a.stats["pipeline"] == b.stats["pipeline"]


@pytest.mark.parametrize("policy", ["megatron", "static"])
def test_baseline_policies_plan_as_their_pp_baseline(policy):
    lengths = batch(2)
    pipeline = Pipeline(4, 2)
    plan = planner(pipeline, policy=policy, max_length=60_000).plan(lengths)
    assert_pipelined(plan, pipeline, len(lengths))
    if policy == "megatron":
        assert plan_digest(plan) == plan_digest(megatron_pp_plan(lengths, TOPO, pipeline))


def test_bad_pipeline_options_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match=r"pipeline must be a Pipeline\(stages, virtual\)"):
        planner(4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give passes='free' with a pipeline"):
        planner(Pipeline(4), passes="aligned")
    with pytest.raises(PlanError, match="virtual stages"):
        Pipeline(1, 2)


def test_a_batch_too_small_for_the_interleaved_count_is_refused_clearly():
    with pytest.raises(ValueError, match="multiple of 4"):
        planner(Pipeline(4, 2)).plan([30_000, 20_000])
