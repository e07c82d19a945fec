"""Calibrating the pipelined pricing: measured steps priced by a known machine (a profile 3x
cpu-gloo, a known hand-off link) refit a profile 20x too fast into one that prices held-out
plans as that machine does; the transfer fit recovers the link; too little data is refused."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import pipelined_plans

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.calibration import CalibrationError, Measurement
from dyncp.cost_model.calibration.level import scaled_profile
from dyncp.cost_model.calibration.pipeline import (
    HopMeasurement,
    PipelineStepMeasurement,
    calibrate_pipeline,
    fit_p2p,
    predict_step,
)
from dyncp.cost_model.pipeline_timing import stage_costs
from dyncp.plan import StepPlan

LINK = (8e-5, 2e8)  # the machine's hand-off: latency, bandwidth
BYTES = 256.0  # hidden 64 x fp32


def _plans(truth: CostModel, n: int, seed: int) -> list[StepPlan]:
    return pipelined_plans(truth, n=n, seed=seed, size=24, capacity=512, max_length=1024)


def _measured(plan: StepPlan, truth: CostModel) -> PipelineStepMeasurement:
    """What the runtime would measure on the machine ``truth`` describes (noise-free)."""
    costs = stage_costs(plan, truth, p2p=(LINK, LINK))
    cost = predict_step(plan, truth, (LINK, LINK))
    ms, hops = [], []
    for j, wave in enumerate(plan.waves):
        for g in wave.groups:
            lengths = tuple(plan.lengths[i] for i in g.microbatches[0].seq_ids)
            total = costs.forward[j, g.start].sum() + costs.backward[j, g.start].sum()
            ms.append(Measurement(g.size, lengths, float(total), g.heads))
            size = plan.topology.memory_tokens(lengths, g.size) * BYTES
            hops.append(HopMeasurement(size, LINK[0] + size / LINK[1]))
    return PipelineStepMeasurement(
        forward=costs.forward,
        backward=costs.backward,
        busy=cost.stage_busy_seconds,
        step_seconds=cost.step_seconds,
        microbatches=tuple(ms),
        hops=tuple(hops),
    )


def test_a_profile_20x_too_fast_is_refit_to_the_machine_on_held_out_plans() -> None:
    base = load_profile("cpu-gloo")
    truth = CostModel(scaled_profile(base, 3.0, ranks_per_node=2), 2)
    wrong = scaled_profile(base, 0.05, ranks_per_node=2)
    # enough varied micro-batches (about 120) for a noise-free refit from 20x off to be exact
    seen = [_measured(p, truth) for p in _plans(truth, 12, seed=0)]
    cal = calibrate_pipeline(wrong, seen, model_stages=2, ranks_per_node=2)
    assert cal.p2p[0] == pytest.approx(LINK, rel=1e-3)
    fitted = CostModel(cal.profile, 2)
    for plan in _plans(truth, 4, seed=1):
        true = predict_step(plan, truth, (LINK, LINK))
        before = predict_step(plan, CostModel(wrong, 2), (LINK, LINK))
        after = predict_step(plan, fitted, cal.p2p)
        assert before.step_seconds / true.step_seconds < 0.1
        assert after.step_seconds == pytest.approx(true.step_seconds, rel=0.01)
        assert after.bubble_fraction == pytest.approx(true.bubble_fraction, abs=0.01)


def test_the_transfer_fit_recovers_a_link_and_shrugs_off_a_straggler() -> None:
    sizes = np.linspace(1e4, 4e5, 12)
    hops = [HopMeasurement(float(b), LINK[0] + b / LINK[1]) for b in sizes]
    hops[3] = HopMeasurement(hops[3].bytes, 20 * hops[3].seconds)  # a descheduled receiver
    latency, bandwidth = fit_p2p(hops)
    assert latency == pytest.approx(LINK[0], rel=0.02)
    assert bandwidth == pytest.approx(LINK[1], rel=0.02)


def test_too_little_data_is_refused_by_name() -> None:
    with pytest.raises(CalibrationError, match="2 waited-for hand-offs measured; at least 4"):
        fit_p2p([HopMeasurement(1e4, 1e-4)] * 2)
    with pytest.raises(CalibrationError, match="model_stages must be an integer >= 1"):
        calibrate_pipeline(load_profile("cpu-gloo"), [], model_stages=0, ranks_per_node=2)
