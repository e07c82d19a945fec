"""Megatron's first dynamic-CP scheduler: minimum CP sizes, equal-work buckets, group doubling."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import assert_exactly_once

from dyncp.plan import Topology
from dyncp.planner.baselines.megatron_min_cp import megatron_min_cp_plan


def _groups(plan):
    return [sorted((g.size, g.microbatches[0].seq_ids) for g in w.groups) for w in plan.waves]


def test_every_sequence_runs_at_its_minimum_cp_size() -> None:
    # min CP 4, 2, 1, 1, 1; buckets [8000], [3000, 1500, 1000], [500]: new groups on free ranks
    # while they last, then 500 joins the least-loaded CP-1 group with room (the 1000 one).
    plan = megatron_min_cp_plan(np.array([8000, 3000, 1500, 1000, 500]), Topology(8, 4, 2048))
    plan.validate()
    assert plan.policy == "megatron-min-cp"
    assert _groups(plan) == [[(1, (2,)), (1, (3, 4)), (2, (1,)), (4, (0,))]]


def test_idle_ranks_are_filled_by_doubling_the_first_smallest_group() -> None:
    plan = megatron_min_cp_plan(np.array([1000, 900]), Topology(8, 4, 2048))
    plan.validate()
    assert _groups(plan) == [[(4, (0,)), (4, (1,))]]


def test_a_full_size_leaves_the_rest_for_the_next_wave() -> None:
    # Eight 2000-token sequences fill the 4 CP-1 ranks' memory one each; four wait.
    plan = megatron_min_cp_plan(np.full(8, 2000), Topology(4, 4, 2048))
    plan.validate()
    assert [len(w.groups) for w in plan.waves] == [4, 4]
    assert all(g.size == 1 for w in plan.waves for g in w.groups)


@pytest.mark.parametrize("world", [4, 8, 16, 64])
def test_plans_are_valid_on_the_megatron_example_lengths(world: int) -> None:
    rng = np.random.RandomState(0)
    lengths = np.clip(rng.lognormal(np.log(1024) - 1.125, 1.5, 20 * world), 128, 8192).astype(int)
    topo = Topology(world, 4, 2048)
    for step in range(10):
        batch = lengths[step * 2 * world : (step + 1) * 2 * world]
        plan = megatron_min_cp_plan(batch, topo)
        plan.validate()
        assert_exactly_once(plan, len(batch))
        assert all(sum(g.size for g in w.groups) == world for w in plan.waves)
