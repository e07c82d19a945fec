"""The lower bound (dyncp.planner.bounds.closed_form) is never above the predicted seconds of any
valid plan.

Checked under two cost models -- the bundled table-form ``h100-reference`` profile (communication
overlapped) and a quadratic-form profile built here (communication not overlapped) -- against the
plans of every policy and against random valid plans (random CP sizes, packing, groups, waves).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from planner_helpers import topologies

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, load_profile
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner import lower_bound, min_cp_sizes
from dyncp.planner.planner import POLICIES, Planner

# Relative slack for float round-off only: the bound may be tight (one sequence alone).
REL = 1e-9


# ----------------------------------------------------------------------------- cost models


def quadratic_profile() -> Profile:
    """A quadratic-form profile without overlap; numbers chosen so every term matters at the
    small capacities used here (attention, linear, ring transfers, both overheads)."""
    data = load_profile("h100-reference").model_dump(mode="json")
    data["name"] = "test-quadratic"
    data["linear_seconds_per_token"] = 2e-6
    data["attention"] = {
        "form": "quadratic",
        "alpha": 5e-10,
        "beta": 2e-7,
        "step_overhead_seconds": 3e-5,
        "backward_forward_ratio": 2.0,
    }
    data["communication"] = {
        "kv_bytes_per_token": 4096.0,
        "backward_bytes_factor": 2.0,
        "overlap": False,
        "intra_node": {"latency_seconds": 1e-5, "bandwidth_bytes_per_second": 2e10},
        "inter_node": {"latency_seconds": 3e-5, "bandwidth_bytes_per_second": 2e9},
    }
    data["overheads"] = {"microbatch_seconds": 1e-3, "wave_seconds": 2e-4}
    return Profile.model_validate(data)


@functools.cache
def cost_model(kind: str, ranks_per_node: int) -> CostModel:
    if kind == "reference":
        return CostModel.load("h100-reference", ranks_per_node)
    return CostModel(quadratic_profile(), ranks_per_node)


MODELS = ("reference", "quadratic")


def test_quadratic_profile_is_what_it_claims() -> None:
    model = cost_model("quadratic", 4)
    assert model.profile.attention.form == "quadratic"
    assert model.overlap is False
    assert cost_model("reference", 4).profile.attention.form == "table"
    assert cost_model("reference", 4).overlap is True


# ----------------------------------------------------------------------------- random plans


def random_plan(lengths: list[int], topo: Topology, rng: random.Random) -> StepPlan:
    """A random valid plan: random CP size >= each sequence's minimum, random capacity-respecting
    packing, a random split of micro-batches into groups, random waves and aligned positions."""
    n = len(lengths)
    m = min_cp_sizes(np.asarray(lengths), topo)
    by_cp: dict[int, list[int]] = {}
    for i in range(n):
        options = [c for c in topo.group_sizes if c >= m[i]]
        by_cp.setdefault(rng.choice(options), []).append(i)
    groups: list[tuple[int, list[list[int]]]] = []
    for cp in sorted(by_cp):
        ids = by_cp[cp]
        rng.shuffle(ids)
        mbs: list[list[int]] = []
        for i in ids:
            fitting = [mb for mb in mbs if topo.fits([lengths[j] for j in mb + [i]], cp)]
            if fitting and rng.random() < 0.7:
                rng.choice(fitting).append(i)
            else:
                mbs.append([i])
        rng.shuffle(mbs)
        n_groups = rng.randint(1, len(mbs))
        buckets: list[list[list[int]]] = [[] for _ in range(n_groups)]
        for k, mb in enumerate(mbs):
            buckets[k if k < n_groups else rng.randrange(n_groups)].append(mb)
        groups += [(cp, b) for b in buckets]
    # Decreasing sizes: the free ranks of a wave then always form aligned blocks of the current
    # size, so any wave with enough free ranks has room at an aligned start.
    rng.shuffle(groups)
    groups.sort(key=lambda g: -g[0])
    waves: list[tuple[list[bool], list[Group]]] = []
    for size, mbs in groups:
        open_waves = [w for w in waves if w[0].count(False) >= size]
        if open_waves and rng.random() < 0.6:
            used, placed = rng.choice(open_waves)
        else:
            used, placed = [False] * topo.world, []
            waves.append((used, placed))
        starts = [s for s in range(0, topo.world, size) if not any(used[s : s + size])]
        start = rng.choice(starts)
        used[start : start + size] = [True] * size
        placed.append(Group(start, size, tuple(MicroBatch(tuple(mb)) for mb in mbs)))
    rng.shuffle(waves)
    out = []
    for _, placed in waves:
        rng.shuffle(placed)
        out.append(Wave(tuple(placed)))
    plan = StepPlan(topo, tuple(lengths), tuple(out), policy="random")
    plan.validate()
    return plan


# ----------------------------------------------------------------------------- strategies


@st.composite
def batches(draw: st.DrawFn, max_size: int = 20) -> tuple[Topology, list[int]]:
    topo = draw(topologies())
    longest = topo.max_length()
    length = st.one_of(st.just(1), st.just(longest), st.integers(1, longest))
    lengths = draw(st.lists(length, min_size=1, max_size=max_size))
    return topo, lengths


def assert_below(bound: float, plan: StepPlan, model: CostModel) -> None:
    # Dataflow is never slower than barrier on the same plan: below it is below both.
    seconds = evaluate_plan(plan, model, timing="dataflow").step_seconds
    assert bound > 0
    assert bound <= seconds * (1 + REL), (bound, seconds, plan.to_json())


# ----------------------------------------------------------------------------- the bound


@settings(max_examples=60, deadline=None)
@given(case=batches(), kind=st.sampled_from(MODELS), seed=st.integers(0, 2**32 - 1))
@example(case=(Topology(8, 4, 64), [1, 512]), kind="reference", seed=0)
@example(case=(Topology(16, 8, 100), [1, 1600, 1, 1600]), kind="quadratic", seed=1)
@example(case=(Topology(12, 4, 64), [1, 256, 256, 7]), kind="reference", seed=2)
def test_bound_below_random_plans(case: tuple[Topology, list[int]], kind: str, seed: int) -> None:
    topo, lengths = case
    model = cost_model(kind, topo.ranks_per_node)
    bound = lower_bound(np.asarray(lengths), topo, model)
    rng = random.Random(seed)
    for _ in range(5):
        assert_below(bound, random_plan(lengths, topo, rng), model)


@settings(max_examples=30, deadline=None)
@given(case=batches(), kind=st.sampled_from(MODELS))
@example(case=(Topology(8, 4, 64), [1, 512]), kind="reference")
@example(case=(Topology(4, 2, 512), [2048] * 3 + [1] * 5), kind="quadratic")
def test_bound_below_every_policy(case: tuple[Topology, list[int]], kind: str) -> None:
    topo, lengths = case
    model = cost_model(kind, topo.ranks_per_node)
    bound = lower_bound(np.asarray(lengths), topo, model)
    # megatron only where the group of all ranks is allowed (known bug, see test_policies.py).
    policies = [p for p in POLICIES if p != "megatron" or topo.world in topo.group_sizes]
    for policy in policies:
        planner = Planner(
            model,
            world=topo.world,
            ranks_per_node=topo.ranks_per_node,
            capacity=topo.capacity,
            policy=policy,
            max_length=topo.max_length(),
            group_sizes=topo.group_sizes,
        )
        plan = planner.plan(lengths)
        plan.validate()
        assert plan.stats["simple_lower_bound_seconds"] == pytest.approx(bound, rel=1e-12)
        # The reported bound is the tight LP one: never below the closed form, never above a plan.
        assert plan.stats["lower_bound_seconds"] >= bound
        assert_below(bound, plan, model)
        assert_below(plan.stats["lower_bound_seconds"], plan, model)


def single_group_plans(length: int, topo: Topology) -> list[StepPlan]:
    """Every one-wave plan of a single sequence: one group at each feasible aligned position."""
    plans = []
    for cp in topo.group_sizes:
        if topo.fits([length], cp):
            for start in range(0, topo.world, cp):
                group = Group(start, cp, (MicroBatch((0,)),))
                plans.append(StepPlan(topo, (length,), (Wave((group,)),)))
    return plans


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("world,capacity", [(4, 64), (8, 100), (16, 512)])
def test_bound_is_exact_for_one_sequence(kind: str, world: int, capacity: int) -> None:
    """One sequence: the best plan is that sequence alone at its best CP size in one wave, which
    the bound must reach (a valid bound can never exceed it; a looser one is a regression)."""
    topo = Topology(world, 4, capacity)
    model = cost_model(kind, 4)
    for length in sorted({1, 2, capacity - 1, capacity, capacity + 1, topo.max_length()}):
        plans = single_group_plans(length, topo)
        assert plans
        best = min(evaluate_plan(p, model).step_seconds for p in plans)
        bound = lower_bound(np.array([length]), topo, model)
        assert bound == pytest.approx(best, rel=1e-9), length


def full_balanced_plan(topo: Topology, cp: int, per_mb: int, mbs: int) -> StepPlan | None:
    """Every group of ``cp`` ranks runs ``mbs`` micro-batches of ``per_mb`` equal sequences that
    fill the capacity exactly: the shape in which the work and micro-batch terms are tight.
    None when no such length exists (it must be a multiple of 2*cp for cp > 1)."""
    length, rest = divmod(cp * topo.capacity, per_mb)
    if rest or length < 1 or (cp > 1 and length % (2 * cp)):
        return None
    groups, i = [], 0
    for start in range(0, topo.world, cp):
        batches = []
        for _ in range(mbs):
            batches.append(MicroBatch(tuple(range(i, i + per_mb))))
            i += per_mb
        groups.append(Group(start, cp, tuple(batches)))
    plan = StepPlan(topo, (length,) * i, (Wave(tuple(groups)),))
    plan.validate()
    assert topo.memory_tokens([length] * per_mb, cp) == topo.capacity
    return plan


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("world,capacity", [(4, 64), (8, 256), (16, 512)])
def test_bound_below_full_balanced_plans(kind: str, world: int, capacity: int) -> None:
    """Perfectly balanced plans of full micro-batches, packed from 1 to 64 sequences each:
    shared per-micro-batch and per-step costs must not be charged per sequence."""
    topo = Topology(world, 4, capacity)
    model = cost_model(kind, 4)
    built = 0
    for cp in (1, 2, world):
        for per_mb in (1, 2, 8, 16, 64):
            for mbs in (1, 3):
                plan = full_balanced_plan(topo, cp, per_mb, mbs)
                if plan is None:
                    continue
                built += 1
                assert_below(lower_bound(np.asarray(plan.lengths), topo, model), plan, model)
    assert built >= 16


@settings(max_examples=30, deadline=None)
@given(case=batches(max_size=12), kind=st.sampled_from(MODELS), extra=st.integers(1, 10**9))
def test_bound_monotone_in_the_batch(
    case: tuple[Topology, list[int]], kind: str, extra: int
) -> None:
    """Adding a sequence can only make every plan slower, and the bound may not drop either."""
    topo, lengths = case
    model = cost_model(kind, topo.ranks_per_node)
    more = lengths + [1 + extra % topo.max_length()]
    assert lower_bound(np.asarray(more), topo, model) >= lower_bound(
        np.asarray(lengths), topo, model
    ) * (1 - REL)


def test_bound_with_restricted_group_sizes() -> None:
    """Group sizes other than all powers of two: the bound uses only the allowed sizes."""
    topo = Topology(16, 4, 128, group_sizes=(1, 4, 16))
    rng = random.Random(7)
    for kind in MODELS:
        model = cost_model(kind, 4)
        for _ in range(20):
            lengths = [rng.choice([1, 128, 129, 512, topo.max_length()]) for _ in range(6)]
            bound = lower_bound(np.asarray(lengths), topo, model)
            for _ in range(5):
                plan = random_plan(lengths, topo, rng)
                assert {g.size for _, g, _ in plan.microbatches()} <= {1, 4, 16}
                assert_below(bound, plan, model)


def test_empty_batch_bound_is_zero() -> None:
    model = cost_model("quadratic", 4)
    assert lower_bound(np.array([], dtype=np.int64), Topology(8, 4, 64), model) == 0.0


# ----------------------------------------------------------------------------- min_cp_sizes


@settings(max_examples=50, deadline=None)
@given(case=batches())
def test_min_cp_sizes_matches_topology(case: tuple[Topology, list[int]]) -> None:
    topo, lengths = case
    m = min_cp_sizes(np.asarray(lengths), topo)
    assert m.tolist() == [topo.min_cp(s) for s in lengths]
    for s, c in zip(lengths, m.tolist()):
        assert topo.fits([s], c)
        smaller = [g for g in topo.group_sizes if g < c]
        assert not any(topo.fits([s], g) for g in smaller)


def test_min_cp_sizes_edges() -> None:
    topo = Topology(8, 4, 64)
    # cp=1 holds exactly capacity; cp=2 holds 2*64 = 128 (a multiple of 4); cp=8 holds 512.
    lengths = np.array([1, 64, 65, 128, 129, 256, 257, 512])
    assert min_cp_sizes(lengths, topo).tolist() == [1, 1, 2, 2, 4, 4, 8, 8]
    assert topo.max_length() == 512


def test_min_cp_sizes_names_too_long_sequences() -> None:
    topo = Topology(8, 4, 64)
    lengths = np.array([5, 513, 512, 10_000])
    with pytest.raises(ValueError) as info:
        min_cp_sizes(lengths, topo)
    msg = str(info.value)
    assert "[1, 3]" in msg  # the offending ids
    assert "513" in msg and "10000" in msg  # their lengths
    assert "512" in msg  # the longest sequence the topology holds
    with pytest.raises(ValueError, match=r"\[0\]"):
        lower_bound(np.array([513]), topo, cost_model("reference", 4))
