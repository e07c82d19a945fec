"""Refit a profile's coefficients to measured micro-batches: the cost model corrects itself.

A profile is a property of one machine at one time; the runtime measures every micro-batch it
runs. :func:`fit_profile` turns those measurements into a new :class:`Profile` whose predictions
match them, keeping the profile's *form* (attention table shape, padding, communication kind) and
refitting its *coefficients*:

=============================  ===========================================================
``lin``                        ``linear_seconds_per_token``
``att``                        scale of the attention table (or of ``alpha``/``beta``)
``seq``                        ``attention.sequence_overhead_seconds`` (per sequence per step)
``step``                       ``attention.step_overhead_seconds`` (per ring step)
``mb``                         ``overheads.microbatch_seconds``
``latency_c``                  one transfer's latency in a group of c ranks, per measured c
``inverse_bandwidth_c``        1 / its bandwidth (``communication.links``, by group size)
``exchange_latency_u``         a head split's all-to-all over u ranks, per measured u
``exchange_inverse_bandwidth_u``  1 / its bandwidth (``communication.all_to_all_links``)
``head_scale_u``               attention of 1/u of the heads costs this x A / u
                               (``attention.head_scales``: measured, not assumed 1)
``wave``                       ``overheads.wave_seconds`` (trimmed mean over the wave timings)
``ring``                       ``attention.ring_sequence_step_seconds`` (per sequence per ring
                               step at CP > 1; told from ``seq`` by CP-1 measurements).
                               Fitted for kernel-aware profiles (``attention.tiles`` set, or
                               the term already non-zero); kept as profiled otherwise, so
                               the fits of other profiles are what they were
=============================  ===========================================================

The prediction is the one of :class:`CostModel` written in these coefficients, vectorised over
the measurements (features precomputed once: ``features``; the coefficient layout:
``coefficients``), rings and head splits (``Measurement.heads``) alike, so a fit of a few
hundred measurements takes a tenth of a second and predicts exactly what
``CostModel(fit.profile)`` predicts. Layer-mix profiles (windows, SSM layers) are fitted
with the exact model instead, plus ``ssm`` (``layer_mix.ssm_seconds_per_token``):
``dyncp.cost_model.calibration.mix``.

Why it is unbiased and cannot be dragged far by bad measurements:

- residuals are ``log(predicted / measured)``: run times carry multiplicative noise (a pause
  scales a run), under which a relative residual ``predicted / measured - 1`` is biased (its
  mean is not zero at the true model) and the log residual is not; a long micro-batch weighs no
  more than a short one;
- pass 1 is a median fit (soft-L1 loss with ``f_scale`` 5%: almost L1), robust to any share of
  stragglers below one half;
- passes 2 and 3 drop measurements further than 3 robust spreads (1.4826 x MAD, at least 5%)
  from the median residual and refit the rest with a Cauchy loss at that spread, so a
  straggler just inside the cut pulls little;
- the solver works in each coefficient's natural magnitude (the value at which its term alone
  explains the median measurement), never in the profile's value: a coefficient profiled at 0
  or at 1e-17 s moves as freely as any other;
- every coefficient has a weak prior row pulling it to the profile's value, so a coefficient the
  measurements say nothing about (no CP-4 micro-batch seen yet: no intra-node ring latency to
  learn) keeps its profiled value instead of wandering;
- coefficients are bounded at >= 0 (bandwidths finite) and every result is checked finite
  before a Profile is built;
- measurements from before a detected change of the machine (``regimes`` > 0) keep informing
  the shape of the model, with a free level of their own and half the weight.

One assumption of the form is settled by the data too: whether a ring step's transfer overlaps
its compute (``communication.overlap``). Where rings were measured, both rules are fitted and the
one with the smaller median |log error| is kept (a CPU ring on gloo, where transfers take the
same cores as compute, need not overlap as a GPU ring does).

The fit is deterministic: same profile, same measurements in the same order, same result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import date

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import trim_mean

from dyncp.cost_model.calibration.coefficients import (
    MAX_BANDWIDTH,
    apply_coefficients,
    named_coefficients,
    profile_coefficients,
)
from dyncp.cost_model.calibration.features import (
    OLD_REGIME_WEIGHT,
    DenseFeatures,
    dense_features,
    natural_scales,
    predict,
)
from dyncp.cost_model.calibration.measurements import (
    CalibrationError,
    Measurement,
    MeasurementBuffer,
    WaveMeasurement,
)
from dyncp.cost_model.calibration.mix import (
    MixFeatures,
    mix_coefficients,
    mix_profile,
    mix_scales,
)
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile

__all__ = [
    "CalibrationError",
    "CalibrationResult",
    "Measurement",
    "MeasurementBuffer",
    "WaveMeasurement",
    "fit_profile",
    "prediction_errors",
]

#: Relative residual at which the robust losses start to discount a measurement.
F_SCALE = 0.05
#: Weight of each coefficient's prior row: a 100% change of a coefficient costs as much as one
#: measurement 5% off, so data decide wherever they say anything.
PRIOR_WEIGHT = 0.05


# ---------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Holdout:
    """Two models judged on the same held-out measurements (:func:`holdout_error`)."""

    before: float  # root mean square log(predicted / measured), model before the refit
    after: float  # the same for the refitted model
    gain_error: float  # standard error of the mean of the per-measurement gains
    gain: float  # mean of (loss before - loss after), Cauchy loss at the fit's noise spread
    change: float  # root mean square of log(after / before) predictions: how much moved
    measurements: int  # held-out measurements both were judged on


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """A fitted profile and how well the old and the new one predict the measurements.

    ``error_*`` are mean |predicted / measured - 1| over the inlier micro-batches of the current
    regime, in-sample (outliers are what the fit refused to learn from, so they are not what the
    model should be judged on). ``holdout``: the same models judged on measurements the fit never
    saw (:func:`holdout_error`; None when no hold-out set was given): what adoption uses.
    """

    profile: Profile
    coefficients_before: dict[str, float]
    coefficients_after: dict[str, float]
    error_before: float
    error_after: float
    measurements: int
    outliers: int
    by_cp: dict[int, int] = field(default_factory=dict)
    wave_measurements: int = 0
    overlap: bool = True  # the overlap rule the fit kept
    holdout: Holdout | None = None
    noise: float = 0.0  # robust spread of the fit's log residuals (1.4826 x MAD)


def prediction_errors(model: CostModel, ms: Sequence[Measurement]) -> np.ndarray:
    """Relative errors ``predicted / measured - 1`` of ``model`` on ``ms``."""
    return np.array(
        [model.microbatch_seconds(m.cp, m.lengths, heads=m.heads) / m.seconds - 1.0 for m in ms]
    )


def holdout_error(
    before: CostModel, after: CostModel, ms: Sequence[Measurement], *, spread: float | None = None
) -> Holdout:
    """Two models judged on the same held-out measurements: the root mean square of
    log(predicted / measured) over the measurements that neither model calls an outlier
    (further than 3 robust spreads, at least 3 x 5%, from its median residual). ``spread``:
    the noise the fit measured on its (many more) training measurements; default: each
    model's spread on ``ms``.

    Logs, because noise on run times is multiplicative (a model that predicts the median run
    scores best); squares, because they rank two models by their bias as well as their spread
    (a mean absolute error barely moves with a small bias under heavy noise); outliers out,
    because stragglers are one-sided: kept in, even clipped, they reward a model that predicts
    too slow. Which model is better (``gain``) is judged with the fit's own loss, a Cauchy loss
    at the noise spread, for the same reason. Both models are judged on the same measurements
    (a paired comparison), so the noise they share does not decide either; ``gain_error`` says
    how much the rest does.
    """
    seconds = np.array([m.seconds for m in ms])
    r = [
        np.log(
            np.array([model.microbatch_seconds(m.cp, m.lengths, heads=m.heads) for m in ms])
            / seconds
        )
        for model in (before, after)
    ]
    keep = np.ones(len(ms), dtype=bool)
    for x in r:
        med, own = _spread(x)
        keep &= np.abs(x - med) <= 3.0 * max(own if spread is None else spread, F_SCALE)
    if not keep.any():
        keep[:] = True
    a, b = r[0][keep], r[1][keep]
    # The gain is judged with the fit's own loss (Cauchy at the noise spread): stragglers just
    # inside the cut are one-sided too, and under squares they would still favour a model that
    # predicts too slow.
    s = max(spread if spread is not None else _spread(b)[1], F_SCALE)
    gains = np.log1p((a / s) ** 2) - np.log1p((b / s) ** 2)
    n = int(keep.sum())
    return Holdout(
        before=math.sqrt(float(np.mean(a**2))),
        after=math.sqrt(float(np.mean(b**2))),
        gain_error=float(np.std(gains)) / math.sqrt(n) if n > 1 else math.inf,
        gain=float(np.mean(gains)),
        change=math.sqrt(float(np.mean((a - b) ** 2))),
        measurements=n,
    )


def _solve(
    f: DenseFeatures,
    model: CostModel,
    theta0: np.ndarray,
    scale: np.ndarray,
    start: np.ndarray,
    levels: np.ndarray,
    loss: str,
    f_scale: float,
    overlap: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Minimise the robust loss of the weighted log residuals plus the prior rows; returns
    the coefficients and the log level of each older regime (index k - 1 for regime k),
    starting from ``start`` and ``levels``."""
    x_prior = theta0 / scale
    prior_norm = np.maximum(np.abs(x_prior), 1.0)
    n_coef = len(theta0)
    n_old = len(levels)
    log_measured = np.log(f.measured)
    level_index = np.maximum(f.regime - 1, 0)
    old = f.regime > 0

    def residuals(x: np.ndarray) -> np.ndarray:
        pred = predict(x[:n_coef] * scale, f, model, overlap)
        r = np.log(np.maximum(pred, 1e-300)) - log_measured
        if n_old:
            r = r + np.where(old, x[n_coef:][level_index], 0.0)
        return np.concatenate([f.weight * r, PRIOR_WEIGHT * (x[:n_coef] - x_prior) / prior_norm])

    lower = np.zeros(n_coef)
    lower[1] = 1e-6  # the attention table must stay positive
    n = f.n_sizes
    end = n_coef if isinstance(f, MixFeatures) else n_coef - 1  # ``ring`` is last, >= 0
    inverse = [6 + 2 * j for j in range(n)] + list(range(5 + 2 * n + 1, end, 3))
    lower[inverse] = 1.0 / MAX_BANDWIDTH / scale[inverse]  # bandwidths stay finite
    lower[5 + 2 * n + 2 : end : 3] = 1e-3  # head-split attention scales stay positive
    x0 = np.clip(start[:n_coef] / scale, lower, None)
    x0 = np.where(x0 <= lower, lower * 1.000001 + 1e-12, x0)
    sol = least_squares(
        residuals,
        np.concatenate([x0, levels]),
        bounds=(np.concatenate([lower, np.full(n_old, -np.inf)]), np.inf),
        loss=loss,
        f_scale=f_scale,
        method="trf",
        x_scale=1.0,
        max_nfev=400,
    )
    return sol.x[:n_coef] * scale, sol.x[n_coef:]


def _log_residuals(
    theta: np.ndarray, levels: np.ndarray, f: DenseFeatures, model: CostModel, overlap: bool
) -> np.ndarray:
    r = np.log(np.maximum(predict(theta, f, model, overlap), 1e-300)) - np.log(f.measured)
    if len(levels):
        r = r + np.where(f.regime > 0, levels[np.maximum(f.regime - 1, 0)], 0.0)
    return r


def _spread(r: np.ndarray) -> tuple[float, float]:
    med = float(np.median(r))
    return med, 1.4826 * float(np.median(np.abs(r - med)))


def fit_profile(
    profile: Profile,
    measurements: Sequence[Measurement],
    *,
    ranks_per_node: int,
    waves: Sequence[WaveMeasurement] = (),
    min_measurements: int = 8,
    source: str = "online calibration",
    regimes: Sequence[int] | None = None,
    holdout: Sequence[Measurement] = (),
) -> CalibrationResult:
    """Refit ``profile``'s coefficients to ``measurements`` (see the module docstring).

    Args:
        profile: the model to correct (its form is kept).
        measurements: micro-batches as run on the machine the model should describe.
        ranks_per_node: the job's node size (which groups crossed a node).
        waves: wave timings, to refit ``overheads.wave_seconds`` (kept when empty).
        min_measurements: fewer than this raise CalibrationError.
        source: what the measurements came from (goes into the new profile's provenance).
        regimes: per measurement, 0 for the machine as it is now and k > 0 for the regime k
            change points back (``MeasurementBuffer.regime``): each older regime is fitted with
            a free level of its own and weight ``OLD_REGIME_WEIGHT``. Default: all 0.
        holdout: measurements the fit does not see, to judge the old and the new model on
            (``CalibrationResult.holdout_*``).

    Raises:
        CalibrationError: too few measurements of the current regime, or a measurement the
            profile cannot price (a group larger than any listed link, a head split it does
            not price; a layer mix prices no head split).
    """
    is_mix = profile.layer_mix is not None
    ms = list(measurements)
    if is_mix and any(m.heads != 1 for m in (*ms, *holdout)):
        raise CalibrationError(
            f"profile {profile.name!r} has a layer_mix: it prices heads = 1 only, so head-split "
            "measurements cannot calibrate it"
        )
    reg = np.zeros(len(ms), dtype=np.int64) if regimes is None else np.asarray(regimes, np.int64)
    if reg.shape != (len(ms),) or (reg < 0).any():
        raise CalibrationError(
            f"regimes must give one integer >= 0 per measurement ({len(ms)}), got {regimes!r}"
        )
    current = int((reg == 0).sum())
    if current < min_measurements:
        raise CalibrationError(
            f"{current} micro-batch measurements of the current regime; calibration needs at "
            f"least {min_measurements}"
        )
    # Renumber the older regimes present 1..k so that every free level has data.
    present = sorted(set(reg.tolist()) - {0})
    reg = np.array([0 if r == 0 else present.index(r) + 1 for r in reg.tolist()], np.int64)
    model = CostModel(profile, ranks_per_node)
    sizes = sorted({m.cp for m in ms if m.cp > 1 and m.cp > m.heads})
    heads = sorted({m.heads for m in ms if m.heads > 1})
    try:
        for c in sizes:
            model.link(c)
        for cp, u in sorted({(m.cp, m.heads) for m in (*ms, *holdout) if m.heads > 1}):
            model.head_split(cp, u)
    except ValueError as exc:
        raise CalibrationError(f"a measurement the profile cannot price: {exc}") from None
    f: DenseFeatures | MixFeatures
    if is_mix:
        weight = np.where(reg == 0, 1.0, OLD_REGIME_WEIGHT)
        f = MixFeatures(profile, ms, sizes, ranks_per_node, reg, weight)
        theta0 = mix_coefficients(model, sizes)
        scale = mix_scales(f, model)
    else:
        f = dense_features(model, ms, sizes, reg, heads)
        if not (profile.attention.tiles is not None or model.ring_sequence > 0):
            f = replace(f, rings=np.zeros(len(ms)))  # ``ring`` kept as profiled
        theta0 = profile_coefficients(model, sizes, heads)
        scale = natural_scales(f, model, sizes, heads)
    # Each older regime starts at its median log ratio to the profile (its level then moves).
    levels0 = np.zeros(len(present))
    for k in range(1, len(present) + 1):
        sel = reg == k
        pred = predict(theta0, f.subset(sel), model, model.overlap)
        levels0[k - 1] = float(np.median(np.log(f.measured[sel]) - np.log(pred)))

    def fit(overlap: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
        # Pass 1: a median fit (soft-L1 at 5%: almost L1), robust to any straggler share
        # below one half. Passes 2-3: drop what lies beyond 3 robust spreads of the median
        # residual, refit the rest with a Cauchy loss at that spread (stragglers just inside
        # the cut pull little), from the previous solution.
        theta, levels = _solve(
            f, model, theta0, scale, theta0, levels0, "soft_l1", F_SCALE, overlap
        )
        keep = np.ones(len(ms), dtype=bool)
        spread = F_SCALE
        for _ in range(2):
            r = _log_residuals(theta, levels, f, model, overlap)
            med, spread = _spread(r[keep])
            keep = np.abs(r - med) <= max(3.0 * spread, F_SCALE)
            if not (keep & (reg == 0)).any():
                break
            theta, levels = _solve(
                f.subset(keep),
                model,
                theta0,
                scale,
                theta,
                levels,
                "cauchy",
                max(spread, 1e-3),
                overlap,
            )
        if not np.isfinite(theta).all():  # least_squares keeps iterates finite; a guard
            theta, levels = theta0, np.zeros_like(levels)
        if not is_mix and not f.rings.any():  # no data on ``ring``: exactly as profiled
            theta[-1] = theta0[-1]
        r = _log_residuals(theta, levels, f, model, overlap)
        score = float(np.median(np.abs(r[reg == 0])))
        return theta, levels, keep, score, spread

    # The overlap rule is part of the form, and the one assumption measurements can settle:
    # where rings were measured, both rules are fitted and the one that predicts better (median
    # |log error| over the current regime) is kept; a tie keeps the profile's.
    overlap = model.overlap
    theta, _, keep, score, spread = fit(overlap)
    if sizes and not model.all_to_all and not is_mix:  # a mix keeps its profiled rule
        other = fit(not overlap)
        if other[3] < score - 1e-9:
            overlap, (theta, _, keep, score, spread) = not overlap, other
    wave = profile.overheads.wave_seconds
    if waves:
        # A trimmed mean, not the median: costs the step pays once (the plan agreement, counted
        # in its first wave) must spread over the waves as the model charges them, while the
        # trimming drops stragglers.
        gaps = np.array([max(w.seconds - w.busy_seconds, 0.0) for w in waves])
        wave = float(trim_mean(gaps, 0.1))
    if is_mix:
        new = mix_profile(profile, theta, sizes, model, overlap, wave)
    else:
        new = apply_coefficients(profile, theta, wave, sizes, model, overlap, heads)
    new_model = CostModel(new, ranks_per_node)
    inliers = [m for m, k, g in zip(ms, keep, reg) if k and g == 0]
    before = float(np.mean(np.abs(prediction_errors(model, inliers)))) if inliers else 0.0
    after = float(np.mean(np.abs(prediction_errors(new_model, inliers)))) if inliers else 0.0
    held = holdout_error(model, new_model, holdout, spread=spread) if holdout else None
    by_cp: dict[int, int] = {}
    for m in ms:
        by_cp[m.cp] = by_cp.get(m.cp, 0) + 1
    outliers = int((~keep).sum())
    new = _with_provenance(
        new, profile, source, len(ms), outliers, by_cp, before, after, len(waves)
    )
    return CalibrationResult(
        profile=new,
        coefficients_before=named_coefficients(theta0, sizes, heads, is_mix)
        | {"wave": profile.overheads.wave_seconds},
        coefficients_after=named_coefficients(theta, sizes, heads, is_mix) | {"wave": wave},
        error_before=before,
        error_after=after,
        measurements=len(ms),
        outliers=outliers,
        by_cp=by_cp,
        wave_measurements=len(waves),
        overlap=overlap,
        holdout=held,
        noise=spread,
    )


def _with_provenance(
    new: Profile,
    base: Profile,
    source: str,
    n: int,
    outliers: int,
    by_cp: dict[int, int],
    before: float,
    after: float,
    n_waves: int,
) -> Profile:
    data = new.model_dump(mode="json")
    prov = data["provenance"]
    mix = ", ".join(f"cp {c}: {k}" for c, k in sorted(by_cp.items()))
    prov["source"] = f"{base.provenance.source}; calibrated by dyncp.cost_model.calibration.fit"
    prov["date"] = date.today().isoformat()
    prov["method"] = (
        f"{base.provenance.method}; then fit_profile: robust refit (Cauchy, then soft-L1 "
        f"without outliers) of profile {base.name!r} to {n} measured micro-batches ({source})"
    )
    prov["notes"] = list(base.provenance.notes) + [
        f"calibrated from {n} micro-batches ({mix}) and {n_waves} waves; {outliers} outliers "
        f"dropped; mean |predicted/measured - 1| on the inliers {before:.1%} before, "
        f"{after:.1%} after"
    ]
    if not base.name.endswith("-calibrated"):
        data["name"] = f"{base.name}-calibrated"
    return Profile.model_validate(data)
