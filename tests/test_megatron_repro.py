"""bench/megatron_repro.py: Megatron's mock lengths and padding, and plans for every policy."""

from __future__ import annotations

import numpy as np
from bench_modules import load_bench

from dyncp.cost_model.model import CostModel

repro = load_bench("megatron_repro")


def test_mock_lengths_follow_megatrons_generator() -> None:
    lengths = repro.mock_lengths(100_000)
    assert lengths.min() == 128 and lengths.max() == 8192
    # Unclipped, exp(mu + sigma^2 / 2) = 1024; the clip at 128 and 8192 lowers it to ~906.
    assert 880 < lengths.mean() < 930
    again = np.clip(np.random.RandomState(0).lognormal(np.log(1024) - 1.125, 1.5, 5), 128, 8192)
    assert lengths[:5].tolist() == again.astype(int).tolist()
    assert repro.dcp_padded(np.array([1, 16, 17]), 8).tolist() == [16, 16, 32]


def test_every_policy_plans_every_sequence_once() -> None:
    model = CostModel.load("h100-megatron-dcp-gpt", ranks_per_node=4)
    plans = repro.step_plans(8, 3, model)
    assert set(plans) == {"dp-balanced", "megatron", "min-cp", "dyncp"}
    for steps in plans.values():
        assert len(steps) == 3
        for plan in steps:
            plan.validate()
            assert len(plan.lengths) == 16
    # The baseline runs fixed CP-4 groups, one per data-parallel rank.
    assert {g.size for p in plans["dp-balanced"] for w in p.waves for g in w.groups} == {4}
    assert repro.trimmed_seconds(plans["dp-balanced"], model) > 0
