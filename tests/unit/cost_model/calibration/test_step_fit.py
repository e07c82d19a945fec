"""StepFit: the per-step part outside micro-batches, fitted from measured steps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dyncp.cost_model.calibration.level import scaled_profile
from dyncp.cost_model.calibration.measurements import Measurement
from dyncp.cost_model.calibration.step_fit import StepFit, with_fixed_seconds, with_parameters
from dyncp.cost_model.schema import Profile, load_profile
from dyncp.cost_model.step_parts import common_parts

PARTS = {"synchronisation": 0.01, "gradient_reduction": 0.05, "optimizer": 0.02}


def measured(rng: np.random.Generator, fixed: float, n: int, sigma: float = 0.05):
    """Steps whose busy time varies and whose outside time is the predicted parts + ``fixed``,
    both with multiplicative noise."""
    for _ in range(n):
        busy = float(rng.uniform(0.1, 0.4))
        outside = (sum(PARTS.values()) + fixed) * math.exp(rng.normal(0.0, sigma))
        yield busy + outside, busy


def test_fits_the_unexplained_fixed_part_within_10_steps() -> None:
    """A profile that prices no fixed part learns it: after 9 steps with 0.3 s unexplained, the
    adopted fixed part is within 10% of it and the predicted wall clocks within 5%."""
    rng = np.random.default_rng(0)
    fit = StepFit(load_profile("cpu-gloo"))
    for wall, busy in measured(rng, 0.3, 9):
        fit.observe(wall, busy, PARTS)
    assert fit.adoptions >= 1
    assert fit.fixed == pytest.approx(0.3, rel=0.1)
    assert fit.profile.schema_version == 2 and fit.profile.step.fixed_seconds == fit.fixed
    errors = [
        abs(busy + sum(PARTS.values()) + fit.fixed - wall) / wall
        for wall, busy in measured(rng, 0.3, 20)
    ]
    assert max(errors) < 0.15 and float(np.median(errors)) < 0.05


def test_a_straggler_moves_the_median_not_the_fit() -> None:
    rng = np.random.default_rng(1)
    fit = StepFit(load_profile("cpu-gloo"), refit_every=12, window=12)
    steps = list(measured(rng, 0.2, 12, sigma=0.01))
    steps[3] = (steps[3][0] + 50.0, steps[3][1])  # one step stalls for 50 s
    for wall, busy in steps:
        fit.observe(wall, busy, PARTS)
    assert fit.fixed == pytest.approx(0.2, rel=0.1)


def test_an_accurate_profile_is_left_alone() -> None:
    rng = np.random.default_rng(2)
    profile = with_fixed_seconds(load_profile("cpu-gloo"), 0.25)
    fit = StepFit(profile, min_change=0.1)
    for wall, busy in measured(rng, 0.25, 24, sigma=0.02):
        assert fit.observe(wall, busy, PARTS) is None
    assert fit.adoptions == 0 and fit.profile is profile


def test_bad_steps_are_refused_alone() -> None:
    fit = StepFit(load_profile("cpu-gloo"))
    for wall, busy, parts in (
        (float("nan"), 0.1, PARTS),
        (0.1, 0.5, PARTS),  # busy longer than the step
        (-1.0, 0.1, PARTS),
        (1.0, 0.1, {"synchronisation": 0.0}),  # parts missing
        (1.0, 0.1, {**PARTS, "optimizer": "x"}),
    ):
        assert fit.observe(wall, busy, parts) is None
    assert fit.refused == 5 and fit.fixed == 0.0


def test_bad_settings_name_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="StepFit needs window >= 3"):
        StepFit(load_profile("cpu-gloo"), window=2)
    with pytest.raises(ValueError, match="fixed seconds must be finite and >= 0"):
        with_fixed_seconds(load_profile("cpu-gloo"), -1.0)


def test_the_fitted_fixed_part_replaces_the_profiles() -> None:
    """A profile that prices a fixed part already: the prediction counts it once, the fitted
    value in place of the profile's (added on top, a 0.25 s profile would predict 0.25 s long)."""
    profile = with_fixed_seconds(load_profile("cpu-gloo"), 0.25)
    fit = StepFit(profile)
    parts = {**PARTS, "fixed": 0.25, "planned": 0.3}
    parts["total"] = parts["planned"] + sum(PARTS.values()) - PARTS["synchronisation"] + 0.25
    assert fit.fixed == 0.25
    assert fit.predict(parts) == pytest.approx(parts["total"], rel=1e-12)
    rng = np.random.default_rng(3)
    for wall, busy in measured(rng, 0.1, 12, sigma=0.01):
        fit.observe(wall, busy, PARTS)
    assert fit.fixed == pytest.approx(0.1, rel=0.1)
    assert fit.predict(parts) == pytest.approx(parts["total"] - 0.25 + fit.fixed, rel=1e-12)


def test_the_trained_models_parameters_price_its_reduction_and_optimizer() -> None:
    """A profile measured on one model prices another's step by its parameter count: the
    optimizer and the all-reduce scale with it, the seconds per parameter stay the profile's."""
    base = load_profile("cpu-gloo")
    bigger = with_parameters(base, 10 * base.step.parameters)
    assert bigger.step.optimizer_seconds_per_parameter == base.step.optimizer_seconds_per_parameter
    a = common_parts(base, world=2, ranks_per_node=2)
    b = common_parts(bigger, world=2, ranks_per_node=2)
    assert b[1] == pytest.approx(10 * a[1], rel=1e-12)
    assert b[0] > a[0]
    data = json.loads(base.to_json())
    data["schema_version"] = 1
    del data["step"]
    with pytest.raises(ValueError, match="has no step section"):
        with_parameters(Profile.model_validate(data), 1000)
    with pytest.raises(ValueError, match="parameters must be >= 0, got -1"):
        with_parameters(base, -1)


def test_a_micro_batch_level_leaves_the_steps_outside_part_alone() -> None:
    """The level calibration scales micro-batch times: the step's per-token embedding and head
    (inside every micro-batch) scale with it, the optimizer and the fixed part (outside them,
    StepFit's) do not, so a 3x slower micro-batch regime does not triple AdamW."""
    base = with_fixed_seconds(load_profile("cpu-gloo"), 0.01)
    data = json.loads(base.to_json())
    data["step"]["embedding_seconds_per_token"] = 1e-7
    base = Profile.model_validate(data)
    checks = [Measurement(1, (300, 700), 0.01), Measurement(2, (1500,), 0.02)]
    scaled = scaled_profile(base, 3.0, ranks_per_node=2, check=checks)
    assert scaled.step.embedding_seconds_per_token == pytest.approx(3e-7, rel=1e-12)
    assert scaled.step.optimizer_seconds_per_parameter == base.step.optimizer_seconds_per_parameter
    assert scaled.step.fixed_seconds == base.step.fixed_seconds
    assert common_parts(scaled, world=2, ranks_per_node=2)[1:] == pytest.approx(
        common_parts(base, world=2, ranks_per_node=2)[1:], rel=1e-12
    )
