"""Megatron's dp_balanced packing: arrival-order packs, a multiple of DP, round robin."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import assert_exactly_once

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.baselines.dp_balanced import dp_balanced_packs, dp_balanced_plan
from dyncp.planner.planner import POLICIES, Planner
from dyncp.sim.__main__ import main as sim_main


def test_packs_in_arrival_order_with_next_fit() -> None:
    # limit 4 x 2048 = 8192 padded tokens (multiples of 8): 5000+3000 fits, 200+8000 does not,
    # 8000+104 does, 8104+104 does not.
    lengths = np.array([5000, 3000, 200, 8000, 100, 100])
    packs = dp_balanced_packs(lengths, cp=4, dp=2, capacity=2048)
    assert packs == [[0, 1], [2], [3, 4], [5]]
    plan = dp_balanced_plan(lengths, Topology(8, 4, 2048), 4)
    plan.validate()
    assert plan.policy == "dp-balanced" and len(plan.waves) == 1
    (wave,) = plan.waves
    # Round robin: DP rank d runs packs d, d + dp, ...; each group is 4 consecutive ranks.
    assert [(g.start, g.size) for g in wave.groups] == [(0, 4), (4, 4)]
    assert [[mb.seq_ids for mb in g.microbatches] for g in wave.groups] == [
        [(0, 1), (3, 4)],
        [(2,), (5,)],
    ]


def test_pack_count_becomes_a_multiple_of_dp_like_megatron() -> None:
    """The last sequence of the latest multi-sequence pack moves out, as often as needed."""
    assert dp_balanced_packs(np.array([100] * 5), cp=4, dp=2, capacity=2048) == [
        [0, 1, 2, 3],
        [4],
    ]
    assert dp_balanced_packs(np.array([100] * 3), cp=2, dp=3, capacity=2048) == [[0], [2], [1]]
    # Single-sequence packs are skipped: the move comes from the latest pack holding two.
    packs = dp_balanced_packs(np.array([8000, 100, 8000, 100, 8000]), cp=4, dp=4, capacity=2048)
    assert packs == [[0, 1], [2], [4], [3]]


def test_max_sequences_gives_a_fixed_number_of_microbatches() -> None:
    lengths = np.full(16, 300)
    plan = dp_balanced_plan(lengths, Topology(8, 4, 2048), 4, max_sequences=1)
    plan.validate()
    assert [len(g.microbatches) for g in plan.waves[0].groups] == [8, 8]
    assert all(len(mb.seq_ids) == 1 for _, _, mb in plan.microbatches())
    with pytest.raises(ValueError, match="max_sequences"):
        dp_balanced_packs(lengths, cp=4, dp=2, capacity=2048, max_sequences=0)


def test_too_long_and_too_few_sequences() -> None:
    with pytest.raises(ValueError, match="exceeds a CP-2 pack of 4096 tokens"):
        dp_balanced_packs(np.array([5000]), cp=2, dp=1, capacity=2048)
    # Fewer sequences than DP ranks: Megatron stops; here the remaining ranks stay idle.
    plan = dp_balanced_plan(np.array([10, 20]), Topology(16, 4, 2048), 4)
    plan.validate()
    assert_exactly_once(plan, 2)
    assert len(plan.waves[0].groups) == 2


def test_planner_and_simulator_know_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert "dp-balanced" in POLICIES
    model = CostModel.load("h100-megatron-dcp-gpt", ranks_per_node=4)
    planner = Planner(
        model, world=8, ranks_per_node=4, capacity=2048, policy="dp-balanced", max_length=8192
    )
    assert planner.static_cp == 4
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1024) - 1.125, 1.5, 16), 128, 8192).astype(int)
    plan = planner.plan(lengths)
    assert_exactly_once(plan, 16)
    assert plan.stats["predicted_step_seconds"] > 0
    with pytest.raises(ValueError, match="'dp-balanced' needs max_length"):
        Planner(model, world=8, ranks_per_node=4, capacity=2048, policy="dp-balanced")
    args = ["--world", "8", "--ranks-per-node", "4", "--capacity", "2048", "--max-length", "8192"]
    args += ["--global-batch-size", "16", "--steps", "2", "--profile", "h100-megatron-dcp-gpt"]
    assert sim_main([*args, "--policies", "dp-balanced,megatron"]) == 0
    assert "dp-balanced" in capsys.readouterr().out
