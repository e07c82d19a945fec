"""Pass-aligned plans (``Planner(passes="aligned")``): valid, every sequence once, never more empty
passes than the unaligned plan, none where alignment is possible, and priced as passes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_helpers import assert_exactly_once

from dyncp.cost_model import CostModel
from dyncp.cost_model.pass_timing import price_passes
from dyncp.cost_model.sharding import ShardingCost
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave, menu_sizes, pass_schedule
from dyncp.planner import Planner
from dyncp.planner.improvement.pass_align import align_passes, aligned_waves

#: A Llama-3-8B-like block (218 M parameters, 32 of them) on the reference profile's links.
BLOCK = 218_112_000


@functools.cache
def model() -> CostModel:
    return CostModel.load("h100-reference", 8)


def sharding(world: int) -> ShardingCost:
    return ShardingCost.from_profile(
        model().profile, world=world, ranks_per_node=8, unit_params=(BLOCK,) * 32
    )


def planner(world: int, capacity: int, **options: object) -> Planner:
    return Planner(
        model(), world=world, ranks_per_node=8, capacity=capacity, deterministic=True, **options
    )


def test_an_idle_rank_is_filled_by_growing_a_group():
    # One size-1 group with three packs on rank 0 of 2: rank 1 runs three empty passes. No two
    # sequences fit one rank together (6000 > 4096 tokens), so only growing the group to both
    # ranks (1500 tokens a rank each) fills every pass; handing packs to rank 1 leaves one empty.
    topo = Topology(2, 2, 4096)
    wave = Wave((Group(0, 1, tuple(MicroBatch((i,)) for i in range(3))),))
    plan = StepPlan(topo, (3000, 3000, 3000), (wave,))
    aligned, report = align_passes(plan, model(), sharding(2))
    aligned.validate()
    assert_exactly_once(aligned, 3)
    assert (report.empty_before, report.empty_after) == (3, 0)
    assert [(g.start, g.size) for g in aligned.waves[0].groups] == [(0, 2)]


def test_a_rank_short_of_packs_takes_one_sequence_from_a_pack_of_several():
    # Rank 0 runs [0, 1] and [2], rank 1 only [3]: rank 1 takes a sequence of the pack of two.
    topo = Topology(2, 2, 8192, (1,))
    wave = Wave(
        (
            Group(0, 1, (MicroBatch((0, 1)), MicroBatch((2,)))),
            Group(1, 1, (MicroBatch((3,)),)),
        )
    )
    plan = StepPlan(topo, (3000, 2000, 4000, 1000), (wave,))
    aligned = aligned_waves(plan, model(), sharding(2))
    aligned.validate()
    assert_exactly_once(aligned, 4)
    assert pass_schedule(aligned).aligned


def test_counts_are_rebalanced_by_splitting_and_moving_packs():
    # Rank 0: four packs of two sequences; rank 1: one pack of one. Four passes, three empty.
    topo = Topology(2, 2, 8192)
    packs = tuple(MicroBatch((2 * i, 2 * i + 1)) for i in range(4))
    wave = Wave((Group(0, 1, packs), Group(1, 1, (MicroBatch((8,)),))))
    plan = StepPlan(topo, (500,) * 9, (wave,))
    aligned, report = align_passes(plan, model(), sharding(2))
    aligned.validate()
    assert_exactly_once(aligned, 9)
    assert report.empty_before == 3 and report.empty_after == 0
    assert report.passes_after < report.passes_before  # packs handed over: fewer passes
    assert report.seconds_after < report.seconds_before  # and a faster step


def test_nothing_fits_leaves_empty_passes_and_keeps_the_plan():
    # Ranks 0-1 run three packs of one 6000-token sequence (3000 a rank), ranks 2 and 3 one
    # short pack each. Two long ones do not fit together (6000 a rank > 4096), a long one does
    # not fit one rank, the short packs hold one sequence each: nothing can move, the empty
    # passes stay (two on each of ranks 2 and 3).
    topo = Topology(4, 4, 4096)
    wave = Wave(
        (
            Group(0, 2, tuple(MicroBatch((i,)) for i in range(3))),
            Group(2, 1, (MicroBatch((3,)),)),
            Group(3, 1, (MicroBatch((4,)),)),
        )
    )
    plan = StepPlan(topo, (6000, 6000, 6000, 100, 100), (wave,))
    drafted = aligned_waves(plan, model(), sharding(4))
    drafted.validate()  # no pack was put where it does not fit
    aligned, report = align_passes(plan, model(), sharding(4))
    assert report.empty_after == report.empty_before == 4
    assert aligned.waves == plan.waves


@functools.cache
def wikipedia() -> np.ndarray:
    return load_lengths(resolve_dataset("wikipedia"))


@pytest.mark.parametrize(
    ("policy", "world", "capacity", "seed"),
    [
        ("dyncp", 16, 8192, 0),
        ("dyncp", 64, 8192, 1),
        ("batch-adaptive", 8, 4096, 0),
        ("batch-adaptive", 64, 8192, 0),
    ],
)
def test_many_short_sequences_give_an_aligned_plan(policy, world, capacity, seed):
    # 12 documents a rank of the bundled Wikipedia sample, each within one rank's capacity: the
    # unaligned plans of these batches have empty passes (asserted), the aligned ones none.
    lengths = wikipedia()[wikipedia() <= capacity]
    lengths = np.random.default_rng(seed).choice(lengths, 12 * world)
    free = planner(world, capacity, policy=policy).plan(lengths)
    assert pass_schedule(free).empty > 0
    aligned = planner(
        world, capacity, policy=policy, passes="aligned", sharding=sharding(world)
    ).plan(lengths)
    aligned.validate()
    assert_exactly_once(aligned, len(lengths))
    assert pass_schedule(aligned).empty == 0
    report = aligned.stats.alignment
    assert report["empty_after"] == 0
    assert report["empty_before"] == pass_schedule(free).empty
    assert aligned.stats.predicted_step_seconds == pytest.approx(
        price_passes(aligned, model(), sharding(world)).step_seconds, rel=1e-12
    )
    assert report["seconds_before"] == pytest.approx(
        price_passes(free, model(), sharding(world)).step_seconds, rel=1e-12
    )
    # The planner also aligns its baselines' plans and keeps the best: never worse than
    # aligning its own plan alone.
    _, own = align_passes(free, model(), sharding(world))
    assert report["empty_after"] <= own.empty_after
    assert report["seconds_after"] <= own.seconds_after * (1 + 1e-12)


def test_the_default_is_unaligned_and_the_option_is_validated():
    assert planner(8, 4096).config.passes == "free"
    assert "alignment" not in planner(8, 4096).plan([100] * 20).stats
    with pytest.raises(ValueError, match="free, aligned"):
        planner(8, 4096, passes="lockstep")
    with pytest.raises(ValueError, match="passes='aligned'"):
        planner(8, 4096, sharding=sharding(8))
    with pytest.raises(ValueError, match="ShardingCost"):
        planner(8, 4096, passes="aligned", sharding="fsdp")


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([2, 4, 8, 16]),
    capacity=st.sampled_from([2048, 4096, 16384]),
    lengths=st.lists(st.integers(1, 30000), min_size=1, max_size=120),
    policy=st.sampled_from(["dyncp", "megatron", "batch-adaptive"]),
)
def test_alignment_is_valid_and_never_adds_empty_passes(world, capacity, lengths, policy):
    top = max(Topology(world, 8, capacity).group_sizes) * capacity
    lengths = [min(s, top - 2 * world) for s in lengths]
    plan = planner(world, capacity, policy=policy, cpsat=None).plan(lengths)
    cost = sharding(world)
    aligned_waves(plan, model(), cost).validate()  # the moves' own result, before any guard
    aligned, report = align_passes(plan, model(), cost)
    aligned.validate()
    assert_exactly_once(aligned, len(lengths))
    before, after = price_passes(plan, model(), cost), price_passes(aligned, model(), cost)
    assert (report.empty_before, report.empty_after) == (before.empty, after.empty)
    assert after.empty <= before.empty
    if after.empty == before.empty:
        assert after.step_seconds <= before.step_seconds * (1 + 1e-12)


@pytest.mark.parametrize(
    ("ranks_per_node", "options"),
    [
        (72, {"world": 72, "group_sizes": menu_sizes("divisors", world=72, ranks_per_node=72)}),
        (8, {"world": 16, "policy": "dyncp-hybrid", "head_sizes": (1, 2, 4, 8)}),
        (8, {"world": 24}),
    ],
)
def test_menus_and_head_splits_stay_valid(ranks_per_node, options):
    # Growing a group keeps it on the menu's placements and keeps a head split only where the
    # larger group allows it; the unaligned plans of these batches have empty passes.
    cost = CostModel.load("h100-reference", ranks_per_node)
    lengths = wikipedia()[wikipedia() < 60000]
    lengths = np.random.default_rng(3).choice(lengths, 10 * options["world"])
    common = {"ranks_per_node": ranks_per_node, "capacity": 8192, "deterministic": True}
    free = Planner(cost, cpsat=None, **common, **options).plan(lengths)
    assert pass_schedule(free).empty > 0
    aligned_waves(free, cost).validate()
    plan = Planner(cost, cpsat=None, passes="aligned", **common, **options).plan(lengths)
    plan.validate()
    assert_exactly_once(plan, len(lengths))
    assert pass_schedule(plan).empty <= pass_schedule(free).empty


def test_a_group_grows_only_onto_the_topologys_placements():
    # Ranks 2-3 run a group, 1, 4 and 5 are idle, 0 and 6-7 busy: no allowed block of 4 holds
    # the group and idle ranks only ([0, 4) holds rank 0, [4, 8) not the group), so it stays.
    topo = Topology(8, 8, 8192)
    wave = Wave(
        (
            Group(0, 1, (MicroBatch((0,)),)),
            Group(2, 2, (MicroBatch((1,)), MicroBatch((2,)))),
            Group(6, 2, (MicroBatch((3,)),)),
        )
    )
    plan = StepPlan(topo, (1000, 1000, 1000, 1000), (wave,))
    aligned = aligned_waves(plan, model(), sharding(8))
    aligned.validate()
    assert_exactly_once(aligned, 4)


def test_a_grown_group_drops_a_head_split_the_larger_size_does_not_allow():
    # A group of 4 splitting heads 4 ways grows into idle ranks 4-5 as a group of 6, which 4
    # does not divide: it runs as a ring there.
    cost = CostModel.load("h100-reference", 12)
    sizes = menu_sizes("divisors", world=12, ranks_per_node=12)
    topo = Topology(12, 12, 8192, sizes, (1, 4), query_heads=8, kv_heads=4)
    wave = Wave(
        (
            Group(0, 4, (MicroBatch((0,)), MicroBatch((1,))), heads=4),
            Group(6, 6, (MicroBatch((2,)), MicroBatch((3,)))),
        )
    )
    plan = StepPlan(topo, (2000, 2000, 2000, 2000), (wave,))
    plan.validate()
    aligned = aligned_waves(plan, cost, None)
    aligned.validate()
    assert pass_schedule(aligned).aligned
    assert [(g.start, g.size, g.heads) for g in aligned.waves[0].groups][0] == (0, 6, 1)
