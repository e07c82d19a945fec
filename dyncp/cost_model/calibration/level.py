"""The level of a machine: one factor on every micro-batch time, estimated fast and applied exactly.

When a machine changes as a whole (a slower clock, a noisy neighbour, a throttled GPU), every
time moves by about the same factor. Re-learning every coefficient from the few measurements
taken since the change is slow (about a dozen coefficients at sigma-0.3 noise need hundreds of
measurements), while *one* factor is learned from one or two steps. Online calibration therefore
follows a change in two speeds (``dyncp.cost_model.calibration.OnlineCalibrator``,
``follow="level"``):

- :func:`regime_level` estimates the factor between two sets of measurements under one model;
- :func:`scaled_profile` writes it into a profile (every time coefficient x factor), so a
  level-only version is an ordinary profile that planners, the Store and ``save`` handle as any
  other; the per-coefficient refits follow slowly, on all measurements with the older ones
  rescaled by their level.

Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncp.cost_model.calibration.measurements import CalibrationError, Measurement
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile

__all__ = ["BIWEIGHT", "biweight_location", "biweight_shift", "regime_level", "scaled_profile"]

#: Tuning constant of the biweight location (in robust spreads): a residual beyond it weighs
#: nothing. 3.5 rather than the textbook 4.685 (95% of a mean's efficiency under Gaussian
#: noise): stragglers at 2-5x then weigh less. On the adversarial noise (lognormal sigma 0.3,
#: 20% stragglers at 2-10x), simulated: standard deviation of the level from 64 new
#: measurements 0.047 at 3.5 against 0.057 at 4.685 (0.042 is the bound of a mean over the
#: clean ones).
BIWEIGHT = 3.5
#: Profile fields that are a time (x factor) or a rate (/ factor); anything else is shape.
_ATTENTION_COEFFICIENTS = ("alpha", "beta")


#: The fields of a profile's ``step`` that are micro-batch times (priced per token inside every
#: micro-batch). The others -- the optimizer per parameter, the fixed part -- are paid once per
#: step outside the micro-batches: a level of micro-batch timings says nothing of them
#: (``calibration.step_fit`` fits what the step pays outside them).
_STEP_MICROBATCH = ("embedding_seconds_per_token", "head_loss_seconds_per_token")


def _scale(node: Any, factor: float, key: str = "") -> Any:
    if isinstance(node, dict):
        if key == "step":
            return {
                k: _scale(v, factor, k) if k in _STEP_MICROBATCH else v for k, v in node.items()
            }
        return {
            k: v if k in ("provenance", "wave_seconds") else _scale(v, factor, k)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_scale(v, factor, key) for v in node]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return node
    if "seconds" in key or key in _ATTENTION_COEFFICIENTS:
        return node * factor
    if "bandwidth" in key:
        return node / factor
    return node


def scaled_profile(
    profile: Profile,
    factor: float,
    *,
    ranks_per_node: int,
    check: Sequence[Measurement] = (),
) -> Profile:
    """``profile`` with every micro-batch time multiplied by ``factor``.

    Every field named in seconds (per-token work, the attention table and its overheads,
    latencies, the micro-batch constant, layer-mix SSM time, the step's per-token embedding and
    head; not its optimizer or fixed part, paid outside micro-batches) and a quadratic attention's
    ``alpha``/``beta`` are multiplied by ``factor``; every bandwidth is divided by it. The cost
    model is homogeneous of degree one in these (a sum of terms, each linear in one of them, and
    maxima of such sums), so every prediction scales by exactly ``factor``. The wave cost is not
    a micro-batch time and is kept (it is refitted from wave timings).

    ``check``: measurements whose predictions are verified to scale by ``factor`` (relative
    1e-6); a profile field this rule does not know (a new time coefficient named otherwise)
    then raises CalibrationError instead of giving a wrong model.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise CalibrationError(f"a level factor must be finite and > 0, got {factor!r}")
    data = _scale(profile.model_dump(mode="json"), float(factor))
    out = Profile.model_validate(data)
    if check:
        before = CostModel(profile, ranks_per_node)
        after = CostModel(out, ranks_per_node)
        for m in check:
            want = factor * before.microbatch_seconds(m.cp, m.lengths, heads=m.heads)
            got = after.microbatch_seconds(m.cp, m.lengths, heads=m.heads)
            if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-300):
                raise CalibrationError(
                    f"profile {profile.name!r} does not scale as one level: cp {m.cp} x "
                    f"{len(m.lengths)} sequences predicted {got!r} s, expected {want!r} s"
                )
    return out


def biweight_location(x: np.ndarray, spread: float, *, iterations: int = 20) -> float:
    """Tukey's biweight location of ``x`` at a given robust ``spread``, from its median.

    Why not a median or a trimmed mean: with few measurements (one or two steps), the number of
    stragglers (one-sided, 2-10x) among them varies by several from set to set; a median
    moves with that count (its efficiency is 64% anyway) and a trimmed mean keeps every
    straggler the trim does not reach. The biweight gives a straggler far out no weight and
    keeps 95% of a mean's efficiency on the rest. ``spread`` comes from the larger set being
    compared with, so both sets are weighed alike.
    """
    mu = float(np.median(x))
    c = BIWEIGHT * max(spread, 1e-6)
    for _ in range(iterations):
        u = (x - mu) / c
        w = np.where(np.abs(u) < 1.0, (1.0 - u * u) ** 2, 0.0)
        if w.sum() <= 0:
            break
        step = float((w * (x - mu)).sum() / w.sum())
        mu += step
        if abs(step) < 1e-9:
            break
    return mu


def biweight_shift(
    new: np.ndarray, old: np.ndarray, *, reference_variance: float = 0.0
) -> tuple[float, float]:
    """(shift, standard error): how far the biweight location of ``new`` lies from that of
    ``old``, both at ``old``'s robust spread, and the standard error of that difference.

    The error is the M-estimator's asymptotic one, its efficiency factor read off ``old``
    (mean psi^2 / mean psi'^2): about 1.1 x spread / sqrt(n) under the adversarial noise,
    where a median's is 1.25 x the spread it sees, inflated by the stragglers. A change test on
    it sees a 1.4x change in two steps of 16 measurements at 4 standard errors, where a test on
    medians needs three or four.

    ``reference_variance``: the variance, in squared spreads, that ``new`` carries from how it
    was centred (each new residual less a per-kind median of older ones: 1.57 / n per kind of
    n, by the share of ``new`` of that kind), added to the error.
    """
    spread = max(1.4826 * float(np.median(np.abs(old - np.median(old)))), 1e-6)
    base = biweight_location(old, spread)
    shift = biweight_location(new, spread) - base
    c = BIWEIGHT * spread
    u = (old - base) / c
    inside = np.abs(u) < 1.0
    psi = np.where(inside, u * (1.0 - u * u) ** 2, 0.0)
    slope = np.where(inside, (1.0 - u * u) * (1.0 - 5.0 * u * u), 0.0)
    factor = math.sqrt(float(np.mean(psi**2))) / max(float(np.mean(slope)), 1e-6)
    error = math.sqrt(
        (c * factor) ** 2 * (1.0 / len(new) + 1.0 / len(old)) + spread**2 * reference_variance
    )
    return shift, error


def regime_level(
    new: np.ndarray, new_keys: np.ndarray, old: np.ndarray, old_keys: np.ndarray
) -> tuple[float, int]:
    """log(new times / old times): the level between two sets of log residuals under one model.

    ``new``/``old`` are ``log(measured / predicted)`` of each set, ``*_keys`` their group kind
    (CP size and heads). Each new residual is compared with the biweight location
    (:func:`biweight_location`) of the old residuals of its own kind, so a model that prices
    one CP size badly biases nothing; the level is the biweight location of those differences
    less that of the old residuals' own differences (the stragglers' pull on the estimator,
    the same in both sets, cancels). Every location is taken at the old set's robust spread
    (1.4826 x MAD of its differences). Returns (level, measurements compared); (0.0, 0) when
    no kind is in both sets.
    """
    reference: dict[int, float] = {}
    spreads: list[np.ndarray] = []
    for key in np.unique(old_keys).tolist():
        sel = old[old_keys == key]
        if len(sel) >= 4:
            reference[key] = float(np.median(sel))
            spreads.append(sel - reference[key])
    diffs = [r - reference[k] for r, k in zip(new.tolist(), new_keys.tolist()) if k in reference]
    if not diffs:
        return 0.0, 0
    base = np.concatenate(spreads)
    spread = 1.4826 * float(np.median(np.abs(base - np.median(base))))
    level = biweight_location(np.array(diffs), spread) - biweight_location(base, spread)
    return level, len(diffs)
