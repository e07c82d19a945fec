"""Refit a profile's coefficients to measured micro-batches: the cost model corrects itself.

A profile is a property of one machine at one time; the runtime measures every micro-batch it
runs. :func:`fit_profile` turns those measurements into a new :class:`Profile` whose predictions
match them, keeping the profile's *form* (attention table shape, padding, communication kind) and
refitting its *coefficients*:

=========================  ===============================================================
``lin``                    ``linear_seconds_per_token``
``att``                    scale of the attention table (or of ``alpha``/``beta``)
``seq``                    ``attention.sequence_overhead_seconds`` (per sequence per step)
``step``                   ``attention.step_overhead_seconds`` (per ring step)
``mb``                     ``overheads.microbatch_seconds``
``latency_c``              one transfer's latency in a group of c ranks, per measured c
``inverse_bandwidth_c``    1 / its bandwidth (``communication.links``, by group size)
``wave``                   ``overheads.wave_seconds`` (trimmed mean over the wave timings)
=========================  ===============================================================

The prediction is the one of :class:`CostModel` written in these coefficients, vectorised over
the measurements (features precomputed once), so a fit of a few hundred measurements takes
milliseconds and predicts exactly what ``CostModel(fit.profile)`` predicts.

Why it cannot be dragged far by bad measurements:

- residuals are relative (``predicted / measured - 1``): a long micro-batch weighs no more than a
  short one;
- pass 1 minimises a Cauchy loss (``scipy.optimize.least_squares``, ``f_scale`` 5%): a residual of
  100% (a garbage-collection pause, a straggler) pulls on the fit ~400x less than under squares
  (influence ``r / (1 + (r / 0.05)^2)`` against ``r``);
- then measurements further than ``max(3 x 1.4826 x MAD, 5%)`` from the median residual are
  dropped as outliers and pass 2 refits the rest with a soft-L1 loss, from pass 1's solution;
- every coefficient has a weak prior row pulling it to the profile's value, so a coefficient the
  measurements say nothing about (no CP-4 micro-batch seen yet: no intra-node ring latency to
  learn) keeps its profiled value instead of wandering;
- coefficients are bounded at >= 0 and every result is checked finite before a Profile is built.

One assumption of the form is settled by the data too: whether a ring step's transfer overlaps
its compute (``communication.overlap``). Where rings were measured, both rules are fitted and the
one with the smaller median error is kept (a CPU ring on gloo, where transfers take the same cores
as compute, need not overlap as a GPU ring does).

The fit is deterministic: same profile, same measurements in the same order, same result.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import trim_mean

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import AttentionTable, Profile

__all__ = [
    "CalibrationError",
    "CalibrationResult",
    "Measurement",
    "MeasurementBuffer",
    "WaveMeasurement",
    "fit_profile",
    "prediction_errors",
]

#: Names of the coefficients fitted from micro-batches, in parameter-vector order; then a
#: (latency, 1 / bandwidth) pair per measured group size.
PARAMS = ("lin", "att", "seq", "step", "mb")
#: Relative residual at which the robust losses start to discount a measurement.
F_SCALE = 0.05
#: Weight of each coefficient's prior row: a 100% change of a coefficient costs as much as one
#: measurement 5% off, so data decide wherever they say anything.
PRIOR_WEIGHT = 0.05
#: Largest bandwidth a fit may write (bytes/s): "no measurable transfer cost" stays finite.
MAX_BANDWIDTH = 1e15


class CalibrationError(ValueError):
    """Measurements that cannot calibrate anything (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """One micro-batch as run: its CP size, its sequence lengths and the group's seconds.

    ``seconds`` is the slowest rank of the group (ring ranks finish together; the micro-batch is
    over when the last one is).
    """

    cp: int
    lengths: tuple[int, ...]
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or int(self.cp) != self.cp or self.cp < 1:
            raise CalibrationError(f"measurement cp must be an integer >= 1, got {self.cp!r}")
        if not self.lengths or any(int(s) < 1 for s in self.lengths):
            raise CalibrationError(
                f"measurement lengths must be a non-empty sequence of integers >= 1, got "
                f"{self.lengths!r}"
            )
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise CalibrationError(
                f"measurement seconds must be finite and > 0, got {self.seconds!r}"
            )


@dataclass(frozen=True, slots=True)
class WaveMeasurement:
    """One wave as run: its wall-clock seconds and its slowest group's micro-batch seconds.

    The difference is what the wave's synchronisation cost (``overheads.wave_seconds``).
    """

    seconds: float
    busy_seconds: float

    def __post_init__(self) -> None:
        for name in ("seconds", "busy_seconds"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise CalibrationError(f"wave measurement {name} must be finite and >= 0, got {v}")


class MeasurementBuffer:
    """The most recent measurements, bounded: ``per_cp`` micro-batches per CP size, ``waves`` waves.

    Bounded per CP size so that a run dominated by one CP size still remembers the others (the
    fit needs each size to learn its ring cost), and recent-first so the model follows a machine
    that changes. Memory is O(per_cp x CP sizes x sequences per micro-batch).
    """

    def __init__(self, per_cp: int = 256, waves: int = 256) -> None:
        if per_cp < 1 or waves < 1:
            raise ValueError(f"per_cp and waves must be >= 1, got {per_cp}, {waves}")
        self.per_cp = per_cp
        self._mb: dict[int, deque[Measurement]] = {}
        self._waves: deque[WaveMeasurement] = deque(maxlen=waves)
        self.seen = 0  # micro-batch measurements ever added

    def add(self, items: Iterable[Measurement | WaveMeasurement]) -> None:
        for m in items:
            if isinstance(m, WaveMeasurement):
                self._waves.append(m)
            else:
                self._mb.setdefault(m.cp, deque(maxlen=self.per_cp)).append(m)
                self.seen += 1

    def microbatches(self) -> list[Measurement]:
        """Held micro-batch measurements, by CP size then age (a deterministic order)."""
        return [m for cp in sorted(self._mb) for m in self._mb[cp]]

    def waves(self) -> list[WaveMeasurement]:
        return list(self._waves)

    def __len__(self) -> int:
        return sum(len(d) for d in self._mb.values())


# ---------------------------------------------------------------------------------- features


@dataclass(frozen=True, slots=True)
class _Features:
    """Per-measurement quantities that do not depend on the coefficients being fitted."""

    cp: np.ndarray  # CP size
    link: np.ndarray  # index into the fitted group sizes (-1: cp 1, no link)
    tokens: np.ndarray  # priced tokens per rank
    attention: np.ndarray  # sum over sequences of the profile's net attention per step
    sequences: np.ndarray  # weight of the per-sequence cost per step (n, or n / c all-to-all)
    measured: np.ndarray

    def subset(self, keep: np.ndarray) -> _Features:
        return _Features(*(getattr(self, n)[keep] for n in _Features.__slots__))


def _features(model: CostModel, ms: Sequence[Measurement], sizes: list[int]) -> _Features:
    n = len(ms)
    tokens, attention, sequences = np.empty(n), np.empty(n), np.empty(n)
    for i, m in enumerate(ms):
        p = model.priced(m.cp, np.asarray(m.lengths)).astype(np.float64)
        tokens[i] = p.sum() / m.cp
        if model.all_to_all and m.cp > 1:
            attention[i] = model._net_attention(p).sum() / m.cp
            sequences[i] = len(p) / m.cp
        else:
            attention[i] = model._net_attention(p / m.cp).sum()
            sequences[i] = len(p)
    cp = np.array([m.cp for m in ms], dtype=np.float64)
    index = {c: j for j, c in enumerate(sizes)}
    return _Features(
        cp=cp,
        link=np.array([index.get(m.cp, -1) for m in ms], dtype=np.int64),
        tokens=tokens,
        attention=attention,
        sequences=sequences,
        measured=np.array([m.seconds for m in ms], dtype=np.float64),
    )


def _coefficients(model: CostModel, sizes: Sequence[int]) -> np.ndarray:
    """The profile's values of ``PARAMS`` followed by (latency, 1/bandwidth) per group size."""
    links = []
    for c in sizes:
        latency, bandwidth = model.link(c)
        links += [latency, 1.0 / bandwidth]
    return np.array(
        [model.lin, 1.0, model.per_sequence, model.k, model.microbatch_overhead, *links]
    )


def _predict(theta: np.ndarray, f: _Features, model: CostModel, overlap: bool) -> np.ndarray:
    """CostModel._seconds written in the coefficients ``theta`` (same formula, vectorised)."""
    lin, att, seq, k, mb = theta[:5]
    lat_all, ibw_all = theta[5::2], theta[6::2]
    layers = model.layers
    step = att * f.attention + seq * f.sequences + k
    total = lin * f.tokens + mb
    ring = f.link >= 0
    j = np.where(ring, f.link, 0)
    lat = np.where(ring, lat_all[j] if len(lat_all) else 0.0, 0.0)
    block = np.where(ring, model.kvb * f.tokens * (ibw_all[j] if len(ibw_all) else 0.0), 0.0)
    c = f.cp
    if model.all_to_all:
        layer = step + lat + block
    else:
        comm_f = lat + block
        bwd = model.bwd_bytes
        comm_b = lat + bwd * block
        home = lat + max(bwd - 1.0, 0.0) * block
        if overlap:
            comp_f = step * model.fwd_fraction
            layer = (
                step
                + (c - 1) * (np.maximum(comp_f, comm_f) + np.maximum(step - comp_f, comm_b))
                + home
            )
        else:
            layer = c * step + (c - 1) * (comm_f + comm_b) + home
    layer = np.where(ring, layer, step)
    return total + layers * layer


def _scales(theta0: np.ndarray, f: _Features, model: CostModel, sizes: list[int]) -> np.ndarray:
    """Natural magnitude of each coefficient: the value at which its term alone would explain
    the median measurement. Conditions the problem; stands in for zero-valued priors."""
    med = float(np.median(f.measured))
    L, c = model.layers, f.cp
    steps = np.where(f.link >= 0, c, 1.0) if not model.all_to_all else np.ones_like(c)
    usage = [
        float(np.median(f.tokens)),
        1.0,
        float(np.median(L * steps * f.sequences)),
        float(np.median(L * steps)),
        1.0,
    ]
    for j, size in enumerate(sizes):
        sel = f.link == j
        hops = L * (2 * size - 1) if not model.all_to_all else L
        usage += [hops, hops * model.kvb * (float(np.median(f.tokens[sel])) if sel.any() else 1.0)]
    out = np.array([med / max(u, 1e-300) for u in usage])
    out[1] = 1.0  # the attention scale is already relative
    return np.where(theta0 > 0, theta0, out)


# ---------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """A fitted profile and how well the old and the new one predict the measurements.

    Errors are mean |predicted / measured - 1| over the inlier micro-batches (outliers are what
    the fit refused to learn from, so they are not what the model should be judged on).
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


def prediction_errors(model: CostModel, ms: Sequence[Measurement]) -> np.ndarray:
    """Relative errors ``predicted / measured - 1`` of ``model`` on ``ms``."""
    return np.array([model.microbatch_seconds(m.cp, m.lengths) / m.seconds - 1.0 for m in ms])


def _solve(
    f: _Features,
    model: CostModel,
    theta0: np.ndarray,
    scale: np.ndarray,
    start: np.ndarray,
    loss: str,
    overlap: bool,
) -> np.ndarray:
    x_prior = theta0 / scale
    prior_norm = np.maximum(x_prior, 1.0)

    def residuals(x: np.ndarray) -> np.ndarray:
        pred = _predict(x * scale, f, model, overlap)
        return np.concatenate(
            [pred / f.measured - 1.0, PRIOR_WEIGHT * (x - x_prior) / prior_norm]
        )

    lower = np.zeros(len(theta0))
    lower[1] = 1e-6  # the attention table must stay positive
    lower[6::2] = 1.0 / MAX_BANDWIDTH / scale[6::2]  # bandwidths stay finite
    x0 = np.clip(start / scale, lower, None)
    x0 = np.where(x0 <= lower, lower * 1.000001 + 1e-12, x0)
    sol = least_squares(
        residuals, x0, bounds=(lower, np.inf), loss=loss, f_scale=F_SCALE, method="trf",
        x_scale=1.0, max_nfev=400,
    )
    return sol.x * scale


def fit_profile(
    profile: Profile,
    measurements: Sequence[Measurement],
    *,
    ranks_per_node: int,
    waves: Sequence[WaveMeasurement] = (),
    min_measurements: int = 8,
    source: str = "online calibration",
) -> CalibrationResult:
    """Refit ``profile``'s coefficients to ``measurements`` (see the module docstring).

    Args:
        profile: the model to correct (its form is kept).
        measurements: micro-batches as run on the machine the model should describe.
        ranks_per_node: the job's node size (which groups crossed a node).
        waves: wave timings, to refit ``overheads.wave_seconds`` (kept when empty).
        min_measurements: fewer than this raise CalibrationError.
        source: what the measurements came from (goes into the new profile's provenance).

    Raises:
        CalibrationError: too few measurements, or a layer-mix profile (not fitted yet).
    """
    if profile.layer_mix is not None:
        raise CalibrationError(
            f"profile {profile.name!r} has a layer_mix section (windowed or SSM layers); "
            "fit_profile refits dense-transformer profiles only (their formula is the one fitted)"
        )
    ms = list(measurements)
    if len(ms) < min_measurements:
        raise CalibrationError(
            f"{len(ms)} micro-batch measurements; calibration needs at least {min_measurements}"
        )
    model = CostModel(profile, ranks_per_node)
    sizes = sorted({m.cp for m in ms if m.cp > 1})
    f = _features(model, ms, sizes)
    theta0 = _coefficients(model, sizes)
    scale = _scales(theta0, f, model, sizes)

    def fit(overlap: bool) -> tuple[np.ndarray, np.ndarray, float]:
        first = _solve(f, model, theta0, scale, theta0, "cauchy", overlap)
        r = _predict(first, f, model, overlap) / f.measured - 1.0
        med = float(np.median(r))
        mad = float(np.median(np.abs(r - med)))
        keep = np.abs(r - med) <= max(3 * 1.4826 * mad, F_SCALE)
        theta = _solve(f.subset(keep), model, theta0, scale, first, "soft_l1", overlap)
        if not np.isfinite(theta).all():  # least_squares keeps iterates finite; a guard
            theta = theta0
        fitted = _predict(theta, f, model, overlap) / f.measured - 1.0
        return theta, keep, float(np.median(np.abs(fitted)))

    # The overlap rule is part of the form, and the one assumption measurements can settle:
    # where rings were measured, both rules are fitted and the one that predicts better (median
    # |error| over all measurements) is kept; a tie keeps the profile's.
    overlap = model.overlap
    theta, keep, score = fit(overlap)
    if sizes and not model.all_to_all:
        other = fit(not overlap)
        if other[2] < score - 1e-9:
            overlap, (theta, keep, score) = not overlap, other
    wave = profile.overheads.wave_seconds
    if waves:
        # A trimmed mean, not the median: costs the step pays once (the plan agreement, counted
        # in its first wave) must spread over the waves as the model charges them, while the
        # trimming drops stragglers.
        gaps = np.array([max(w.seconds - w.busy_seconds, 0.0) for w in waves])
        wave = float(trim_mean(gaps, 0.1))
    new = _apply(profile, theta, wave, sizes, model, overlap)
    new_model = CostModel(new, ranks_per_node)
    inliers = [m for m, k in zip(ms, keep) if k]
    before = float(np.mean(np.abs(prediction_errors(model, inliers))))
    after = float(np.mean(np.abs(prediction_errors(new_model, inliers))))
    by_cp: dict[int, int] = {}
    for m in ms:
        by_cp[m.cp] = by_cp.get(m.cp, 0) + 1
    new = _with_provenance(
        new, profile, source, len(ms), int((~keep).sum()), by_cp, before, after, len(waves)
    )
    return CalibrationResult(
        profile=new,
        coefficients_before=_named(theta0, sizes) | {"wave": profile.overheads.wave_seconds},
        coefficients_after=_named(theta, sizes) | {"wave": wave},
        error_before=before,
        error_after=after,
        measurements=len(ms),
        outliers=int((~keep).sum()),
        by_cp=by_cp,
        wave_measurements=len(waves),
        overlap=overlap,
    )


def _named(theta: np.ndarray, sizes: Sequence[int]) -> dict[str, float]:
    out = dict(zip(PARAMS, theta[:5].tolist()))
    for j, c in enumerate(sizes):
        out[f"latency_{c}"] = float(theta[5 + 2 * j])
        out[f"inverse_bandwidth_{c}"] = float(theta[6 + 2 * j])
    return out


#: Group sizes a calibrated profile lists links for, besides the measured ones: every power of
#: two up to this (the link rule takes the next larger size listed, so all groups are covered).
LINK_SIZES_UP_TO = 1 << 16


def _apply(
    profile: Profile,
    theta: np.ndarray,
    wave: float,
    sizes: Sequence[int],
    model: CostModel,
    overlap: bool | None = None,
) -> Profile:
    """A copy of ``profile`` with the fitted coefficients written into its fields.

    Fitted links go to ``communication.links`` by group size; sizes not measured keep the link
    the profile gave them at this node size (``model.link``), so a calibrated profile lists a
    link for every power of two up to ``LINK_SIZES_UP_TO`` and is specific to that node size.
    """
    lin, att, seq, k, mb = (float(v) for v in theta[:5])
    data = profile.model_dump(mode="json")
    data["linear_seconds_per_token"] = lin
    a = data["attention"]
    old = profile.attention
    if isinstance(old, AttentionTable):
        net = np.asarray(old.seconds) - old.step_overhead_seconds - old.sequence_overhead_seconds
        a["seconds"] = (att * net + k + seq).tolist()
    else:
        a["alpha"], a["beta"] = att * old.alpha, att * old.beta
    a["step_overhead_seconds"], a["sequence_overhead_seconds"] = k, seq
    fitted = {c: (float(theta[5 + 2 * j]), float(theta[6 + 2 * j])) for j, c in enumerate(sizes)}
    if fitted:
        listed = {link["group_size"] for link in data["communication"]["links"]}
        powers = {1 << e for e in range(1, LINK_SIZES_UP_TO.bit_length())}
        links = []
        for c in sorted(listed | powers | set(fitted)):
            if c in fitted:
                latency, inverse = fitted[c]
                bandwidth = min(1.0 / inverse, MAX_BANDWIDTH)
            else:
                latency, bandwidth = model.link(c)
            links.append(
                {
                    "group_size": c,
                    "latency_seconds": latency,
                    "bandwidth_bytes_per_second": bandwidth,
                }
            )
        data["communication"]["links"] = links
    if overlap is not None:
        data["communication"]["overlap"] = overlap
    data["overheads"] = {"microbatch_seconds": mb, "wave_seconds": wave}
    return Profile.model_validate(data)


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
    prov["source"] = f"{base.provenance.source}; calibrated by dyncp.cost_model.calibrate"
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
