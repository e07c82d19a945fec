"""Following a machine that changes, under the adversarial noise (lognormal sigma 0.3, 20%
stragglers at 2-10x): the level moves fast, the coefficients slowly, and noise alone moves
nothing. Seeded, deterministic, no wall clock (bench/calibration_bench.py --drift has the
figures over 12 runs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bench_modules import load_bench

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.calibration.level import (
    biweight_location,
    biweight_shift,
    regime_level,
    scaled_profile,
)
from dyncp.cost_model.calibration.measurements import CalibrationError, Measurement
from dyncp.cost_model.calibration.online import OnlineCalibrator
from dyncp.cost_model.schema import bundled_profiles

cb = load_bench("calibration_bench")
GLOO = cb.SETTINGS["cpu-gloo"]
H100 = cb.SETTINGS["h100-reference"]


@pytest.mark.parametrize("name", sorted(bundled_profiles()))
def test_a_scaled_profile_prices_every_micro_batch_by_exactly_the_factor(name):
    """The level-only version is exact for every shipped profile (rings, all-to-all, head
    splits, layer mixes): the check raises where a time coefficient is not scaled."""
    base = load_profile(name)
    rng = np.random.default_rng(0)
    groups = [(1, 1), (2, 1), (4, 1), (8, 1)]
    base_model = CostModel(base, 8)
    ms = []
    for cp, heads in groups:
        lengths = tuple(int(x) for x in rng.integers(64, 4096, 3))
        try:
            t = base_model.microbatch_seconds(cp, lengths, heads=heads)
        except ValueError:
            continue
        ms.append(Measurement(cp, lengths, t, heads))
    assert ms
    scaled = scaled_profile(base, 1.37, ranks_per_node=8, check=ms)
    model = CostModel(scaled, 8)
    for m in ms:
        assert model.microbatch_seconds(m.cp, m.lengths, heads=m.heads) == pytest.approx(
            1.37 * m.seconds, rel=1e-9
        )
    assert scaled.overheads.wave_seconds == base.overheads.wave_seconds
    with pytest.raises(CalibrationError, match="finite and > 0"):
        scaled_profile(base, 0.0, ranks_per_node=8)


def _noisy(rng: np.random.Generator, n: int) -> np.ndarray:
    x = 0.3 * rng.standard_normal(n)
    slow = rng.random(n) < 0.2
    x[slow] += np.log(rng.uniform(2.0, 10.0, slow.sum()))
    return x


def test_the_level_estimate_is_unbiased_under_stragglers_and_near_the_mean_bound():
    """400 simulated changes of log 1.4 seen through 64 new measurements: the estimate's mean
    is within 0.01 of the truth (a median or a mean would carry the stragglers' pull; the
    difference cancels it) and its spread within 25% of the bound of a mean over the clean
    measurements (0.3 / sqrt(0.8 x 64) = 0.042)."""
    rng = np.random.default_rng(7)
    est = []
    for _ in range(400):
        old, new = _noisy(rng, 600), _noisy(rng, 64) + math.log(1.4)
        est.append(regime_level(new, rng.integers(0, 3, 64), old, rng.integers(0, 3, 600))[0])
    est = np.array(est)
    assert abs(est.mean() - math.log(1.4)) < 0.01
    assert est.std() < 1.25 * 0.3 / math.sqrt(0.8 * 64)
    assert biweight_location(np.array([0.0, 0.1, -0.1, 5.0]), 0.1) == pytest.approx(0, abs=0.01)


def test_the_change_test_statistic_is_calibrated_and_sees_1_4x_in_two_steps():
    """Simulated: without a shift, |shift| / error stays under 4 in all 400 draws of 32 new
    against 600 old measurements and its standard deviation is about 1 (the error is honest);
    a 1.4x shift passes 4 errors in three draws of four or more (80% here; a test on medians
    needs a shift of about 0.35 in two steps, above log 1.4 = 0.34: it passes in 39%)."""
    rng = np.random.default_rng(11)
    null, seen = [], 0
    for _ in range(400):
        old = _noisy(rng, 600)
        shift, error = biweight_shift(_noisy(rng, 32), old)
        null.append(shift / error)
        shift, error = biweight_shift(_noisy(rng, 32) + math.log(1.4), old)
        seen += shift > 4 * error
    null = np.array(null)
    assert np.abs(null).max() < 4 and 0.8 < null.std() < 1.25
    assert seen >= 300


def test_a_step_change_under_heavy_noise_is_followed_within_eight_steps():
    """1.4x at step 32 under sigma 0.3 and 20% stragglers (seeded case: h100-reference, seed
    1): the change is detected with its change point at the step it began, a level-only
    version follows it at once, and the model is back within 5% in <= 8 steps and stays
    there. The previous behaviour (follow="regimes") on the same measurements takes longer.
    Not every seed meets it: see docs/cost-model/calibration.md."""
    level = cb.run_drift(H100, 1, sigma=0.3, stragglers=0.2)
    regimes = cb.run_drift(H100, 1, sigma=0.3, stragglers=0.2, follow="regimes")
    assert level["changes"] == 1 and level["change_points"] == [0]
    back = level["back_within_5pct_after_steps"]
    assert back is not None and back <= 8, level
    assert (regimes["back_within_5pct_after_steps"] or 99) > back, regimes


def test_noise_alone_triggers_no_following():
    """No drift, sigma 0.3 and 20% stragglers, 2 runs of 40 steps: no change is detected and
    no level-only version adopted (the bench reports the rate: 0 in 672 steps over 12 runs)."""
    for s, seed in ((GLOO, 3), (H100, 5)):
        rng = np.random.default_rng(seed)
        truth = CostModel(cb.perturbed_truth(s, rng), s.ranks_per_node)
        cal = OnlineCalibrator(load_profile(s.profile), ranks_per_node=s.ranks_per_node)
        for _ in range(40):
            cal.observe(cb.measure_step(rng, s, truth))
        assert cal.changes == 0 and cal.level_versions == 0, (s.profile, seed)


def test_follow_must_be_known():
    with pytest.raises(ValueError, match="follow"):
        OnlineCalibrator(load_profile("cpu-gloo"), ranks_per_node=4, follow="fast")


def test_the_latest_change_point_moves_but_not_before_the_one_before_it():
    from dyncp.cost_model.calibration.measurements import MeasurementBuffer

    buf = MeasurementBuffer()
    with pytest.raises(ValueError, match="no latest change point"):
        buf.move_change(3)
    buf.mark_change(5)
    buf.mark_change(9)
    buf.move_change(7)
    assert buf.change_points == (5, 7)
    with pytest.raises(ValueError, match="can move to step 5"):
        buf.move_change(5)
