"""The pipelined lower bound against the exhaustive optimum of tiny batches.

On W = 2 columns and P = 2 stages (V = 1 and 2), every valid pipelined plan of 2-5 sequences is
enumerated: a set partition into micro-batches, an order of them, a cut of the order into slots
of one micro-batch (a group of 2, or one column with the other idle) or two (one per column),
each micro-batch fitting its group. All plans of one slot count are priced in one schedule call,
side by side as columns of one wide StageCosts (plans share no column, so none delays another;
checked against ``price_pipeline`` on a sample). The bound must be at most the least step.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
from test_bound import cost_model
from test_lp_bound_exact import partitions

from dyncp.cost_model import CostModel, price_pipeline, stage_costs
from dyncp.cost_model.pipeline_schedule import StageCosts, schedule
from dyncp.plan import Group, MicroBatch, Pipeline, StepPlan, Topology, Wave
from dyncp.planner.bounds.pipeline import pipeline_lower_bound

REL = 1e-9
W = 2

Slot = tuple[tuple[tuple[int, ...], int, int], ...]  # (block, start, size) per group


def _fits(block: tuple[int, ...], size: int, lengths: list[int], topo: Topology) -> bool:
    return topo.memory_tokens([lengths[i] for i in block], size) <= topo.capacity


def plans(lengths: list[int], topo: Topology, pipeline: Pipeline) -> Iterator[list[Slot]]:
    """Every valid pipelined plan of ``lengths`` on two columns, as slots."""
    k = pipeline.slot_multiple()
    for part in partitions(tuple(range(len(lengths)))):
        for order in itertools.permutations(part):
            yield from _cuts(list(order), lengths, topo, k)


def _cuts(order: list, lengths: list[int], topo: Topology, k: int) -> Iterator[list[Slot]]:
    def rec(i: int, acc: list[Slot]) -> Iterator[list[Slot]]:
        if i == len(order):
            if len(acc) % k == 0:
                yield list(acc)
            return
        b = order[i]
        for start, size in ((0, 2), (0, 1), (1, 1)):
            if _fits(b, size, lengths, topo):
                yield from rec(i + 1, [*acc, ((b, start, size),)])
        if i + 1 < len(order) and _fits(b, 1, lengths, topo):
            c = order[i + 1]
            if _fits(c, 1, lengths, topo):
                yield from rec(i + 2, [*acc, ((b, 0, 1), (c, 1, 1))])

    yield from rec(0, [])


def to_plan(slots: list[Slot], lengths: list[int], topo: Topology, pipeline: Pipeline):
    waves = tuple(
        Wave(tuple(Group(start, size, (MicroBatch(block),)) for block, start, size in slot))
        for slot in slots
    )
    return StepPlan(topo, tuple(lengths), waves, pipeline=pipeline)


class _Columns:
    """Each (micro-batch, placement)'s per-column forward, backward and hops, priced once by
    ``stage_costs`` on a plan holding it alone (its slot count repeated as the schedule needs)."""

    def __init__(
        self, lengths: list[int], topo: Topology, pipeline: Pipeline, model, kw: dict
    ) -> None:
        self.args = (lengths, topo, pipeline, model)
        self.kw = kw
        self.cache: dict[tuple, tuple[np.ndarray, ...]] = {}

    def get(self, block: tuple[int, ...], start: int, size: int) -> tuple[np.ndarray, ...]:
        key = (block, start, size)
        if key not in self.cache:
            lengths, topo, pipeline, model = self.args
            slot: Slot = ((block, start, size),)
            plan = to_plan([slot] * pipeline.slot_multiple(), lengths, topo, pipeline)
            c = stage_costs(plan, model, **self.kw)
            self.cache[key] = (c.forward[0], c.backward[0], c.transfer[0], c.busy[0])
        return self.cache[key]


def optimum(
    lengths: list[int], topo: Topology, pipeline: Pipeline, model, **kw: object
) -> tuple[float, int]:
    """Least ``price_pipeline`` step of any valid pipelined plan, and how many plans there were
    (``kw``: ``stage_costs``'s keywords, for a plug-in model)."""
    cols = _Columns(lengths, topo, pipeline, model, kw)
    by_count: dict[int, list[list[Slot]]] = {}
    for slots in plans(lengths, topo, pipeline):
        by_count.setdefault(len(slots), []).append(slots)
    best, count = np.inf, 0
    nq = pipeline.model_stages
    for m, group in by_count.items():
        k = len(group)
        count += k
        fwd, bwd, hop = (np.zeros((m, k * W, nq)) for _ in range(3))
        busy = np.zeros((m, k * W), dtype=bool)
        firsts: list[list[int]] = [[] for _ in range(m)]
        for x, slots in enumerate(group):
            base = x * W
            for j, slot in enumerate(slots):
                used = set()
                for block, start, size in slot:
                    f, b, t, on = cols.get(block, start, size)
                    span = slice(start, start + size)
                    at = slice(base + start, base + start + size)
                    fwd[j, at], bwd[j, at], hop[j, at], busy[j, at] = (
                        f[span],
                        b[span],
                        t[span],
                        on[span],
                    )
                    firsts[j].append(base + start)
                    used.update(range(start, start + size))
                firsts[j] += [base + c for c in range(W) if c not in used]
        segments = tuple(np.asarray(sorted(f), dtype=np.int64) for f in firsts)
        cost = schedule(StageCosts(pipeline, fwd, bwd, hop, busy, segments))
        steps = cost.op_end.reshape(pipeline.stages, -1, k, W).max(axis=(0, 1, 3))
        best = min(best, float(steps.min()))
        # The side-by-side pricing is price_pipeline's, plan by plan (a sample).
        rng = random.Random(m)
        for x in rng.sample(range(k), min(3, k)):
            plan = to_plan(group[x], lengths, topo, pipeline)
            alone = price_pipeline(plan, model, costs=stage_costs(plan, model, **kw))
            assert steps[x] == pytest.approx(alone.step_seconds, rel=1e-12)
    return best, count


CASES = [
    # (lengths, capacity, ranks per node): short and long, some needing both columns.
    ([900, 300], 1024, 8),
    ([4000, 200, 100], 4096, 8),
    ([3000, 2500, 800, 50], 4096, 1),
    ([1500, 1500, 1500, 1500], 2048, 8),
    ([6000, 64, 64, 64], 4096, 8),
]


@pytest.mark.parametrize("kind", ["reference", "quadratic", "flexsp"])
@pytest.mark.parametrize("virtual", [1, 2])
@pytest.mark.parametrize(("lengths", "capacity", "rpn"), CASES)
def test_bound_is_below_every_pipelined_plan(
    kind: str, virtual: int, lengths: list[int], capacity: int, rpn: int
) -> None:
    model = CostModel.load("published-flexsp", rpn) if kind == "flexsp" else cost_model(kind, rpn)
    topo = Topology(W, rpn, capacity)
    pipeline = Pipeline(2, virtual)
    best, count = optimum(lengths, topo, pipeline, model)
    assert count > 0 and np.isfinite(best)
    bound = pipeline_lower_bound(np.asarray(lengths), topo, pipeline, model)
    assert bound.seconds <= best * (1 + REL), (bound, best)
    # Not vacuous: within a factor of the optimum on these batches.
    assert bound.seconds >= 0.5 * best, (bound, best)


FIVE = [([3000, 2500, 800, 50, 700], 4096, 1), ([1000] * 5, 2048, 8)]


@pytest.mark.parametrize("kind", ["reference", "quadratic"])
@pytest.mark.parametrize("virtual", [1, 2])
@pytest.mark.parametrize(("lengths", "capacity", "rpn"), FIVE)
def test_bound_is_below_every_pipelined_plan_of_five_sequences(
    kind: str, virtual: int, lengths: list[int], capacity: int, rpn: int
) -> None:
    """About 30 000 to 70 000 plans each (slow: a few seconds a case)."""
    model = cost_model(kind, rpn)
    topo = Topology(W, rpn, capacity)
    pipeline = Pipeline(2, virtual)
    best, count = optimum(lengths, topo, pipeline, model)
    assert count > 10_000
    bound = pipeline_lower_bound(np.asarray(lengths), topo, pipeline, model)
    assert 0.5 * best <= bound.seconds <= best * (1 + REL), (bound, best)


@pytest.mark.parametrize("kind", ["reference", "quadratic", "flexsp"])
@pytest.mark.parametrize("length", [64, 1500, 3500])
def test_one_sequence_the_bound_is_the_optimum(kind: str, length: int) -> None:
    """Its micro-batch's forward and backward chain is the whole step, and the bound's chain
    is that chain at the best layout."""
    model = CostModel.load("published-flexsp", 8) if kind == "flexsp" else cost_model(kind, 8)
    topo, pipeline = Topology(W, 8, 2048), Pipeline(2)
    best, _ = optimum([length], topo, pipeline, model)
    bound = pipeline_lower_bound(np.asarray([length]), topo, pipeline, model)
    assert bound.seconds == pytest.approx(best, rel=1e-9)


def test_the_exhaustive_check_has_teeth() -> None:
    """A bound half again as large is refuted by some enumerated plan of these cases: the
    exhaustive test would catch a bound that much too high (the mutation of the report)."""
    refuted = 0
    for lengths, capacity, rpn in CASES:
        model = cost_model("reference", rpn)
        topo, pipeline = Topology(W, rpn, capacity), Pipeline(2)
        best, _ = optimum(lengths, topo, pipeline, model)
        bound = pipeline_lower_bound(np.asarray(lengths), topo, pipeline, model)
        refuted += 1.5 * bound.seconds > best * (1 + REL)
    assert refuted == len(CASES)


def test_the_parts_of_the_bound() -> None:
    model = cost_model("reference", 8)
    topo = Topology(W, 8, 4096)
    b = pipeline_lower_bound(np.asarray([4000, 200, 100]), topo, Pipeline(2), model)
    assert b.fill[0] == b.drain[0] == 0.0 < b.fill[1] < b.drain[1]  # backward = 2 x forward
    assert b.seconds >= max(max(w + f + d for w, f, d in zip(b.work, b.fill, b.drain)), b.chain)
    empty = pipeline_lower_bound(np.asarray([], dtype=np.int64), topo, Pipeline(2), model)
    assert empty.seconds == 0.0
    with pytest.raises(ValueError, match="exceed the longest sequence"):
        pipeline_lower_bound(np.asarray([10**6]), topo, Pipeline(2), model)


class _PlugIn:
    """The protocol's bound members only: no linear parts, no profile (the uniform cut)."""

    def __init__(self, inner: CostModel) -> None:
        self._inner = inner
        self.microbatch_overhead = inner.microbatch_overhead

    def packs_seconds(self, cp: int, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return self._inner.packs_seconds(cp, lengths, starts)

    def fixed_seconds(self, cp: int) -> float:
        return self._inner.fixed_seconds(cp)

    def bound_rank_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        return self._inner.bound_rank_seconds(cp, lengths)

    def alone_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        return self._inner.alone_seconds(cp, lengths)


@pytest.mark.parametrize("virtual", [1, 2])
@pytest.mark.parametrize(("lengths", "capacity", "rpn"), CASES[1:4])
def test_a_plug_in_model_is_bounded_too(
    virtual: int, lengths: list[int], capacity: int, rpn: int
) -> None:
    model = _PlugIn(cost_model("quadratic", rpn))
    kw = {
        "num_layers": 8,
        "activation_bytes_per_token": 8192.0,
        "p2p": ((2e-6, 4e11), (8e-6, 4e10)),
    }
    topo, pipeline = Topology(W, rpn, capacity), Pipeline(2, virtual)
    best, _ = optimum(lengths, topo, pipeline, model, **kw)
    bound = pipeline_lower_bound(np.asarray(lengths), topo, pipeline, model, **kw)
    assert 0.5 * best <= bound.seconds <= best * (1 + REL), (bound, best)


def _random_plan(lengths: list[int], topo: Topology, pipeline: Pipeline, rng: random.Random):
    """Sequences dealt at random into micro-batches of one or two, each on the smallest group
    that holds it, placed first-fit at aligned columns (a random gap leaves columns idle), a
    new slot when the current one is full; None when the slot count does not suit the
    schedule (the caller draws again)."""
    ids = list(range(len(lengths)))
    rng.shuffle(ids)
    slots: list[list] = [[]]
    free = 0
    while ids:
        block = tuple(ids[: rng.randint(1, 2)])
        if not _fits(block, topo.world, lengths, topo):
            block = block[:1]
        del ids[: len(block)]
        size = next(c for c in topo.group_sizes if _fits(block, c, lengths, topo))
        start = -(-free // size) * size
        if start + size > topo.world:
            slots.append([])
            start = 0
        slots[-1].append((block, start, size))
        free = start + size + rng.choice([0, 0, 1])
    if len(slots) % pipeline.slot_multiple():
        return None
    return to_plan([tuple(x) for x in slots], lengths, topo, pipeline)


@pytest.mark.parametrize("kind", ["reference", "quadratic"])
@pytest.mark.parametrize("pipeline", [Pipeline(3), Pipeline(4), Pipeline(3, 2), Pipeline(4, 2)])
def test_bound_is_below_random_plans_on_more_stages(kind: str, pipeline: Pipeline) -> None:
    """The fill and drain through two and three earlier stages, on 8 columns."""
    rng = random.Random(7)
    model = cost_model(kind, 4)
    topo = Topology(8, 4, 4096)
    priced = 0
    for _ in range(60):
        lengths = [
            rng.choice([64, 300, 1200, 3000, 7000, 12000]) for _ in range(rng.randint(8, 20))
        ]
        plan = _random_plan(lengths, topo, pipeline, rng)
        if plan is None:
            continue
        plan.validate()
        priced += 1
        step = price_pipeline(plan, model).step_seconds
        bound = pipeline_lower_bound(np.asarray(lengths), topo, pipeline, model)
        assert bound.seconds <= step * (1 + REL), (bound, step)
        assert bound.fill[-1] > bound.fill[1] > 0.0
    assert priced >= 10
