"""Calibrate the whole step inside a training loop, and say how well it is predicted.

    calib = WholeStepCalibration(pool, load_profile("cpu-gloo"), ranks_per_node=2)
    for plan in plans:
        report = execute(plan, pool, step_fn); reduce_gradients(model, pool=pool); optim.step()
        seen = calib.step(plan, report, step_seconds=wall, busiest_seconds=max_busy)  # collective
        print(seen.predicted_seconds, seen.measured_seconds, seen.error)

A user's first sight of the cost model is the predicted step beside the measured one, so the
prediction must be of the whole step: the micro-batches (refitted online by
:class:`~dyncp.cost_model.calibration.OnlineCalibrator` through
:class:`~dyncp.runtime.measure.CollectiveCalibration`, the same version on every rank) plus what
the step pays outside them, the gradient reduction, the optimizer and whatever else
(:class:`~dyncp.cost_model.calibration.step_fit.StepFit`, fitted from the step's wall clock
minus its busiest rank's micro-batch busy time, on the fitting rank only: it changes no plan).

Each step is predicted *before* its own measurement is learnt from: the plan priced by the
current model version (``dyncp.cost_model.step_parts``), plus the current fixed part. So the
error printed is an honest out-of-sample one.
"""

from __future__ import annotations

from dataclasses import dataclass

from dyncp.cost_model.calibration import ModelVersion, OnlineCalibrator
from dyncp.cost_model.calibration.step_fit import StepFit, with_parameters
from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.schema import INTEGRATIONS, Profile
from dyncp.cost_model.step_parts import step_parts
from dyncp.plan import StepPlan
from dyncp.runtime.executor import RankReport
from dyncp.runtime.group_pool import GroupPool
from dyncp.runtime.measure import CollectiveCalibration

__all__ = ["StepSeen", "WholeStepCalibration"]


@dataclass(frozen=True, slots=True)
class StepSeen:
    """One step: its whole-step prediction (made before it was learnt from) and measurement.

    ``new_version`` is the cost-model version adopted after this step on every rank (None: no
    change); ``predicted_seconds`` and ``error`` are meaningful on the fitting rank only.
    ``predicted_busy_seconds`` is the part of the prediction that ``busy_seconds`` measures (the
    busiest rank's micro-batches), so an error can be told apart: micro-batches, or the rest.
    """

    predicted_seconds: float
    measured_seconds: float
    busy_seconds: float
    new_version: ModelVersion | None
    predicted_busy_seconds: float = float("nan")

    @property
    def error(self) -> float:
        """Relative error of the prediction, ``|predicted - measured| / measured``."""
        return abs(self.predicted_seconds - self.measured_seconds) / self.measured_seconds


class WholeStepCalibration:
    """Online calibration of micro-batches and of the per-step part (module docstring).

    Args:
        pool: the job's GroupPool.
        profile: the profile the job starts from.
        ranks_per_node: as the planner's.
        refit_every, min_measurements: the micro-batch calibrator's (``OnlineCalibrator``).
        integration: how the loop reduces gradients and updates (``schema.INTEGRATIONS``:
            ``ddp`` for ``reduce_gradients``, ``fsdp2-once`` for ``FSDPRunner``); default the
            profile's ``step.integration``.
        parameters: the trained model's trainable parameters, in place of the profile's count
            (the model it was profiled with): the reduction and the optimizer are priced for
            the model being trained.
    """

    def __init__(
        self,
        pool: GroupPool,
        profile: Profile,
        *,
        ranks_per_node: int,
        refit_every: int = 2,
        min_measurements: int = 8,
        integration: str | None = None,
        parameters: int | None = None,
    ) -> None:
        if integration is not None and integration not in INTEGRATIONS:
            raise ValueError(
                f"unknown integration {integration!r}; choose one of {', '.join(INTEGRATIONS)}"
            )
        if parameters is not None:
            profile = with_parameters(profile, parameters)
        self.ranks_per_node = ranks_per_node
        self.integration = integration
        self.start = profile
        calibrator = OnlineCalibrator(
            profile,
            ranks_per_node=ranks_per_node,
            refit_every=refit_every,
            min_measurements=min_measurements,
        )
        self.collective = CollectiveCalibration(pool, calibrator)
        self.fixed = StepFit(profile, refit_every=1, window=12)
        self._model = self.collective.current.model(ranks_per_node)

    @property
    def current(self) -> ModelVersion:
        return self.collective.current

    @property
    def calibrator(self) -> OnlineCalibrator:
        return self.collective.calibrator

    def step(
        self, plan: StepPlan, report: RankReport, *, step_seconds: float, busiest_seconds: float
    ) -> StepSeen:
        """Learn from one executed step (collective: every rank calls it after every step);
        ``busiest_seconds``: the largest ``busy_seconds`` of the step's ranks (the loop
        gathers them already)."""
        busiest = float(busiest_seconds)
        # The plan priced by the current version (a sampler's plan may carry an older one's).
        cost = evaluate_plan(plan, self._model)
        parts = step_parts(
            plan,
            self._model,
            planned_seconds=cost.step_seconds,
            priced=cost,
            integration=self.integration,
        )
        parts = parts.as_dict()
        predicted = self.fixed.predict(parts)
        if self.collective.is_fitter:
            self.fixed.observe(step_seconds, min(busiest, step_seconds), parts)
        new = self.collective.step(plan, report)
        if new is not None:
            self._model = new.model(self.ranks_per_node)
        busy = parts["planned"] - parts["synchronisation"]
        return StepSeen(predicted, step_seconds, busiest, new, busy)

    def summary(self) -> str:
        """What calibration changed, in one line (the fitting rank's view)."""
        cal = self.calibrator
        adopted = sum(1 for _, ok in cal.history if ok)
        first = cal.history[0][0].error_before if cal.history else float("nan")
        last = cal.history[-1][0].error_after if cal.history else float("nan")
        return (
            f"calibration: model v{self.current.version} after {cal.refits} refits "
            f"({adopted} adopted; micro-batch error {first:.1%} -> {last:.1%}); per-step part "
            f"outside micro-batches {self.fixed.initial_fixed:.3f} s -> {self.fixed.fixed:.3f} s "
            f"({self.fixed.adoptions} adoptions, {self.fixed.refused} steps refused)"
        )
