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
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_lp_bound import any_model

import dyncp.planner.lp_bound as lp_bound
from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.bound import lower_bound
from dyncp.planner.lp_bound import MAX_SOLVES, lp_lower_bound

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


def optimum(lengths: list[int], topo: Topology, model: CostModel) -> float:
    """Least predicted step seconds of any valid plan of ``lengths`` (exhaustive)."""
    n = len(lengths)
    sizes = topo.group_sizes

    @functools.cache
    def group_seconds(block: tuple[int, ...], cp: int) -> float:
        """Best packing of ``block`` into micro-batches at ``cp`` (inf if one does not fit)."""
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
@given(case=small_batches(), kind=st.sampled_from(["reference", "quadratic", "flexsp"]))
@example(case=(Topology(4, 2, 64), [256, 100, 100, 30, 30]), kind="reference")
@example(case=(Topology(8, 4, 64), [512, 200, 64, 1]), kind="quadratic")
@example(case=(Topology(4, 4, 100), [400, 400, 1, 1, 1]), kind="flexsp")
# Batches where the branch and bound expands several nodes:
@example(case=(Topology(8, 2, 256), [786, 1411]), kind="reference")
@example(case=(Topology(8, 4, 64), [34, 60, 35]), kind="flexsp")
@example(case=(Topology(8, 4, 64), [112, 512, 233, 363]), kind="reference")
@example(case=(Topology(4, 2, 64), [182, 256, 150, 93, 101]), kind="reference")
# The pair row: two long sequences in one wave, a short one that may run in their groups.
@example(case=(Topology(4, 4, 256), [38, 246, 190]), kind="reference")
@example(case=(Topology(8, 4, 256), [324, 372, 448, 43]), kind="reference")
@example(case=(Topology(4, 4, 256), [401, 164, 11, 275]), kind="quadratic")
# The wave-holding row on three and four sequences (it meets the optimum on these).
@example(case=(Topology(8, 2, 100), [185, 328, 320, 1]), kind="reference")
@example(case=(Topology(8, 4, 64), [28, 192, 168, 122]), kind="quadratic")
def test_lp_bound_never_above_the_optimum(case: tuple[Topology, list[int]], kind: str) -> None:
    topo, lengths = case
    model = any_model(kind, topo.ranks_per_node)
    best = optimum(lengths, topo, model)
    simple = lower_bound(np.asarray(lengths), topo, model)
    previous = simple
    for budget in (1, 2, MAX_SOLVES, 40):  # more branching never lowers the bound
        lp = lp_lower_bound(np.asarray(lengths), topo, model, max_solves=budget)
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
    held = lp_lower_bound(np.asarray(lengths), topo, model)
    assert held.seconds == pytest.approx(best, rel=1e-9)
    monkeypatch.setattr(lp_bound, "TOP", 2)
    two = lp_lower_bound(np.asarray(lengths), topo, model)
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
        st.sampled_from(
            [(6, 6, (1, 2, 3, 5, 6)), (6, 3, (1, 3, 6)), (12, 12, (1, 3, 4, 6, 12))]
        )
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
    best = optimum(lengths, topo, model)
    simple = lower_bound(np.asarray(lengths), topo, model)
    lp = lp_lower_bound(np.asarray(lengths), topo, model)
    assert simple * (1 - REL) <= lp.seconds <= best * (1 + REL), (lp, best)
