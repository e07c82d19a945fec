"""The wave-holding bound of ``dyncp.planner.bounds.lp_bound`` (the longest sequences' groups are
held for their wave's level), on 64-rank batches where it binds and on hand-checkable tables.

The bound must rise above the LP (the wave-holding part is what binds) and stay at or below the
seconds of a real, validated plan, under each timing (under dataflow the held groups' ranks are
charged their own seconds, not their wave's: it rises less).
"""

from __future__ import annotations

import numpy as np
import pytest

import dyncp.planner.bounds.holding as holding
import dyncp.planner.bounds.lp_bound as lp_bound
from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.planner import Planner

INF = np.inf


def planned(lengths: np.ndarray) -> tuple[dict[str, float], object, CostModel]:
    """Seconds of the planner's validated plan of ``lengths`` (64 ranks, capacity 8192) under
    each timing."""
    model = CostModel.load("h100-reference", 8)
    planner = Planner(model, world=64, ranks_per_node=8, capacity=8192, max_length=131072)
    plan = planner.plan(lengths)
    plan.validate()
    seconds = {t: evaluate_plan(plan, model, timing=t).step_seconds for t in TIMINGS}
    return seconds, plan.topology, model


def test_pair_bound_binds_and_stays_below_a_plan(monkeypatch) -> None:
    """Two sequences that each want half the ranks share a wave; the shorter one's group idles
    or runs short sequences at a ring's price until the longer one ends."""
    rng = np.random.default_rng(0)
    short = np.clip(rng.lognormal(np.log(600), 1.2, 510), 1, 8192).astype(np.int64)
    lengths = np.r_[131072, 113486, short]
    seconds, topology, model = planned(lengths)
    held = {t: lp_bound.lp_lower_bound(lengths, topology, model, timing=t) for t in TIMINGS}
    monkeypatch.setattr(lp_bound, "_held_value", lambda *args, **kwargs: 0.0)
    for timing, rise in (("barrier", 1.02), ("dataflow", 1.01)):
        without = lp_bound.lp_lower_bound(lengths, topology, model, timing=timing)
        assert without.seconds * rise < held[timing].seconds <= seconds[timing]


def test_more_held_sequences_raise_the_bound_below_a_plan(monkeypatch) -> None:
    """A long-tailed (Pareto 1.1) batch: holding the four longest sequences' groups for their
    waves bounds higher than holding two, and no higher than the planner's validated plan."""
    rng = np.random.default_rng(37)
    lengths = np.clip(np.rint(256 * (1 + rng.pareto(1.1, 512))), 1, 131072).astype(np.int64)
    seconds, topology, model = planned(lengths)
    four = {t: lp_bound.lp_lower_bound(lengths, topology, model, timing=t) for t in TIMINGS}
    monkeypatch.setattr(lp_bound, "TOP", 2)
    for timing, rise in (("barrier", 1.02), ("dataflow", 1.01)):
        two = lp_bound.lp_lower_bound(lengths, topology, model, timing=timing)
        assert two.seconds * rise < four[timing].seconds <= seconds[timing]


def riders(r: np.ndarray) -> holding._Riders:
    """Knapsacks with no fixed seconds: a sequence outside the held groups costs its least r."""
    return holding._Riders(r, r.min(axis=0))


def test_three_groups_held_for_one_wave() -> None:
    """Three sequences at sizes 8, 4, 2 of 16 ranks (times alone 10, 6, 3 s; r 80, 24, 6) and one
    other sequence (r 40, at size 1 only: it rides no ring group). In one wave all three groups
    are held 10 s: (8 + 4 + 2) 10 + 40 = 180 rank-seconds over 16 ranks, 11.25 s. Every other
    layout has two or three waves, at least 10 + 3 = 13 s. Holding only the two longest gives
    10 s: the size-2 sequence's r is then charged at its least, 5, and it rides the size-4
    group's idle 16 rank-seconds at weight 8, so (120 + 5 + 40 - 5) / 16 = 10."""
    r = np.array(
        [
            [70.0, 20.0, 5.0, 40.0],
            [72.0, 22.0, 6.0, INF],
            [75.0, 24.0, 8.0, INF],
            [80.0, 30.0, 12.0, INF],
        ]
    )
    tables = ([1, 2, 4, 8], 16, 64, np.zeros(4), 0.0)
    items = [(0, 3, 10.0, 80.0), (1, 2, 6.0, 24.0), (2, 1, 3.0, 6.0)]
    model = CostModel.load("h100-reference", 8)  # not called: the three sizes differ
    lengths = np.ones(4, dtype=np.int64)
    three = holding._held_value(items, riders(r), model, lengths, tables)
    two = holding._held_value(items[:2], riders(r), model, lengths, tables)
    assert three == pytest.approx(180 / 16, rel=1e-12)
    assert two == pytest.approx(10.0, rel=1e-12)


def test_riders_priced_at_their_own_groups_size() -> None:
    """Two groups share a wave (sizes 4 and 2 of 6 ranks, level 10 s): the size-4 group has 5
    rank-seconds of room, the size-2 group 0.5. The one other sequence (least r 1) costs 10
    rank-seconds as a rider on 4 ranks, 2 on 2. Both rooms together at its cheaper weight
    would let it ride whole (saving 1); each group's own room at its own weight saves at most
    5/10 + 0.5/2 = 0.75. The bound takes the smaller saving: ((4 + 2) 10 + 1 - 0.75) / 6, above
    the level 10; two waves would take 10 + 4 s."""
    r = np.array([[INF, INF, 1.0], [INF, 19.5, 2.0], [35.0, 25.0, 10.0]])
    tables = ([1, 2, 4], 6, 64, np.zeros(3), 0.0)
    items = [(0, 2, 10.0, 35.0), (1, 1, 4.0, 19.5)]
    model = CostModel.load("h100-reference", 8)
    value = holding._held_value(items, riders(r), model, np.ones(3, np.int64), tables)
    assert value == pytest.approx((60 + 1 - 0.75) / 6, rel=1e-12)


def test_wave_overheads_of_the_layout_count() -> None:
    """Two sequences at sizes 8 and 4 of 8 ranks (times alone 3 and 2 s, wave overhead 0.5 s)
    cannot share a wave (12 ranks) or a group (sizes differ): two waves, 3 + 2 s and one extra
    overhead (the caller adds the first)."""
    r = np.array([[INF, INF], [INF, 8.0], [24.0, INF]])
    tables = ([1, 4, 8], 8, 64, np.zeros(3), 0.5)
    items = [(0, 2, 3.0, 24.0), (1, 1, 2.0, 8.0)]
    model = CostModel.load("h100-reference", 8)  # not called: the sizes differ
    value = holding._held_value(items, riders(r), model, np.ones(2, np.int64), tables)
    assert value == pytest.approx(3 + 2 + 0.5, rel=1e-12)


def test_two_in_one_group_run_one_after_the_other() -> None:
    """Two sequences at size 8 of 8 ranks (times 3 and 2 s) whose tokens do not fit one
    micro-batch: one group runs them one after the other in one wave, 5 s, without the second
    wave's overhead."""
    r = np.array([[INF, INF], [24.0, 16.0]])
    tables = ([1, 8], 8, 64, np.zeros(2), 0.5)
    items = [(0, 1, 3.0, 24.0), (1, 1, 2.0, 16.0)]
    model = CostModel.load("h100-reference", 8)
    lengths = np.asarray([8 * 64, 8 * 64])  # padded, together over 8 x 64 tokens
    value = holding._held_value(items, riders(r), model, lengths, tables)
    assert value == pytest.approx(3 + 2, rel=1e-12)
