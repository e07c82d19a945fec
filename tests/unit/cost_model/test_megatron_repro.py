"""bench/megatron_repro.py: Megatron's mock lengths and padding, and plans for every policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bench_modules import load_bench

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.reference import build_reference_profile
from dyncp.cost_model.schema import load_profile
from dyncp.cost_model.shapes import SHAPES

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
    plans = repro.step_plans(8, 3, model, first=10)
    assert set(plans) == {"dp-balanced", "megatron", "min-cp", "dyncp"}
    for steps in plans.values():
        assert len(steps) == 3
        for plan in steps:
            plan.validate()
            assert len(plan.lengths) == 16
    # The baseline runs fixed CP-4 groups, one per data-parallel rank.
    assert {g.size for p in plans["dp-balanced"] for w in p.waves for g in w.groups} == {4}
    assert repro.trimmed_seconds(plans["dp-balanced"], model) > 0
    # Dataflow timing is never slower than the barrier one.
    for p in plans["min-cp"]:
        dataflow = repro.trimmed_seconds([p, p], model, "dataflow")
        assert dataflow <= repro.trimmed_seconds([p, p], model, "barrier") * (1 + 1e-12)


def test_batches_are_the_published_window_in_rank_major_order() -> None:
    """Global batch k of a fresh run holds samples k*B .. (k+1)*B - 1; DP rank d's i-th
    micro-batch is sample i*dp + d; the scheduler sees rank 0's samples first."""
    batch = np.arange(16)  # 8 micro-batches x dp 2
    assert repro.rank_major(batch, 2).tolist() == [0, 2, 4, 6, 8, 10, 12, 14,
                                                   1, 3, 5, 7, 9, 11, 13, 15]  # fmt: skip
    assert repro.rank_major(batch, 1).tolist() == batch.tolist()
    lengths = repro.mock_lengths(30 * 16)
    window = repro.global_batches(8, 10, 20)
    assert len(window) == 20
    for k, b in enumerate(window, start=10):
        assert sorted(b.tolist()) == sorted(lengths[k * 16 : (k + 1) * 16].tolist())
        assert b.tolist() == repro.rank_major(lengths[k * 16 : (k + 1) * 16], 2).tolist()


SRC = Path("/work/shared/reference/h100-distca")


@pytest.mark.skipif(not SRC.is_dir(), reason=f"{SRC} not available")
def test_plain_form_is_the_profile_before_the_kernel_aware_one() -> None:
    """The bench's 'plain' column prices as the builder's plain profile (constant per call)."""
    plain = CostModel(repro.plain_form(load_profile("h100-megatron-dcp-gpt")), 4)
    built = CostModel(build_reference_profile(SRC, shape=SHAPES["megatron-dcp-gpt"]), 4)
    for cp, lengths in ((1, [128, 3000]), (4, [128] * 8), (8, [512, 700, 8192])):
        assert plain.microbatch_seconds(cp, lengths) == pytest.approx(
            built.microbatch_seconds(cp, lengths), rel=1e-12
        )
