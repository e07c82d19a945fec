"""Calibrate the per-step part of a step: what a measured step pays outside its micro-batches.

The runtime measures each rank's micro-batch busy time and the step's wall clock. Their
difference on the busiest rank -- wall clock minus that rank's busy time -- is what the step
spent outside micro-batches: the waves' synchronisation and waiting, the gradient reduction,
the optimizer step and anything else every step pays once (data loading, loss reduction). The
cost model predicts it as ``synchronisation + gradient_reduction + optimizer + fixed``
(``dyncp.cost_model.step_parts``); :class:`StepFit` estimates ``step.fixed_seconds`` so that
prediction matches the measurements, and nothing else:

- robust: the candidate is the median, over the window, of measured outside time minus the
  predicted synchronisation, reduction and optimizer (a straggling step moves a median by one
  rank, not by its size), never below 0;
- log residuals: a candidate is adopted only when it predicts the newest steps' wall clocks
  (held out of the candidate's window) better than the current value does, in median absolute
  log error (a relative error, so a 2 s step and a 20 ms step weigh alike);
- bounded adoption: at most one adoption every ``refit_every`` steps, and only a move of more
  than ``min_change`` (relative) counts as a change;
- contained failures: a step whose figures are not finite, negative or inconsistent (busy time
  longer than the wall clock) is refused alone and counted in ``refused``; it never raises.

A profile without ``step`` (schema version 1) gains one with only ``fixed_seconds`` set (no
parameters: its reduction and optimizer stay unpriced, their measured time lands in ``fixed``).
Torch-free.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import numpy as np

from dyncp.cost_model.schema import Profile, StepCosts

__all__ = ["StepFit", "whole_step_seconds", "with_fixed_seconds", "with_parameters"]

#: Entries of ``plan.stats["step_parts"]`` a step needs to be calibrated on.
_NEEDED = ("synchronisation", "gradient_reduction", "optimizer")


def whole_step_seconds(parts: Mapping[str, float], fixed: float) -> float:
    """The whole step of ``parts`` (``StepParts.as_dict()``) with the per-step fixed part
    ``fixed`` in place of the one the parts were priced with (the profile's ``fixed_seconds``,
    which a fit replaces, never adds to)."""
    return float(parts["total"]) - float(parts["fixed"]) + float(fixed)


def with_parameters(profile: Profile, parameters: int) -> Profile:
    """``profile`` pricing the reduction and optimizer of a model of ``parameters`` trainable
    parameters: a profile's seconds per parameter are the machine's, its count is the model it
    was measured with, which need not be the one being trained."""
    if profile.step is None:
        raise ValueError(
            f"profile {profile.name!r} has no step section (schema version 1): its seconds per "
            "parameter are unknown, so a parameter count cannot price a step; profile a step "
            "(python -m dyncp.profiling.step_costs) or leave parameters unset"
        )
    if parameters < 0:
        raise ValueError(f"parameters must be >= 0, got {parameters}")
    step = profile.step.model_copy(update={"parameters": int(parameters)})
    return Profile.model_validate({**profile.model_dump(), "step": step.model_dump()})


def with_fixed_seconds(profile: Profile, seconds: float) -> Profile:
    """``profile`` with ``step.fixed_seconds = seconds`` (version 2; a version-1 profile gains a
    step of that fixed part alone)."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"fixed seconds must be finite and >= 0, got {seconds}")
    step = profile.step or StepCosts(parameters=0, optimizer_seconds_per_parameter=0.0)
    step = step.model_copy(update={"fixed_seconds": float(seconds)})
    return Profile.model_validate(
        {**profile.model_dump(), "schema_version": 2, "step": step.model_dump()}
    )


class StepFit:
    """Fits ``step.fixed_seconds`` from measured steps (module docstring).

    Args:
        profile: the profile whose fixed part is fitted (its other numbers are kept).
        window: steps kept (the newest); the newest third is held out to judge a candidate.
        refit_every: steps between adoptions.
        min_change: relative move of the fixed part below which a candidate is not adopted.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        window: int = 24,
        refit_every: int = 3,
        min_change: float = 0.02,
    ) -> None:
        if window < 3 or refit_every < 1 or not min_change >= 0:
            raise ValueError(
                f"StepFit needs window >= 3, refit_every >= 1, min_change >= 0; got {window}, "
                f"{refit_every}, {min_change}"
            )
        self.profile = profile
        self.refit_every, self.min_change = refit_every, min_change
        self.fixed = profile.step.fixed_seconds if profile.step else 0.0
        self.initial_fixed = self.fixed
        # (wall clock, busiest rank's busy, predicted outside time without the fixed part)
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since = 0
        self.refused = 0
        self.adoptions = 0

    def predict(self, parts: Mapping[str, float]) -> float:
        """The whole step of ``parts`` with the current fixed part (:func:`whole_step_seconds`)."""
        return whole_step_seconds(parts, self.fixed)

    def observe(
        self, step_seconds: float, busy_seconds: float, parts: Mapping[str, float]
    ) -> Profile | None:
        """Record one measured step (its wall clock, the busiest rank's micro-batch busy time and
        the plan's ``stats["step_parts"]``); a new profile when a refit is adopted, else None."""
        try:
            values = [float(step_seconds), float(busy_seconds)] + [float(parts[k]) for k in _NEEDED]
        except (KeyError, TypeError, ValueError):
            self.refused += 1
            return None
        wall, busy, sync, reduction, optimizer = values
        if not all(map(math.isfinite, values)) or min(values) < 0 or busy > wall:
            self.refused += 1
            return None
        self._steps.append((wall, busy, sync + reduction + optimizer))
        self._since += 1
        if self._since < self.refit_every or len(self._steps) < 3:
            return None
        self._since = 0
        return self._refit()

    def _refit(self) -> Profile | None:
        steps = np.asarray(self._steps, dtype=np.float64)
        held = max(len(steps) // 3, 1)
        fit, judge = steps[:-held], steps[-held:]
        wall, busy, outside = fit.T
        candidate = max(float(np.median(wall - busy - outside)), 0.0)
        if abs(candidate - self.fixed) <= self.min_change * max(self.fixed, 1e-12):
            return None
        if self._error(judge, candidate) >= self._error(judge, self.fixed):
            return None
        self.fixed = candidate
        self.adoptions += 1
        self.profile = with_fixed_seconds(self.profile, candidate)
        return self.profile

    @staticmethod
    def _error(steps: np.ndarray, fixed: float) -> float:
        """Median absolute log error of the predicted wall clocks: the busiest rank's measured
        micro-batches plus the predicted outside time with ``fixed``."""
        wall, busy, outside = steps.T
        predicted = np.maximum(busy + outside + fixed, 1e-12)
        return float(np.median(np.abs(np.log(wall / predicted))))
