"""Structure search (fluid pricing), pouring, local search and the anytime constructor.

The fluid price is checked by hand on a tiny case; every realised structure and every local-search
result must be a valid plan with each sequence exactly once; the local search must never raise the
additive step time it optimises; the anytime constructor must return a valid plan even when its
deadline has already passed.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_helpers import assert_exactly_once, topologies

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.construction.assignment import Assignment
from dyncp.planner.construction.fluid import Structure
from dyncp.planner.construction.greedy import GreedyConstructor
from dyncp.planner.construction.local_search import improve
from dyncp.planner.construction.structure import StructureSearch
from dyncp.planner.construction.structure_moves import _State
from dyncp.planner.costs import SequenceCosts


@functools.cache
def model_for(ranks_per_node: int) -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node)


@st.composite
def batches(draw: st.DrawFn, max_size: int = 40) -> tuple[Topology, list[int]]:
    topo = draw(topologies())
    longest = topo.max_length()
    length = st.one_of(st.integers(1, topo.capacity), st.integers(1, longest), st.just(longest))
    return topo, draw(st.lists(length, min_size=1, max_size=max_size))


def test_fluid_levels_by_hand() -> None:
    """8 ranks; one long sequence on 4 of them: its time alone is the floor, the 4 free ranks hold
    4 x floor of short work, its own group the idle time at its efficiency; the rest raises the
    wave at slope 4 + 4 e, or opens a wave of 8 singles, whichever is cheaper. Short work costs
    its table seconds plus its token share of the fixed cost of a pass."""
    topo = Topology(8, 8, 256)
    model = model_for(8)
    lengths = np.asarray([1024] + [200] * 30)
    costs = SequenceCosts(lengths, topo, model)
    search = StructureSearch(costs, wave_overhead=0.001, pass_seconds=0.002)
    assert search.long.tolist() == [0]  # 1024 tokens need 4 ranks at capacity 256
    k4 = costs.index(4)
    s = Structure((0,), (0,), (k4,))
    total, levels, extra = search.levels(s)
    floor = costs.alone[k4, 0]
    e4 = search.eff[k4]
    # Short work: its CP-1 seconds plus its token share of every pass's fixed cost.
    share = lengths[1:] / topo.capacity * (model.fixed_seconds(1) - model.microbatch_overhead)
    work = float((costs.seconds[0, 1:] + share).sum())
    rest = work - 4 * floor
    raise_cost, new_wave = rest / (4 + 4 * e4), 0.001 + 0.002 + rest / 8
    assert rest > 0
    if raise_cost <= new_wave:
        assert not extra and levels == pytest.approx([floor + raise_cost])
        assert total == pytest.approx(floor + raise_cost + 0.001)
    else:
        assert extra and levels == pytest.approx([floor, rest / 8])
        assert total == pytest.approx(floor + rest / 8 + 2 * 0.001 + 0.002)
    # Efficiency: short work costs more rank-seconds on a ring, never less.
    assert search.eff[0] == 1.0 and (search.eff[1:] <= 1.0 + 1e-12).all()


def test_fluid_refuses_overfull_waves() -> None:
    topo = Topology(8, 8, 256)
    costs = SequenceCosts(np.asarray([2048, 2048]), topo, model_for(8))
    search = StructureSearch(costs, wave_overhead=0.0)
    k8 = costs.index(8)
    assert search.levels(Structure((0, 1), (0, 0), (k8, k8)))[0] == float("inf")
    assert np.isfinite(search.levels(Structure((0, 1), (0, 1), (k8, k8)))[0])


@settings(max_examples=30, deadline=None)
@given(case=batches())
def test_search_never_worsens_and_realises_valid_plans(case: tuple[Topology, list[int]]) -> None:
    topo, lengths = case
    g = GreedyConstructor(np.asarray(lengths), topo, model_for(topo.ranks_per_node))
    if g.sizes[0] != 1:
        assert list(g.structured()) == []
        return
    search = StructureSearch(g.costs, 0.001, 0.002)
    start = search.start(g.choose_sizes(1.0, 0))
    better = search.improve(start, deadline=None)
    assert sorted(better.ids) == sorted(start.ids) == search.long.tolist()
    assert search.levels(better)[0] <= search.levels(start)[0]
    plans = list(g.structured())
    assert plans
    for plan in plans:
        plan.validate()
        assert_exactly_once(plan, len(lengths))


@settings(max_examples=30, deadline=None)
@given(case=batches())
def test_local_search_lowers_the_additive_step(case: tuple[Topology, list[int]]) -> None:
    topo, lengths = case
    g = GreedyConstructor(np.asarray(lengths), topo, model_for(topo.ranks_per_node))
    plan = g.build_level(g.ideal_seconds())
    a = Assignment.from_plan(plan, g.costs)
    moved, applied = improve(a)
    assert moved.objective() <= a.objective() + 1e-9
    if applied:
        assert moved.objective() < a.objective()
    ids = sorted(i for items in moved.items for i in items)
    assert ids == list(range(len(lengths)))
    for j, items in enumerate(moved.items):  # every sequence in a slot that can hold it
        assert np.isfinite(g.costs.seconds[moved.row[j], items]).all()
    out = moved.to_plan(plan)
    out.validate()


def test_anytime_constructor_past_its_deadline() -> None:
    topo = Topology(16, 8, 256)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.5, 1.2, 200).astype(np.int64) + 1, topo.max_length())
    g = GreedyConstructor(lengths, topo, model_for(8))
    plan = g.best(deadline=time.perf_counter() - 1.0)
    plan.validate()
    assert_exactly_once(plan, len(lengths))
    assert g.tried == 1
    full = GreedyConstructor(lengths, topo, model_for(8))
    full.best()
    assert full.tried > 1


def test_stacked_group_priced_by_hand() -> None:
    """Two sequences needing 4 ranks each stacked in one group of 4: the group's load is the sum
    of their times alone, the wave's floor that load; the other group of 4 idles below it."""
    topo = Topology(8, 8, 256)
    model = model_for(8)
    lengths = np.asarray([1024, 1000, 900] + [100] * 20)
    costs = SequenceCosts(lengths, topo, model)
    search = StructureSearch(costs, wave_overhead=0.001, pass_seconds=0.002)
    assert search.long.tolist() == [0, 1, 2]
    k4 = costs.index(4)
    s = Structure((0, 1, 2), (0, 0, 0), (k4, k4, k4), (0, 0, 1))
    a = costs.alone[k4]
    floor = a[0] + a[1]
    e4 = search.eff[k4]
    cap = 4 * e4 * (floor - floor) + 4 * e4 * (floor - a[2])
    rest = search.work - cap
    total, levels, extra = search.levels(s)
    if rest <= 0:
        assert levels == pytest.approx([floor]) and not extra
    elif rest / (8 * e4) <= 0.001 + 0.002 + rest / 8:
        assert levels == pytest.approx([floor + rest / (8 * e4)]) and not extra
    else:
        assert extra and levels == pytest.approx([floor, rest / 8])
    assert total == pytest.approx(sum(levels) + len(levels) * 0.001 + extra * 0.002)
    assert [g[2] for g in s.groups()] == [[0, 1], [2]]


def test_columns_stack_what_would_need_a_second_wave() -> None:
    """Four sequences that each need 4 of 8 ranks: one group each takes two waves; packed into
    columns at a level that holds two of them, they share one wave in two groups of two."""
    topo = Topology(8, 8, 256)
    lengths = np.asarray([1024] * 4 + [50] * 10)
    costs = SequenceCosts(lengths, topo, model_for(8))
    search = StructureSearch(costs, wave_overhead=0.001)
    k4 = costs.index(4)
    apart = search.start(np.full(len(lengths), k4))
    assert max(apart.wave) == 1
    stacked = search.columns(2.01 * costs.alone[k4, 0], tolerance=0.0)
    assert stacked.wave == (0, 0, 0, 0) and stacked.row == (k4,) * 4
    assert sorted(len(ids) for _, _, ids in stacked.groups()) == [2, 2]


@settings(max_examples=30, deadline=None)
@given(case=batches(), tolerance=st.sampled_from([0.0, 0.3]), factor=st.floats(0.3, 3.0))
def test_move_prices_equal_the_fluid_price(
    case: tuple[Topology, list[int]], tolerance: float, factor: float
) -> None:
    """Each move is priced from per-wave sums; the structure it yields must cost exactly that
    under ``levels`` (the full fluid price), and every applied move must lower it."""
    topo, lengths = case
    costs = SequenceCosts(np.asarray(lengths), topo, model_for(topo.ranks_per_node))
    if costs.sizes[0] != 1:
        return
    search = StructureSearch(costs, 0.001, 0.002)
    if not len(search.long):
        return
    s = search.columns(factor * costs.ideal_seconds(), tolerance)
    state = _State(search, s)
    assert state.cost == pytest.approx(search.levels(s)[0], rel=1e-12)
    for _ in range(3):
        for i in state.by_time():
            before = state.cost
            if state.best_move(i):
                after = search.levels(state.structure())[0]
                assert state.predicted == pytest.approx(after, rel=1e-9)
                assert state.cost == pytest.approx(after, rel=1e-9) and after < before
    out = state.structure()
    assert sorted(out.ids) == search.long.tolist()
    for _, k, ids in out.groups():  # every group fits its sequences and its wave fits W ranks
        assert np.isfinite(costs.alone[k, ids]).all()
    used = np.zeros(max(out.wave) + 1)
    for w, k, _ in out.groups():
        used[w] += costs.sizes[k]
    assert (used <= topo.world).all()


def test_misfits_are_short_sequences_no_wave_has_room_for() -> None:
    """Two sequences that need all 8 ranks make two full waves; the short work then opens a
    wave of singles whose level is the work over 8 ranks, shorter than the longest short
    sequence alone: that one has room nowhere (a misfit), the others fit. ``extend`` gives it a
    group of its own, and the search with it placed as a long one leaves no misfit."""
    topo = Topology(8, 8, 256)
    model = model_for(8)
    lengths = np.asarray([2048, 2048, 250] + [20] * 8)
    costs = SequenceCosts(lengths, topo, model)
    search = StructureSearch(costs, wave_overhead=0.001, pass_seconds=0.002, long_share=10.0)
    assert search.long.tolist() == [0, 1]
    k8 = costs.index(8)
    s = Structure((0, 1), (0, 1), (k8, k8))
    _, levels, extra = search.levels(s)
    assert extra  # no wave has a free rank: the short work opens a wave of singles
    assert costs.seconds[0, 2] > levels[-1] >= costs.seconds[0, 3]
    assert search.misfits(s).tolist() == [2]
    again = StructureSearch(costs, 0.001, 0.002, long_share=10.0, extra_long=np.asarray([2]))
    assert again.long.tolist() == [0, 1, 2]
    placed = again.extend(s, levels, np.asarray([2]))
    assert [ids for _, _, ids in placed.groups()] == [[0], [1], [2]]
    assert np.isfinite(again.levels(placed)[0])
    assert again.misfits(again.improve(placed, None)).tolist() == []


def test_misfits_share_one_room() -> None:
    """Two groups of 4 fill the wave (one stacks two 1024s, the other a 1024 and a 700), so
    the second leaves room for one 250-token sequence at size 4 but not for two; the short work
    left opens a wave of singles shorter than either 250 alone. Each fits the room on its own;
    together one is a misfit (the room is taken once, longest first, ties by index)."""
    topo = Topology(8, 8, 256)
    model = model_for(8)
    lengths = np.asarray([1024, 1024, 1024, 700, 250, 250] + [20] * 8)
    costs = SequenceCosts(lengths, topo, model)
    search = StructureSearch(costs, 0.001, 0.002, long_share=10.0, extra_long=np.asarray([3]))
    k4 = costs.index(4)
    s = Structure((0, 1, 2, 3), (0, 0, 0, 0), (k4, k4, k4, k4), (0, 0, 1, 1))
    _, levels, extra = search.levels(s)
    assert extra and costs.seconds[0, 4] > levels[-1]
    room = levels[0] - costs.alone[k4, [2, 3]].sum()
    assert costs.seconds[k4, 4] <= room < 2 * costs.seconds[k4, 4]
    assert search.misfits(s).tolist() == [5]


def test_overshoot_names_the_short_sequences_that_lift_a_group() -> None:
    """A realisation that pours both 250-token sequences onto the group of two stacked 1024s
    lifts it above its wave's fluid level by more than one pass at size 1: ``overshoot`` names
    short members of that group only, longest first, until their seconds cover the excess
    (here the longer alone does not, so both), and nothing when every group is within it."""
    topo = Topology(8, 8, 256)
    model = model_for(8)
    lengths = np.asarray([1024, 1024, 1024, 700, 250, 240] + [20] * 8)
    g = GreedyConstructor(lengths, topo, model)
    search = StructureSearch(g.costs, 0.001, 0.002, long_share=10.0, extra_long=np.asarray([3]))
    k4 = g.costs.index(4)
    s = Structure((0, 1, 2, 3), (0, 0, 0, 0), (k4, k4, k4, k4), (0, 0, 1, 1))
    _, levels, _ = search.levels(s)
    plan = g.assemble([[(4, [0, 1, 4, 5]), (4, [2, 3])], [(1, [i]) for i in range(6, 14)]])
    plan.validate()
    cost = evaluate_plan(plan, model)
    first = plan.waves[0].groups[0]
    assert sorted(i for mb in first.microbatches for i in mb.seq_ids) == [0, 1, 4, 5]
    seconds = float(sum(cost.microbatch_seconds[0][: len(first.microbatches)]))
    excess = seconds - levels[0] - model.fixed_seconds(1)
    assert excess > 0
    named = g.overshoot(plan, s, search).tolist()
    assert named and set(named) <= {4, 5}
    covered = [
        float(g.costs.seconds[k4, i]) for i in sorted(named, key=lambda i: -g.costs.seconds[k4, i])
    ]
    # The longer one alone does not cover the excess, so both are named (all there are).
    assert sorted(named) == [4, 5] and excess > sum(covered[:-1])
    # The same structure realised as the search pours it leaves the 1024s' group within reach.
    calm = g.assemble(
        [[(4, [0, 1]), (4, [2, 3])], [(1, [4, 6]), (1, [5, 7])] + [(1, [i]) for i in range(8, 14)]]
    )
    assert g.overshoot(calm, s, search).tolist() == []
