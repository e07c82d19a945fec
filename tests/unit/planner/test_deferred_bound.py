"""Bounds off the critical path (``Planner(defer_bound=...)``, ``dyncp.planner.bounds.deferred``)
and the constructor's fast pouring (``GreedyConstructor._pour``), which must build the same plans as
the plain formulation it replaced."""

from __future__ import annotations

import copy
import heapq
import json
import math
import pickle
import threading

import numpy as np
import pytest

from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan, Topology, plan_digest
from dyncp.planner.bounds.deferred import BOUND_KEYS, PENDING, DeferredBounds
from dyncp.planner.construction.greedy import GreedyConstructor
from dyncp.planner.planner import DEFER_BOUND, Planner

MODEL = CostModel.load("h100-reference", ranks_per_node=8)


def batch(n: int, seed: int, long_share: float = 0.1) -> np.ndarray:
    """Short lognormal documents with a share of long ones (rings in the plan)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < long_share
    x = np.where(long, rng.uniform(8192, 65536, n), rng.lognormal(np.log(800), 1.0, n))
    return np.clip(np.rint(x), 1, 131072).astype(np.int64)


def planner(world: int = 16, **kw) -> Planner:
    return Planner(MODEL, world=world, ranks_per_node=8, capacity=8192, **kw)


def test_deferred_bound_equals_the_synchronous_one() -> None:
    lengths = batch(96, seed=1)
    sync = planner(deterministic=True, cpsat=None).plan(lengths)
    later = planner(deterministic=True, cpsat=None, defer_bound="always")
    plan = later.plan(lengths)
    assert plan.stats["bound"]["deferred"] is True
    assert plan_digest(plan) == plan_digest(sync)  # the plan does not wait for, nor use, it
    later.wait_bound(plan)
    assert not later.bound_pending(plan)
    for key in BOUND_KEYS:  # the same computation on the same inputs: the same numbers
        assert plan.stats[key] == sync.stats[key], key
    assert plan.stats["bound"]["status"] == sync.stats["bound"]["status"]
    assert plan.stats["timings"]["bound_seconds"] > 0
    assert plan.stats["predicted_step_seconds"] >= plan.stats["lower_bound_seconds"] * (1 - 1e-9)
    assert "deferred" not in sync.stats["bound"]


def test_pending_fields_are_none_then_written_without_changing_keys() -> None:
    plan = planner().plan(batch(40, seed=2))
    keys, timing_keys = set(plan.stats), set(plan.stats["timings"])
    release = threading.Event()
    fields = {k: 1.0 for k in BOUND_KEYS} | {"bound": {"kind": "tight"}, "bound_seconds": 0.5}

    def compute() -> dict:
        release.wait(60)
        return fields

    bounds = DeferredBounds()
    bounds.submit(plan, compute, lambda exc: fields)
    try:
        assert bounds.pending(plan)
        assert all(plan.stats[k] is None for k in BOUND_KEYS)
        assert plan.stats["bound"]["status"] == PENDING
        assert plan.stats["timings"]["bound_seconds"] is None
        json.dumps(plan.stats)  # a pending plan still encodes (the plan service publishes it)
        with pytest.raises(TimeoutError):
            bounds.wait(plan, timeout=0.01)  # the worker is blocked on the event
    finally:
        release.set()
    bounds.wait(plan, timeout=60)
    assert not bounds.pending(plan)
    assert set(plan.stats) == keys and set(plan.stats["timings"]) == timing_keys
    assert all(plan.stats[k] == 1.0 for k in BOUND_KEYS)
    assert plan.stats["bound"] == {"kind": "tight", "deferred": True}
    bounds.close()


def test_a_failing_deferred_bound_reports_the_fallback() -> None:
    plan = planner().plan(batch(40, seed=3))
    fallback = {k: 2.0 for k in BOUND_KEYS} | {"bound": {"kind": "simple"}, "bound_seconds": 0.1}

    def broken() -> dict:
        raise RuntimeError("solver crashed")

    bounds = DeferredBounds()
    bounds.submit(plan, broken, lambda exc: fallback | {"bound": {"status": repr(exc)}})
    bounds.wait(plan, timeout=60)
    assert plan.stats["lower_bound_seconds"] == 2.0
    assert "solver crashed" in plan.stats["bound"]["status"]
    bounds.close()


def test_auto_defers_only_large_batches_against_a_wall_clock_deadline() -> None:
    def defers(p: Planner, sequences: int) -> bool:  # against the planner's own time limit
        return p._defers(sequences, p.time_limit)

    p = planner(world=16384, time_limit=4.0)
    assert p.defer_bound == "auto"
    assert defers(p, 131072)  # ~4 s predicted: more than a quarter of 4 s
    assert not defers(p, 512)  # milliseconds: never
    assert not defers(p, 3333)  # at most DEFER_MIN_SECONDS, whatever the time limit
    assert not defers(planner(world=16384, time_limit=20.0), 131072)  # fits the deadline
    assert not defers(planner(world=16384, deterministic=True), 131072)
    assert not defers(planner(world=16384, bound="simple"), 131072)
    assert not defers(planner(world=16384, defer_bound="never"), 131072)
    assert defers(planner(defer_bound="always"), 10)
    with pytest.raises(ValueError, match="defer_bound"):
        planner(defer_bound="later")
    assert DEFER_BOUND == ("auto", "always", "never")


def _plain_pour(self, sand, classes, level, slots, tables, whole_passes=False) -> None:
    """The pouring as it was written before ``_pour``: per sequence a tuple key per class,
    heappop / heappush (the reference the fast loop must reproduce)."""
    slot_items, slot_marg, slot_tokens = slots
    marg, pad, fixed, unit = tables
    keys = sorted(classes)
    width = len(self.sizes)
    order = sorted(sand, key=lambda i: (-self.seconds[0, i], i))
    cols = np.asarray(order, dtype=np.int64)
    marg_t = marg[:, cols].T.tolist()
    pad_t = pad[:, cols].T.tolist()
    spent_t = (self.seconds[:, cols] * self.sizes[:, None]).T.tolist()
    unit_l = unit[:, 0].tolist()
    for n, i in enumerate(order):
        best = None
        m_i, p_i, s_i = marg_t[n], pad_t[n], spent_t[n]
        for w, row in keys:
            j = classes[(w, row)][0][1]
            n_pass = max(1.0, (slot_tokens[j] + p_i[row]) / unit_l[row])
            if whole_passes:
                n_pass = math.ceil(n_pass - 1e-9)
            new = slot_marg[j] + m_i[row] + fixed[row] * n_pass
            key = (max(new - level[w], 0.0), s_i[row], new, w * width + row)
            if best is None or key < best:
                best = key
        w, row = divmod(best[3], width)
        _, j = heapq.heappop(classes[(w, row)])
        heapq.heappush(classes[(w, row)], (best[2], j))
        slot_items[j].append(i)
        slot_marg[j] += m_i[row]
        slot_tokens[j] += p_i[row]
        level[w] = max(level[w], best[2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_pouring_builds_the_plans_of_the_plain_one(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate of the constructor (both pass accountings, every structure), at 32 ranks:
    identical plans with the fast and the plain pouring."""
    lengths = batch(256, seed=seed, long_share=0.08)
    topo = Topology(32, 8, 8192)

    def candidates() -> list[StepPlan]:
        g = GreedyConstructor(lengths, topo, MODEL)
        return list(g.candidates())

    fast = [plan_digest(p) for p in candidates()]
    monkeypatch.setattr(GreedyConstructor, "_pour", _plain_pour)
    plain = [plan_digest(p) for p in candidates()]
    assert len(fast) > 10
    assert fast == plain


def test_a_2048_rank_step_is_planned_valid_with_its_bound_after() -> None:
    lengths = batch(16384, seed=4, long_share=0.02)
    p = planner(world=2048, time_limit=0.5, defer_bound="always", cpsat=None)
    plan = p.plan(lengths)
    plan.validate()  # every sequence exactly once, within capacity, on allowed blocks
    assert sorted(i for _, _, mb in plan.microbatches() for i in mb.seq_ids) == list(
        range(len(lengths))
    )
    p.wait_bound(plan, timeout=600)
    st = plan.stats
    assert st["lower_bound_seconds"] >= st["simple_lower_bound_seconds"] * (1 - 1e-9)
    assert st["predicted_step_seconds"] >= st["lower_bound_seconds"] * (1 - 1e-9)
    assert st["gap_to_lower_bound"] == pytest.approx(
        st["predicted_step_seconds"] / st["lower_bound_seconds"] - 1.0, rel=1e-12
    )


def test_a_planner_with_a_deferred_bound_still_pickles() -> None:
    """Planners travel to other processes (spawned workers): the worker thread does not."""
    p = planner(defer_bound="always")
    plan = p.plan(batch(40, seed=5))
    clone = pickle.loads(pickle.dumps(p))
    twin = copy.deepcopy(p)
    p.wait_bound(plan)
    for other in (clone, twin):
        again = other.plan(batch(40, seed=5))
        other.wait_bound(again)
        assert again.stats["lower_bound_seconds"] == plan.stats["lower_bound_seconds"]
