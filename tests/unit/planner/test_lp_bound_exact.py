"""The tight LP bound against the exact optimum of small batches, found by exhaustive search.

On a few ranks and up to five sequences, every plan the contract allows is enumerated in effect:
the step is a sum over waves, so the optimum of a set of sequences is the cheapest way to split
off one wave (a set of groups, each a size and its sequences packed into micro-batches within
capacity, the sizes fitting in W ranks) plus the optimum of the rest. A valid lower bound is at
most that optimum for every batch, whatever the branch and bound's budget (a larger one never
lowers it); checked under the overlapped-ring reference profile, a quadratic profile without
overlap, and the FlexSP-style all-to-all form.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_lp_bound import any_model

import dyncp.planner.bounds.holding as holding
import dyncp.planner.bounds.lp_bound as lp_bound
from dyncp.cost_model.evaluate import TIMINGS, time_waves
from dyncp.cost_model.model import CostModel
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.lp_bound import MAX_SOLVES, lp_lower_bound

REL = 1e-9


def partitions(items: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
    """Every set partition of ``items`` (blocks as tuples)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [(first,), *part]
        for b in range(len(part)):
            yield [*part[:b], (first, *part[b]), *part[b + 1 :]]


def group_timer(lengths: list[int], topo: Topology, model: CostModel):
    """``group_seconds(block, cp)``: the best packing of ``block`` into micro-batches at ``cp``,
    the group's summed seconds (inf if one does not fit)."""

    @functools.cache
    def group_seconds(block: tuple[int, ...], cp: int) -> float:
        best = float("inf")
        for part in partitions(block):
            fits = all(
                CostModel.padded(cp, np.asarray([lengths[i] for i in mb])).sum()
                <= cp * topo.capacity
                for mb in part
            )
            if fits:
                best = min(
                    best, sum(model.microbatch_seconds(cp, [lengths[i] for i in mb]) for mb in part)
                )
        return best

    return group_seconds


def optimum(lengths: list[int], topo: Topology, model: CostModel, timing: str = "barrier") -> float:
    """Least predicted step seconds of any valid plan of ``lengths`` (exhaustive) timed as
    ``timing`` (``dataflow_optimum`` for dataflow)."""
    if timing == "dataflow":
        return dataflow_optimum(lengths, topo, model)
    n = len(lengths)
    sizes = topo.group_sizes
    group_seconds = group_timer(lengths, topo, model)

    @functools.cache
    def wave_seconds(members: tuple[int, ...]) -> float:
        """Best single wave running ``members``: groups whose sizes fit in W ranks."""
        best = float("inf")
        for part in partitions(members):
            for choice in itertools.product(sizes, repeat=len(part)):
                if sum(choice) <= topo.world:
                    level = max(group_seconds(b, c) for b, c in zip(part, choice))
                    best = min(best, level)
        return best + model.wave_overhead

    @functools.cache
    def rest(mask: int) -> float:
        if mask == 0:
            return 0.0
        low = mask & -mask
        others = mask ^ low
        best = float("inf")
        sub = others
        while True:  # every wave holding the lowest remaining sequence
            wave = sub | low
            members = tuple(i for i in range(n) if wave >> i & 1)
            best = min(best, wave_seconds(members) + rest(mask ^ wave))
            if sub == 0:
                break
            sub = (sub - 1) & others
        return best

    return rest((1 << n) - 1)


def dataflow_optimum(lengths: list[int], topo: Topology, model: CostModel) -> float:
    """Least dataflow step seconds of any plan of ``lengths`` whose groups may hold any ranks (a
    relaxation of the placement rules, so at most the optimum of valid plans).

    A dataflow plan is its groups (a block of sequences, a size, their best packing: a group's
    seconds only delay what follows) in wave order, each started when its last member is free
    and lasting the wave overhead plus its seconds; groups of one wave are disjoint, so any
    order of them is the same plan, and every plan is some order of its groups, one a wave.
    Exhaustive: every grouping and its sizes, then every order of the groups and every choice
    of their ranks, ranks free at the same time being interchangeable. Starts from the barrier
    optimum, never below the dataflow one (dataflow <= barrier on every plan).
    """
    n, o, world = len(lengths), model.wave_overhead, topo.world
    group_seconds = group_timer(lengths, topo, model)

    best = optimum(lengths, topo, model)
    for part in partitions(tuple(range(n))):
        for choice in itertools.product(topo.group_sizes, repeat=len(part)):
            seconds = [group_seconds(b, c) for b, c in zip(part, choice)]
            if not all(np.isfinite(seconds)):
                continue
            tasks = tuple(sorted((c, o + t) for c, t in zip(choice, seconds)))
            if max(d for _, d in tasks) >= best or sum(c * d for c, d in tasks) >= best * world:
                continue
            best = min(best, rigid_optimum(tasks, world))
    return best


def takes(free: tuple[tuple[float, int], ...], c: int) -> Iterator[tuple[int, ...]]:
    """Every way to take ``c`` ranks from the classes of ``free`` (how many from each)."""
    if not free:
        if c == 0:
            yield ()
        return
    (_, m), rest = free[0], free[1:]
    for k in range(min(m, c) + 1):
        for tail in takes(rest, c - k):
            yield (k, *tail)


@st.composite
def small_batches(draw: st.DrawFn) -> tuple[Topology, list[int]]:
    world = draw(st.sampled_from([2, 4, 8]))
    rpn = draw(st.sampled_from([r for r in (2, 4) if world % r == 0 or world <= r]))
    capacity = draw(st.sampled_from([64, 100, 256]))
    topo = Topology(world, rpn, capacity)
    longest = topo.max_length()
    length = st.one_of(
        st.just(1), st.just(longest), st.integers(1, capacity), st.integers(1, longest)
    )
    return topo, draw(st.lists(length, min_size=1, max_size=4 if world == 8 else 5))


@settings(max_examples=60, deadline=None)
@given(
    case=small_batches(),
    kind=st.sampled_from(["reference", "quadratic", "flexsp"]),
    timing=st.sampled_from(TIMINGS),
)
@example(case=(Topology(4, 2, 64), [256, 100, 100, 30, 30]), kind="reference", timing="barrier")
@example(case=(Topology(8, 4, 64), [512, 200, 64, 1]), kind="quadratic", timing="barrier")
@example(case=(Topology(4, 4, 100), [400, 400, 1, 1, 1]), kind="flexsp", timing="barrier")
# Dataflow beats barrier (a long group on two ranks while the other two run a group of two,
# then two single ranks): the barrier bound is above the dataflow optimum on the first four,
# the dataflow bound meets it on three.
@example(case=(Topology(4, 4, 256), [471, 299, 193, 121]), kind="quadratic", timing="dataflow")
@example(case=(Topology(4, 2, 256), [312, 505, 178, 207]), kind="quadratic", timing="dataflow")
@example(case=(Topology(4, 4, 256), [460, 261, 73, 201, 91]), kind="quadratic", timing="dataflow")
@example(case=(Topology(4, 2, 256), [479, 322, 179, 228]), kind="quadratic", timing="dataflow")
@example(case=(Topology(4, 4, 256), [430, 485, 221, 218]), kind="quadratic", timing="dataflow")
@example(case=(Topology(8, 4, 256), [324, 372, 448, 43]), kind="reference", timing="dataflow")
# Batches where the branch and bound expands several nodes:
@example(case=(Topology(8, 2, 256), [786, 1411]), kind="reference", timing="barrier")
@example(case=(Topology(8, 4, 64), [34, 60, 35]), kind="flexsp", timing="barrier")
@example(case=(Topology(8, 4, 64), [112, 512, 233, 363]), kind="reference", timing="barrier")
@example(case=(Topology(4, 2, 64), [182, 256, 150, 93, 101]), kind="reference", timing="barrier")
# The pair row: two long sequences in one wave, a short one that may run in their groups.
@example(case=(Topology(4, 4, 256), [38, 246, 190]), kind="reference", timing="barrier")
@example(case=(Topology(8, 4, 256), [324, 372, 448, 43]), kind="reference", timing="barrier")
@example(case=(Topology(4, 4, 256), [401, 164, 11, 275]), kind="quadratic", timing="barrier")
# The wave-holding row on three and four sequences (it meets the optimum on these).
@example(case=(Topology(8, 2, 100), [185, 328, 320, 1]), kind="reference", timing="barrier")
@example(case=(Topology(8, 4, 64), [28, 192, 168, 122]), kind="quadratic", timing="barrier")
def test_lp_bound_never_above_the_optimum(
    case: tuple[Topology, list[int]], kind: str, timing: str
) -> None:
    """Under either timing, the bound of that timing is at most that timing's optimum."""
    topo, lengths = case
    model = any_model(kind, topo.ranks_per_node)
    best = optimum(lengths, topo, model, timing)
    simple = lower_bound(np.asarray(lengths), topo, model)
    assert simple <= best * (1 + REL)
    previous = simple
    for budget in (1, 2, MAX_SOLVES, 40):  # more branching never lowers the bound
        lp = lp_lower_bound(np.asarray(lengths), topo, model, max_solves=budget, timing=timing)
        assert lp.status in ("OPTIMAL", "TRIVIAL")
        assert lp.solves <= budget
        assert previous * (1 - REL) <= lp.seconds <= best * (1 + REL), (budget, lp, best)
        previous = lp.seconds


@pytest.mark.parametrize(
    ("topo", "lengths", "kind"),
    [
        (Topology(8, 2, 100), [185, 328, 320, 1], "reference"),
        (Topology(8, 4, 100), [273, 367, 176], "reference"),
        (Topology(8, 4, 64), [28, 192, 168, 122], "quadratic"),
    ],
)
def test_holding_more_sequences_reaches_the_optimum(
    topo: Topology, lengths: list[int], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three or four sequences on 8 ranks: the bound that lays out all of them in groups and waves
    meets the exhaustive optimum; holding only the two longest leaves it at least 30% below."""
    model = any_model(kind, topo.ranks_per_node)
    best = optimum(lengths, topo, model)
    held = lp_lower_bound(np.asarray(lengths), topo, model, timing="barrier")
    assert held.seconds == pytest.approx(best, rel=1e-9)
    monkeypatch.setattr(lp_bound, "TOP", 2)
    two = lp_lower_bound(np.asarray(lengths), topo, model, timing="barrier")
    assert two.seconds * 1.3 < best


def test_exhaustive_optimum_by_hand() -> None:
    """The search itself: two sequences that need all 4 ranks run in two waves (or one group
    running both one after the other when they fit one micro-batch), so the optimum is the
    least of those; one short sequence alone is its best single-group time."""
    topo = Topology(4, 4, 64)
    model = any_model("reference", 4)
    a, b = 200, 200
    apart = 2 * (model.microbatch_seconds(4, [a]) + model.wave_overhead)
    serial = 2 * model.microbatch_seconds(4, [a]) + model.wave_overhead
    assert 2 * a > 4 * topo.capacity  # they cannot share a micro-batch
    assert optimum([a, b], topo, model) == min(apart, serial)
    best_one = min(model.microbatch_seconds(c, [10]) for c in (1, 2, 4)) + model.wave_overhead
    assert optimum([10], topo, model) == best_one


@st.composite
def menu_batches(draw: st.DrawFn) -> tuple[Topology, list[int]]:
    """Menus beyond powers of two: one domain of 6 (2, 3, 5, 6: 5 leaves a rank out), domains
    of 3 (3 and 6 = two whole domains), one of 12 (3, 4, 6, 12)."""
    world, rpn, sizes = draw(
        st.sampled_from([(6, 6, (1, 2, 3, 5, 6)), (6, 3, (1, 3, 6)), (12, 12, (1, 3, 4, 6, 12))])
    )
    capacity = draw(st.sampled_from([64, 100, 256]))
    topo = Topology(world, rpn, capacity, sizes)
    longest = topo.max_length()
    length = st.one_of(
        st.just(1), st.just(longest), st.integers(1, capacity), st.integers(1, longest)
    )
    return topo, draw(st.lists(length, min_size=1, max_size=3 if world == 12 else 4))


@settings(max_examples=30, deadline=None)
@given(case=menu_batches(), kind=st.sampled_from(["reference", "quadratic", "flexsp"]))
@example(case=(Topology(6, 6, 64, (1, 2, 3, 5, 6)), [320, 190, 100, 7]), kind="reference")
@example(case=(Topology(12, 12, 100, (1, 3, 4, 6, 12)), [1200, 350, 40]), kind="quadratic")
def test_bounds_never_above_the_optimum_on_menus(
    case: tuple[Topology, list[int]], kind: str
) -> None:
    """The bounds' proofs use only that a wave's groups hold disjoint ranks (at most W) and that
    every size is on the menu, never that sizes are powers of two: the exhaustive optimum over
    the menu (waves of at most W ranks, a relaxation of the placement rules, so at most the
    optimum of placeable plans) is never below either bound."""
    topo, lengths = case
    model = any_model(kind, topo.ranks_per_node)
    simple = lower_bound(np.asarray(lengths), topo, model)
    for timing in TIMINGS:
        best = optimum(lengths, topo, model, timing)
        lp = lp_lower_bound(np.asarray(lengths), topo, model, timing=timing)
        assert simple * (1 - REL) <= lp.seconds <= best * (1 + REL), (timing, lp, best)


def _one_wave_each(world: int, groups: list[tuple[int, int, int]], n: int) -> StepPlan:
    """A plan of one group per wave: (start, size, sequence id), one micro-batch each."""
    topo = Topology(world, world, 1 << 20)
    waves = [
        Wave(groups=(Group(start=a, size=c, microbatches=(MicroBatch(seq_ids=(i,)),)),))
        for a, c, i in groups
    ]
    return StepPlan(topology=topo, lengths=tuple([1] * n), waves=tuple(waves))


def test_dataflow_holding_by_hand() -> None:
    """Four ranks, wave overhead 0.5 s. A runs 10 s on two ranks, B 5 s on the other two, then
    C and D 5 s each on one of those. Dataflow: B ends at 5.5, C and D at 11, A at 10.5: the
    step is 11 s, what the plan below times to. Barrier cannot overlap A with two waves: the
    best layout runs A then B in one group of two beside C and D, 15 s (two waves, 10 + 5 s,
    add an overhead). So the holding value (without the caller's overhead) is 10.5 under
    dataflow -- both its parts bind: the rigid makespan 11 - 0.5, and the busy time
    (2 x 10 + 2 x 5 + 5 + 5 + 0.5 x (6 - 4)) / 4 -- and 15 under barrier, above the dataflow
    plan: a bound that kept the barrier's wave holding under dataflow would be invalid."""
    plan = _one_wave_each(4, [(0, 2, 0), (2, 2, 1), (2, 1, 2), (3, 1, 3)], 4)
    step = time_waves(plan, np.array([10.0, 5.0, 5.0, 5.0]), 0.5, timing="dataflow")
    assert step.step_seconds == pytest.approx(11.0)
    inf = np.inf
    r = np.array([[inf, inf, 5.0, 5.0], [20.0, 10.0, inf, inf], [inf] * 4])
    tables = ([1, 2, 4], 4, 1 << 20, np.zeros(3), 0.5)
    items = [(0, 1, 10.0, 20.0), (1, 1, 5.0, 10.0), (2, 0, 5.0, 5.0), (3, 0, 5.0, 5.0)]
    model = any_model("reference", 4)  # not called: no two of a size share a micro-batch
    lengths = np.asarray([1 << 20] * 4)  # none fits beside another
    riders = holding._Riders(r, r.min(axis=0))
    df = holding._held_value(items, riders, model, lengths, tables, timing="dataflow")
    barrier = holding._held_value(items, riders, model, lengths, tables, timing="barrier")
    assert df + 0.5 == pytest.approx(step.step_seconds, rel=1e-12)
    assert barrier == pytest.approx(15.0, rel=1e-12)
    assert barrier + 0.5 > step.step_seconds


def test_rigid_makespan_by_hand() -> None:
    """Two ranks: two 4 s tasks of one rank and one of both end at 8 (the last after both);
    three of one rank, 8 (two on one rank). Three ranks: three of one rank and one of all
    three, 8. Four ranks, sizes 3, 3, 2: no two fit side by side, 1 + 2 + 3 s in a row."""
    assert holding._rigid_makespan([(1, 4.0), (1, 4.0), (2, 4.0)], 2) == 8.0
    assert holding._rigid_makespan([(1, 4.0), (1, 4.0), (1, 4.0)], 2) == 8.0
    assert holding._rigid_makespan([(1, 4.0), (1, 4.0), (1, 4.0), (3, 4.0)], 3) == 8.0
    # Sizes that cannot sit side by side run one after the other whatever the order.
    assert holding._rigid_makespan([(3, 1.0), (3, 2.0), (2, 3.0)], 4) == 6.0


@settings(max_examples=150, deadline=None)
@given(
    world=st.sampled_from([2, 3, 4, 6, 8]),
    tasks=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 9)), min_size=1, max_size=4),
)
def test_rigid_makespan_is_the_exhaustive_optimum(world: int, tasks: list[tuple[int, int]]) -> None:
    """The list schedules over task orders reach the least makespan of rigid tasks, found here
    by trying every order and every choice of ranks (``dataflow_optimum``'s search)."""
    tasks = [(min(c, world), float(d)) for c, d in tasks]
    exact = rigid_optimum(tuple(tasks), world)
    assert holding._rigid_makespan(tasks, world) == pytest.approx(exact, rel=1e-12)


def rigid_optimum(tasks: tuple[tuple[int, float], ...], world: int) -> float:
    """Least end of ``tasks`` (ranks, seconds), each started when the ranks it takes are free:
    every order and every choice of ranks, ranks free at the same time being interchangeable."""

    @functools.cache
    def finish(left: tuple[tuple[int, float], ...], free: tuple[tuple[float, int], ...]) -> float:
        if not left:
            return max(t for t, _ in free)
        best = float("inf")
        for x, (c, d) in enumerate(left):
            if left.index((c, d)) != x:
                continue  # identical tasks: one order of them is enough
            rest = left[:x] + left[x + 1 :]
            for take in takes(free, c):
                start = max(t for (t, _), k in zip(free, take) if k)
                merged: dict[float, int] = {}
                for t, m in [
                    *((t, m - k) for (t, m), k in zip(free, take) if m > k),
                    (start + d, c),
                ]:
                    merged[t] = merged.get(t, 0) + m
                best = min(best, finish(rest, tuple(sorted(merged.items()))))
        return best

    return finish(tuple(sorted(tasks)), ((0.0, world),))


def random_small_batch(rng: random.Random) -> tuple[Topology, list[int], str]:
    """A small batch, half of them built so that dataflow can beat barrier: a sequence for half
    the ranks, one for two ranks, short ones for single ranks."""
    kind = rng.choice(["reference", "quadratic", "flexsp"])
    if rng.random() < 0.5:
        world = rng.choice([2, 4, 8])
        rpn = rng.choice([r for r in (2, 4) if world % r == 0 or world <= r])
        topo = Topology(world, rpn, rng.choice([64, 100, 256]))
        cap, longest = topo.capacity, topo.max_length()
        n = rng.randint(1, 4 if world == 8 else 5)
        pick = [1, longest, rng.randint(1, cap), rng.randint(1, longest)]
        return topo, [rng.choice(pick) for _ in range(n)], kind
    world = rng.choice([4, 8])
    topo = Topology(world, rng.choice([2, 4]), rng.choice([64, 100, 256]))
    cap = topo.capacity
    lengths = [rng.randint(world // 2 * cap * 3 // 4, world // 2 * cap)]
    lengths += [rng.randint(cap + 1, 2 * cap)]
    lengths += [rng.randint(cap // 2, cap) for _ in range(rng.randint(1, 3 if world == 4 else 2))]
    return topo, lengths, kind


def test_random_small_batches_under_both_timings() -> None:
    """A seeded sweep of small batches (``DYNCP_EXACT_BATCHES`` of them, 40 by default; run
    with thousands to sweep wider): each timing's bound is at most that timing's exhaustive
    optimum, the dataflow optimum at most the barrier one, and the dataflow bound at least the
    closed form."""
    rng = random.Random(2026)
    for _ in range(int(os.environ.get("DYNCP_EXACT_BATCHES", "40"))):
        topo, lengths, kind = random_small_batch(rng)
        model = any_model(kind, topo.ranks_per_node)
        arr = np.asarray(lengths)
        simple = lower_bound(arr, topo, model)
        best = {t: optimum(lengths, topo, model, t) for t in TIMINGS}
        assert best["dataflow"] <= best["barrier"] * (1 + REL)
        for timing in TIMINGS:
            lp = lp_lower_bound(arr, topo, model, timing=timing)
            assert simple * (1 - REL) <= lp.seconds <= best[timing] * (1 + REL), (
                topo,
                lengths,
                kind,
                timing,
                lp.seconds,
                best[timing],
            )


@pytest.mark.xfail(
    strict=True,
    reason="open: found by hypothesis on 2026-12-01; with max_solves=6 the dataflow LP bound "
    "is 1.4e-5 (relative) below the bound with max_solves=1 on this batch",
)
def test_more_branching_never_lowers_the_bound_on_the_found_case() -> None:
    """The counterexample a random draw of test_lp_bound_never_above_the_optimum found: the
    bound must not fall when the branching budget grows (strict xfail: passes once fixed)."""
    topo = Topology(world=4, ranks_per_node=2, capacity=100, group_sizes=(1, 2, 4))
    lengths = np.asarray([400, 90, 153])
    model = any_model("flexsp", topo.ranks_per_node)
    one = lp_lower_bound(lengths, topo, model, max_solves=1, timing="dataflow")
    more = lp_lower_bound(lengths, topo, model, max_solves=MAX_SOLVES, timing="dataflow")
    assert one.seconds * (1 - REL) <= more.seconds
