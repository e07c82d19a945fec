"""The two timings of a plan (``dyncp.cost_model.evaluate``): barrier and dataflow.

Dataflow must never be slower than barrier on the same plan and seconds, must equal it when
every wave spans all ranks with one group, and must let a long group overlap other ranks' next
waves; both must conserve the per-rank busy time.
"""

from __future__ import annotations

import numpy as np
import pytest

from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan, time_waves
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave


def _plan(world: int, waves: list[list[tuple[int, int, list[int]]]], n: int) -> StepPlan:
    """waves: per wave, groups as (start, size, sequence ids, one micro-batch each)."""
    top = Topology(
        world=world,
        ranks_per_node=world,
        capacity=1 << 20,
        group_sizes=tuple(c for c in (1, 2, 4, 8) if c <= world),
    )
    return StepPlan(
        topology=top,
        lengths=tuple([100] * n),
        waves=tuple(
            Wave(
                groups=tuple(
                    Group(start=s, size=c, microbatches=(MicroBatch(seq_ids=tuple(ids)),))
                    for s, c, ids in wave
                )
            )
            for wave in waves
        ),
    )


def test_a_long_group_overlaps_the_next_wave_only_under_dataflow() -> None:
    # Wave 0: ranks 0-1 run seq 0 (10 s), ranks 2 and 3 run seqs 1, 2 (1 s each).
    # Wave 1: ranks 2 and 3 run seqs 3, 4 (1 s each). Barrier: 10 + 1; dataflow: 10.
    plan = _plan(4, [[(0, 2, [0]), (2, 1, [1]), (3, 1, [2])], [(2, 1, [3]), (3, 1, [4])]], 5)
    seconds = np.array([10.0, 1.0, 1.0, 1.0, 1.0])
    barrier = time_waves(plan, seconds, 0.5, timing="barrier")
    dataflow = time_waves(plan, seconds, 0.5, timing="dataflow")
    assert barrier.step_seconds == pytest.approx(10.5 + 1.5)
    assert dataflow.step_seconds == pytest.approx(10.5)
    assert dataflow.wave_seconds == pytest.approx((10.5, 0.0))
    np.testing.assert_allclose(dataflow.group_spans[1], [(1.5, 3.0), (1.5, 3.0)])
    np.testing.assert_allclose(barrier.rank_busy_seconds, dataflow.rank_busy_seconds)
    np.testing.assert_allclose(dataflow.rank_busy_seconds, [10, 10, 2, 2])


def test_a_group_waits_for_its_last_member() -> None:
    # Wave 0: rank 0 runs 3 s, rank 1 runs 1 s; wave 1: ranks 0-1 together (2 s) starts at 3.
    plan = _plan(2, [[(0, 1, [0]), (1, 1, [1])], [(0, 2, [2])]], 3)
    cost = time_waves(plan, np.array([3.0, 1.0, 2.0]), 0.0, timing="dataflow")
    assert cost.step_seconds == pytest.approx(5.0)
    np.testing.assert_allclose(cost.group_spans[1][0], (3.0, 5.0))


def test_dataflow_is_never_slower_and_equal_on_full_width_waves() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        world = 8
        waves, n = [], 0
        for _ in range(int(rng.integers(1, 5))):
            groups, r = [], 0
            while r < world:
                size = int(rng.choice([c for c in (1, 2, 4, 8) if r % c == 0 and r + c <= world]))
                if rng.random() < 0.8:
                    groups.append((r, size, [n]))
                    n += 1
                r += size
            if groups:
                waves.append(groups)
        if not waves:
            continue
        plan = _plan(world, waves, n)
        seconds = rng.exponential(1.0, n)
        over = float(rng.uniform(0, 0.1))
        b = time_waves(plan, seconds, over, timing="barrier")
        d = time_waves(plan, seconds, over, timing="dataflow")
        assert d.step_seconds <= b.step_seconds * (1 + 1e-12)
        assert sum(d.wave_seconds) == pytest.approx(d.step_seconds)
        assert sum(b.wave_seconds) == pytest.approx(b.step_seconds)
    full = _plan(4, [[(0, 4, [0])], [(0, 4, [1])], [(0, 4, [2])]], 3)
    s = np.array([1.0, 2.0, 3.0])
    assert time_waves(full, s, 0.1, timing="dataflow").step_seconds == pytest.approx(
        time_waves(full, s, 0.1, timing="barrier").step_seconds
    )


def test_unknown_timing_is_refused_with_the_allowed_values() -> None:
    plan = _plan(2, [[(0, 2, [0])]], 1)
    with pytest.raises(ValueError, match="barrier, dataflow"):
        time_waves(plan, np.array([1.0]), 0.0, timing="async")
    assert TIMINGS == ("barrier", "dataflow")


def test_evaluate_plan_prices_both_timings_from_the_same_seconds() -> None:
    from dyncp.cost_model import CostModel, load_profile

    model = CostModel(load_profile("h100-reference"), ranks_per_node=4)
    plan = _plan(4, [[(0, 2, [0]), (2, 1, [1]), (3, 1, [2])], [(2, 1, [3]), (3, 1, [4])]], 5)
    b = evaluate_plan(plan, model, timing="barrier")
    d = evaluate_plan(plan, model, timing="dataflow")
    assert b.microbatch_seconds == d.microbatch_seconds
    assert d.step_seconds <= b.step_seconds
    assert b.timing == "barrier" and d.timing == "dataflow"
