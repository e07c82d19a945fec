"""Online calibration: measured micro-batches in, versioned cost models out.

    calibrator = OnlineCalibrator(load_profile("cpu-gloo"), ranks_per_node=8)
    ...
    new = calibrator.observe(measurements, waves)    # after each step, where they are gathered
    if new is not None:                              # a refit was adopted: model version + 1
        planner = VersionedPlanner(planner, new)     # dyncp.planner.versioned: plans priced with it
    calibrator.save("profiles/my-cluster.json")      # the next run starts calibrated

One process calibrates (the plan service, or rank 0); every rank must plan with the same model
version at the same step, so versions travel with the plans (``plan.stats["model_version"]``) and
are handed to the other ranks explicitly: by a collective at a step boundary
(:class:`dyncp.runtime.measure.CollectiveCalibration`) or through the Store
(:class:`dyncp.control.model_channel.ModelChannel`), where a fallback plan names the version it
uses.

Refits are rate-limited (``refit_every`` steps) and adopted only when they predict measurements
held out of the fit better than the current model, so noise does not churn versions. What the
calibration guarantees, and the figures behind it, are in ``docs/cost-model/calibration.md``:

- a refit is unbiased under multiplicative noise (log residuals) and robust to stragglers;
- every coefficient can move from any value, zero and tiny included;
- nothing measured stops it: entries that are malformed, that the profile cannot price or that
  are implausibly far from it are refused alone and counted (``refused``); a refit that fails
  anyway is contained, counted (``failures``) and its measurements dropped;
- it follows a machine that changes: a shift of the newest steps beyond noise marks a change
  point in the (bounded, recent-first) :class:`MeasurementBuffer` and refits at once.

Torch-free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from dyncp.cost_model.calibration.change import change_point, shifted_window
from dyncp.cost_model.calibration.fit import CalibrationResult, fit_profile
from dyncp.cost_model.calibration.level import regime_level, scaled_profile
from dyncp.cost_model.calibration.measurements import (
    BufferedMeasurement,
    CalibrationError,
    Measurement,
    MeasurementBuffer,
    WaveMeasurement,
)
from dyncp.cost_model.calibration.records import (
    MeasurementRecord,
    ModelVersion,
    decode_measurements,
    encode_measurements,
)
from dyncp.cost_model.schema import Profile

__all__ = [
    "MeasurementRecord",
    "ModelVersion",
    "OnlineCalibrator",
    "decode_measurements",
    "encode_measurements",
]

#: A micro-batch measured more than this factor away from the current model's prediction is
#: refused: no refit of the profile's coefficients should be dragged that far by one record (a
#: profile that far off is re-profiled, not calibrated).
MAX_RATIO = 1e3
#: Fewest held-out measurements a candidate is judged on.
MIN_HOLDOUT = 4
#: How a detected change is followed (``OnlineCalibrator(follow=...)``).
FOLLOWS = ("level", "regimes")
#: Steps after a detected change during which the level is re-estimated every step and written
#: into a new version whenever it moved by ``FOLLOW_MIN`` (log) or more.
FOLLOW_STEPS, FOLLOW_MIN = 8, 0.01

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- calibrator


class OnlineCalibrator:
    """Keeps measurements, refits the profile now and then, and versions the results.

    Args:
        profile: the job's starting profile (version 0).
        ranks_per_node: the job's node size.
        buffer: where measurements are kept (default: 256 per CP size, 256 waves).
        refit_every: steps (calls of :meth:`observe`) between two refits; a detected change of
            the machine refits at once.
        min_measurements: no refit before this many micro-batches of the current regime are
            held.
        min_gain: a refit is adopted only when it moves the predictions on the held-out
            measurements by at least this much (root mean square of the log ratio), so a refit
            that changes nothing does not churn versions, and the held-out measurements do not
            show it worse than the current model beyond their noise
            (:func:`~dyncp.cost_model.calibration.fit.holdout_error`).
        holdout_every: every this-many-th measurement of the current regime (by arrival) is held
            out of the candidate fit and judges it against the current model.
        detect_changes: watch for a change of the machine (see :meth:`observe`).
        follow: how a detected change is followed. ``"level"`` (default): in two speeds. For
            ``FOLLOW_STEPS`` steps after the change, the level of the new regime against each
            older one is re-estimated every step
            (:func:`~dyncp.cost_model.calibration.level.regime_level`) and, when it moved by
            ``FOLLOW_MIN`` or more, the current model scaled by it is adopted
            (:func:`~dyncp.cost_model.calibration.level.scaled_profile`: one factor, learned from a
            step or two); the regular refits fit every coefficient on all measurements, the older
            ones rescaled to the current level at full weight. ``"regimes"``: the previous
            behaviour, kept for comparison (``bench/calibration_bench.py --drift``): refit at once,
            older regimes at a free level of their own and half the weight.

    Attributes:
        current: the adopted model version.
        history: every refit tried, adopted or not (bounded: the last 64).
        rejected: measurement records refused whole (malformed, or a bad signature).
        refused: micro-batches and waves refused alone: malformed entries of a record, groups
            the current profile cannot price, times beyond ``MAX_RATIO`` of its prediction.
        failures: refits that raised (contained: counted, logged, their records dropped).
        dropped: micro-batches dropped after a failed refit.
        changes: changes of the machine detected.
        level_versions: versions adopted by following a change's level (``follow="level"``).
        steps: steps observed.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        ranks_per_node: int,
        buffer: MeasurementBuffer | None = None,
        refit_every: int = 4,
        min_measurements: int = 32,
        min_gain: float = 0.002,
        holdout_every: int = 5,
        detect_changes: bool = True,
        follow: str = "level",
    ) -> None:
        if follow not in FOLLOWS:
            raise ValueError(f"follow must be one of {FOLLOWS}, got {follow!r}")
        for name, value, low in (
            ("refit_every", refit_every, 1),
            ("min_measurements", min_measurements, 1),
            ("holdout_every", holdout_every, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (math.isfinite(min_gain) and min_gain >= 0):
            raise ValueError(f"min_gain must be a finite number >= 0, got {min_gain}")
        self.ranks_per_node = ranks_per_node
        self.buffer = MeasurementBuffer() if buffer is None else buffer
        self.refit_every = refit_every
        self.min_measurements = min_measurements
        self.min_gain = min_gain
        self.holdout_every = holdout_every
        self.detect_changes = detect_changes
        self.follow = follow
        self.current = ModelVersion(0, profile)
        self._model = self.current.model(ranks_per_node)
        self.history: list[tuple[CalibrationResult, bool]] = []
        self.rejected = 0
        self.refused = 0
        self.failures = 0
        self.dropped = 0
        self.changes = 0
        self.level_versions = 0
        self.refits = 0  # refits tried (history keeps the last 64 of them)
        self.steps = 0
        self._since_fit = 0
        self._fitted_step = 0  # the step of the last refit that ran to the end
        self._cache: dict[int, float] = {}  # log residual by arrival number, current version
        self._cache_version = 0
        # follow="level": log(current level / level of regime k) by older regime k (None: no
        # group kind in common, so it keeps a free level of its own in the fit), the level of
        # regime 1 that the current model embodies, and the step the current regime began.
        self._levels: dict[int, float | None] = {}
        self._baked = 0.0
        self._change_step = 0

    @property
    def last(self) -> CalibrationResult | None:
        """The latest refit tried, or None."""
        return self.history[-1][0] if self.history else None

    def _admit(self, m: Measurement) -> bool:
        """Whether the current profile can price ``m`` and its time is within ``MAX_RATIO``
        of the prediction (farther is not a machine the model could be refitted to)."""
        try:
            predicted = self._model.microbatch_seconds(m.cp, m.lengths, heads=m.heads)
        except (ValueError, ArithmeticError):
            return False
        return (
            math.isfinite(predicted)
            and predicted > 0
            and (1.0 / MAX_RATIO <= m.seconds / predicted <= MAX_RATIO)
        )

    def observe(
        self, microbatches: Iterable[Measurement], waves: Iterable[WaveMeasurement] = ()
    ) -> ModelVersion | None:
        """Add one step's measurements; returns the new version when a refit was adopted.

        Never raises on what was measured: a micro-batch the current profile cannot price is
        refused (``refused``), and a refit that fails is contained (``failures``). When the
        newest steps sit away from the older ones by more than noise explains
        (:meth:`_changed`), the machine changed: a change point is marked in the buffer (what
        came before it keeps its shape but gets a level of its own) and the model refits now.
        """
        self.steps += 1
        admitted = []
        for m in microbatches:
            if isinstance(m, Measurement) and self._admit(m):
                admitted.append(m)
            else:
                self.refused += 1
        wave_list = [w for w in waves if isinstance(w, WaveMeasurement)]
        self.buffer.add(admitted, step=self.steps)
        self.buffer.add(wave_list)
        self._since_fit += 1
        changed = 0
        if self.detect_changes and admitted:
            try:
                changed = self._changed()
            except Exception:  # noqa: BLE001 - nothing measured may stop calibration
                log.exception("change detection failed; the step's measurements are kept")
                self.failures += 1
        if changed:
            self.changes += 1
            self.buffer.mark_change(self.steps - changed + 1)
            self._change_step = self.steps - changed + 1
            self._baked = 0.0  # the current model prices the regime just ended
        adopted = None
        if self.follow == "level":
            if self.buffer.change_points:
                try:
                    adopted = self._follow_level()
                except Exception:  # noqa: BLE001 - nothing measured may stop calibration
                    log.exception("following the level failed; the regular refits go on")
                    self.failures += 1
            if self._since_fit < self.refit_every:
                return adopted
        elif not changed and self._since_fit < self.refit_every:
            return None
        return self.refit() or adopted

    def _follow_level(self) -> ModelVersion | None:
        """Re-estimate each older regime's level against the current one; within
        ``FOLLOW_STEPS`` of the last change, adopt the current model scaled to the new level
        when it moved by ``FOLLOW_MIN`` or more (the new version, or None)."""
        self._relocate()
        entries = self.buffer.entries()
        regimes = np.array([self.buffer.regime(e) for e in entries])
        measured = -self._residuals(entries)  # log(measured / predicted)
        keys = np.array([e.measurement.cp * 4096 + e.measurement.heads for e in entries])
        now = regimes == 0
        levels: dict[int, float | None] = {}
        for k in sorted(set(regimes.tolist()) - {0}):
            old = regimes == k
            level, n = regime_level(measured[now], keys[now], measured[old], keys[old])
            levels[k] = level if n else None
        self._levels = levels
        if self.steps - self._change_step >= FOLLOW_STEPS or levels.get(1) is None:
            return None
        move = levels[1] - self._baked
        if abs(move) < FOLLOW_MIN:
            return None
        recent = [e.measurement for e, n in zip(entries, now) if n][-8:]
        profile = scaled_profile(
            self.current.profile,
            math.exp(move),
            ranks_per_node=self.ranks_per_node,
            check=recent,
        )
        self._adopt(profile)
        self._baked = levels[1]
        self.level_versions += 1
        return self.current

    def _adopt(self, profile: Profile) -> None:
        self.current = ModelVersion(self.current.version + 1, profile)
        self._model = self.current.model(self.ranks_per_node)

    def observe_record(self, raw: bytes) -> ModelVersion | None:
        """:meth:`observe` an encoded record; a malformed one is counted and ignored, and so is
        each malformed entry of an otherwise valid one (``refused``)."""
        try:
            record = decode_measurements(raw)
        except CalibrationError:
            self.rejected += 1
            return None
        self.refused += record.refused
        return self.observe(record.microbatches, record.waves)

    def _residuals(self, entries: Sequence[BufferedMeasurement]) -> np.ndarray:
        """log(predicted / measured) of the current model on ``entries`` (each entry priced
        once per model version)."""
        if self._cache_version != self.current.version:
            self._cache, self._cache_version = {}, self.current.version
        out = np.empty(len(entries))
        for i, e in enumerate(entries):
            r = self._cache.get(e.order)
            if r is None:
                m = e.measurement
                predicted = self._model.microbatch_seconds(m.cp, m.lengths, heads=m.heads)
                r = self._cache[e.order] = math.log(predicted / m.seconds)
            out[i] = r
        if len(self._cache) > 4 * max(len(self.buffer), 1):  # forget what the buffer forgot
            held = {e.order for e in self.buffer.entries()}
            self._cache = {k: v for k, v in self._cache.items() if k in held}
        return out

    def _changed(self) -> int:
        """How many of the newest steps moved away from the older measurements of the current
        regime, under the current model, by more than noise explains (0: none did).

        Windows of ``CHANGE_WINDOWS`` steps are tried, shortest first (a short one reacts
        fast to a large change, a longer one sees a smaller change through heavy noise).
        Each recent residual is compared with the median residual of the older measurements of
        its own (CP size, heads): a run that starts using a CP size the model prices badly is
        not a change of the machine. The shift is the median of those differences; it must
        exceed both ``CHANGE_MIN`` (5%: smaller drifts are left to the regular refits) and
        ``CHANGE_Z`` standard errors of a median (1.2533 x 1.4826 x MAD / sqrt(n)), so noise
        alone triggers it about once in 10,000 steps.
        """
        entries = self.buffer.entries()
        regimes = [self.buffer.regime(e) for e in entries]
        if self.follow == "level":  # older regimes count, rescaled to the current level
            shift = [0.0 if g == 0 else self._levels.get(g) for g in regimes]
        else:
            shift = [0.0 if g == 0 else None for g in regimes]
        entries = [e for e, d in zip(entries, shift) if d is not None]
        if not entries:
            return 0
        residuals = self._residuals(entries) - np.array([d for d in shift if d is not None])
        keys = np.array([e.measurement.cp * 4096 + e.measurement.heads for e in entries])
        steps = np.array([e.step for e in entries])
        window = shifted_window(
            residuals, keys, steps, now=self.steps, level=self.follow == "level"
        )
        if window and self.follow == "level":
            return self._change_start(window, residuals, keys, steps)
        return window

    def _change_start(
        self, window: int, residuals: np.ndarray, keys: np.ndarray, steps: np.ndarray
    ) -> int:
        """How many newest steps belong to the new regime, a change having been seen in the
        newest ``window``: a long window sees a change late, and a short one may see it a step
        or two after it began. The change point is ``change.change_point`` from two steps before
        the window on."""
        return (
            self.steps
            + 1
            - change_point(self.steps - window - 1, self.steps, residuals, keys, steps)
        )

    def _relocate(self) -> None:
        """Within ``FOLLOW_STEPS`` of the last change, place its change point again with every
        step measured since (``change.change_point`` from two steps before it, on the regime it
        ended and the current one): the first placement saw one or two steps after the change, and
        a step put on the wrong side biases the new level by 1/n of the change."""
        points = self.buffer.change_points
        if not points or self.steps - self._change_step >= FOLLOW_STEPS:
            return
        entries = [e for e in self.buffer.entries() if self.buffer.regime(e) <= 1]
        floor = points[-2] if len(points) > 1 else 0
        first = max(points[-1] - 2, floor + 1)
        steps = np.array([e.step for e in entries])
        if not ((steps < first) & (steps >= floor)).any():
            return
        keep = steps >= floor
        entries = [e for e, k in zip(entries, keep) if k]
        residuals = self._residuals(entries)
        keys = np.array([e.measurement.cp * 4096 + e.measurement.heads for e in entries])
        start = change_point(first, self.steps, residuals, keys, steps[keep])
        if start != points[-1] and start > floor:
            self.buffer.move_change(start)
            self._change_step = start

    def refit(self) -> ModelVersion | None:
        """Fit now on what the buffer holds; the new version if adopted.

        The candidate is fitted without every ``holdout_every``-th measurement of the current
        regime and judged against the current model on those. The held-out measurements are
        the same ones for the whole run (chosen by arrival number), and no version is ever
        fitted to them, so they are out of sample for the current model as well as for the
        candidate (a model refitted on all measurements would be judged in-sample at the
        next refit, and a biased one kept).
        Any failure is contained: counted in ``failures``, logged, and the measurements that
        arrived since the last refit that ran through are dropped (or the ones the current
        profile can no longer price, when there are such).
        """
        self._since_fit = 0
        try:
            return self._refit()
        except CalibrationError:
            return None
        except Exception:  # noqa: BLE001 - nothing measured may stop calibration
            self.failures += 1
            log.exception("cost-model refit failed; dropping the measurements it was given")
            unpriced = self.buffer.discard(lambda e: not self._admit(e.measurement))
            if unpriced == 0:
                since = self._fitted_step
                unpriced = self.buffer.discard(lambda e: e.step > since)
            self.dropped += unpriced
            self.refused += unpriced
            return None

    def _refit(self) -> ModelVersion | None:
        if self.follow == "level":
            return self._refit_level()
        entries = self.buffer.entries()
        regimes = [self.buffer.regime(e) for e in entries]
        held = [
            (e, g == 0 and e.order % self.holdout_every == self.holdout_every - 1)
            for e, g in zip(entries, regimes)
        ]
        train = [(e.measurement, g) for (e, out), g in zip(held, regimes) if not out]
        holdout = [e.measurement for e, out in held if out]
        if regimes.count(0) < self.min_measurements or len(holdout) < MIN_HOLDOUT:
            return None
        return self._judge(train, holdout)

    def _refit_level(self) -> ModelVersion | None:
        """follow="level": every measurement in the fit, the older ones rescaled to the
        current level (a regime with no group kind in common keeps a free level), and every
        ``holdout_every``-th held out, whatever its regime."""
        train: list[tuple[Measurement, int]] = []
        holdout: list[Measurement] = []
        for e in self.buffer.entries():
            g = self.buffer.regime(e)
            level = 0.0 if g == 0 else self._levels.get(g)
            m = e.measurement
            if level:
                m = Measurement(m.cp, m.lengths, m.seconds * math.exp(level), m.heads)
            if e.order % self.holdout_every == self.holdout_every - 1:
                if level is not None:
                    holdout.append(m)
            else:
                train.append((m, 0 if level is not None else g))
        if len(train) + len(holdout) < self.min_measurements or len(holdout) < MIN_HOLDOUT:
            return None
        baked = self._levels.get(1) or 0.0
        adopted = self._judge(train, holdout)
        if adopted is not None:
            self._baked = baked
        return adopted

    def _judge(
        self, train: list[tuple[Measurement, int]], holdout: list[Measurement]
    ) -> ModelVersion | None:
        """Fit a candidate on ``train`` (measurement, regime); adopt it if ``holdout`` does
        not show it worse."""
        waves = self.buffer.waves()
        common = {"ranks_per_node": self.ranks_per_node, "waves": waves}
        candidate = fit_profile(
            self.current.profile,
            [m for m, _ in train],
            regimes=[g for _, g in train],
            holdout=holdout,
            min_measurements=1,
            **common,
        )
        self._fitted_step = self.steps
        self.refits += 1
        held = candidate.holdout
        assert held is not None
        # A candidate that moves predictions by min_gain or more is adopted unless the held-out
        # measurements show it worse beyond their noise (two standard errors of the paired
        # gain): it was fitted on more, and newer, measurements than the current model, and a
        # hold-out set small enough to leave the fit most of the data cannot show a gain of a
        # few percent under heavy noise, only a clearly wrong fit.
        adopted = held.change >= self.min_gain and held.gain >= -2.0 * held.gain_error
        result = candidate
        self.history = [*self.history[-63:], (result, adopted)]
        if not adopted:
            return None
        self._adopt(result.profile)
        return self.current

    def save(self, path: str | Path) -> Path:
        """Write the current profile as JSON (provenance says what it was fitted from)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.current.profile.to_json())
        return path
