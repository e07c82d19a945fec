"""Calibrate the pipelined prediction from measured pipelined steps, with the ordinary refit.

A pipelined step (``dyncp.runtime.execute_pipeline``) measures, per slot, column and virtual
stage, the forward and backward compute of the micro-batch (``dyncp.runtime.pipeline_measure``
reduces the processes' timelines to a :class:`PipelineStepMeasurement`). The pipelined pricing
(``dyncp.cost_model.pipeline_timing``) cuts one micro-batch's cost-model seconds ``T`` into
those operations, and charges the micro-batch constant ``C`` once per virtual stage, so the
operations of a micro-batch sum to ``T + (Q - 1) C`` over its ``Q`` virtual stages. Calibration
therefore needs no new model and no free constant:

1. each micro-batch's operations, summed over its virtual stages, are one ordinary
   :class:`~dyncp.cost_model.calibration.Measurement` of ``T + (Q - 1) C``;
2. :func:`~dyncp.cost_model.calibration.fit_profile` refits the profile to them as it refits
   unpipelined micro-batches; its fitted constant is then the constant of a whole pass
   through all ``Q`` virtual stages, ``Q C``, so the pipelined profile takes ``C`` = the
   fitted constant / ``Q`` and prices each operation sum as the fit does (exact: the fit's
   ``T_fit = rest + Q C`` is the pricing's ``T + (Q - 1) C`` with ``T = rest + C``);
3. the stage-to-stage transfer on this machine is measured too, not taken from the ring's
   link: a hand-off whose receiver was already waiting when its send was posted took
   ``ready - posted`` (one monotonic clock on a machine), and
   :func:`fit_p2p` fits ``latency + bytes / bandwidth`` to those (robust, soft-L1).

The cut between forward and backward and between stages is the pricing's (its stated
assumptions); calibration corrects the level and the shape over lengths and CP sizes, not that
cut: the bench (``bench/pipeline_measured.py``) reports how far the measured bubble is from the
predicted one, which is where the cut shows. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from dyncp.cost_model.calibration.fit import CalibrationResult, fit_profile
from dyncp.cost_model.calibration.measurements import CalibrationError, Measurement
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.pipeline_schedule import PipelineCost
from dyncp.cost_model.pipeline_timing import price_pipeline, stage_costs
from dyncp.cost_model.schema import Profile
from dyncp.plan import StepPlan

__all__ = [
    "HopMeasurement",
    "PipelineCalibration",
    "PipelineStepMeasurement",
    "calibrate_pipeline",
    "fit_p2p",
    "predict_step",
]

#: Fewest waited-for hand-offs from which a transfer cost is fitted.
MIN_HOPS = 4


@dataclass(frozen=True, slots=True)
class HopMeasurement:
    """One stage-to-stage hand-off whose receiver was waiting: its bytes and seconds."""

    bytes: float
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineStepMeasurement:
    """One executed pipelined step, measured (``dyncp.runtime.pipeline_measure``).

    ``forward[j, w, q]`` / ``backward[j, w, q]``: compute seconds of slot ``j``'s operation on
    column ``w`` at virtual stage ``q`` (its group's fastest member: the one that did not wait in
    the ring for the others; 0 where the column is idle), as ``StageCosts`` predicts them;
    ``busy[s, w]``: compute seconds of process (s, w); ``step_seconds``: first operation's start
    to the last send's completion over the grid; ``microbatches``: one Measurement per group
    per slot (its operations summed); ``hops``: the hand-offs whose receiver waited.
    """

    forward: np.ndarray
    backward: np.ndarray
    busy: np.ndarray
    step_seconds: float
    microbatches: tuple[Measurement, ...]
    hops: tuple[HopMeasurement, ...]

    @property
    def bubble_fraction(self) -> float:
        """``1 - compute / (step x processes)``: the prediction's definition, measured."""
        total = self.step_seconds * self.busy.size
        return 1.0 - float(self.busy.sum()) / total if total > 0 else 0.0


def fit_p2p(hops: Sequence[HopMeasurement]) -> tuple[float, float]:
    """``(latency, bandwidth)`` of a hand-off, fitted to ``hops``: ``seconds = latency + bytes /
    bandwidth``, soft-L1 on the relative residual (a descheduled receiver is a straggler, not a
    slower link), both terms >= 0. Where the bytes explain nothing (transfers so small that
    latency is all of them) the bandwidth is 1e18 B/s, i.e. not resolved: the fitted latency
    prices them. Fewer than MIN_HOPS hand-offs: CalibrationError."""
    if len(hops) < MIN_HOPS:
        raise CalibrationError(
            f"{len(hops)} waited-for hand-offs measured; at least {MIN_HOPS} are needed to fit "
            "the stage-to-stage transfer"
        )
    b = np.array([h.bytes for h in hops], dtype=np.float64)
    t = np.array([h.seconds for h in hops], dtype=np.float64)
    lat0 = float(np.median(t))
    inv0 = lat0 / max(float(np.median(b)), 1.0)  # natural scales: each term alone explains it

    def residual(x: np.ndarray) -> np.ndarray:
        return (x[0] * lat0 + x[1] * inv0 * b) / t - 1.0

    fit = least_squares(residual, [0.5, 0.5], bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.05)
    latency, inverse = float(fit.x[0] * lat0), float(fit.x[1] * inv0)
    return latency, (1.0 / inverse if inverse > 0 else 1e18)


@dataclass(frozen=True, slots=True)
class PipelineCalibration:
    """A profile refitted to pipelined steps and the measured hand-off link.

    ``p2p``: ``((latency, bandwidth), (latency, bandwidth))`` for ``stage_costs(p2p=...)``, the
    same link intra- and inter-node (one machine measured); ``fit``: the refit's report.
    """

    profile: Profile
    p2p: tuple[tuple[float, float], tuple[float, float]]
    fit: CalibrationResult


def calibrate_pipeline(
    profile: Profile,
    steps: Sequence[PipelineStepMeasurement],
    *,
    model_stages: int,
    ranks_per_node: int,
    min_measurements: int = 8,
) -> PipelineCalibration:
    """Refit ``profile`` to measured pipelined ``steps`` of ``model_stages`` virtual stages
    (module docstring) and fit the hand-off link from their waited-for hand-offs.

    Raises:
        CalibrationError: too few micro-batches or hand-offs, or ``model_stages`` < 1.
    """
    if isinstance(model_stages, bool) or not isinstance(model_stages, int) or model_stages < 1:
        raise CalibrationError(f"model_stages must be an integer >= 1, got {model_stages!r}")
    ms = [m for step in steps for m in step.microbatches]
    fit = fit_profile(
        profile,
        ms,
        ranks_per_node=ranks_per_node,
        min_measurements=min_measurements,
        source=f"pipelined steps ({len(steps)}), operations summed over {model_stages} stages",
    )
    fitted = fit.profile
    per_pass = fitted.overheads.microbatch_seconds / model_stages
    overheads = fitted.overheads.model_copy(update={"microbatch_seconds": per_pass})
    pipelined = fitted.model_copy(update={"overheads": overheads})
    link = fit_p2p([h for step in steps for h in step.hops])
    return PipelineCalibration(pipelined, (link, link), fit)


def predict_step(
    plan: StepPlan,
    model: CostModel,
    p2p: Sequence[tuple[float, float]] | None = None,
) -> PipelineCost:
    """The pipelined price of ``plan`` under ``model``, hand-offs on ``p2p`` (default: the
    profile's links)."""
    return price_pipeline(plan, model, costs=stage_costs(plan, model, p2p=p2p))
