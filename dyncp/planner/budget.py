"""A planning budget that follows the step: a stated share of the predicted step time.

A fixed ``time_limit`` is wrong at both ends: 0.1 s is all a 50 ms step can spare, but a step of
several seconds leaves CP-SAT the time to close most of the greedy plan's gap (issue 24: on a
long-document scenario whose steps last 2.8-5.6 s, 1 s instead of 0.1 s made the plans 3.1%
faster). A :class:`StepBudget` turns the predicted step into the time its planning may take:

    seconds = clamp(share x predicted step seconds, floor, cap)

The prediction is the batch's closed-form lower bound (``dyncp.planner.bounds.closed_form``:
microseconds to compute, a pure function of the batch; the plans the planner finds are 1-4% above it
on the bench's dense scenarios, up to 20% on sparse ones, so the budget errs low). It is known
before planning starts, so the whole pipeline runs within the budget, anytime: the greedy
constructor first (candidates in order of promise, then its local search), then CP-SAT for what is
left; the best plan so far is kept, and a solver that runs out of time returns its best plan.

Defaults (``share=0.25``, ``cap=2.0``, ``floor=0.1``) -- why:

- **share 0.25.** The plan service plans on one thread, ``lookahead`` steps ahead; to keep up it
  must plan a step in less than a step, and the thread shares the training rank's CPU and its
  Python interpreter (the GIL) with the data loader and the training loop. A quarter of each
  step keeps three quarters of that core for them and still absorbs a burst (a calibration
  version change, a slow batch) of three times the usual planning time before the lookahead
  drains. ``OnlinePlanner`` plans step k+1 while step k trains: a quarter of the step leaves the
  plan ready well before it is needed even when the next batch arrives late in the step.
- **cap 2 s.** Past about a second CP-SAT's improvements flatten (``bench/planner_bench.py
  --budgets 0.1,0.3,1,3`` prints the gap against the budget), while a plan that takes longer
  leaves a reader that catches up with the service (a restart, a slow step) more steps to fall
  back on.
- **floor 0.1 s.** Today's default: no step is planned with less.

Deterministic mode: the prediction is a pure function of the batch, so ``seconds`` is too; the
construction tries every candidate whatever the budget, and CP-SAT runs with that many
*deterministic* time units (``max_deterministic_time``) and one worker. The budget is never read
from a clock there, so every rank computes the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StepBudget", "DEFAULT_STEP_BUDGET"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBudget:
    """How long to plan a step, as a share of its predicted duration.

    Args:
        share: seconds of planning per second of predicted step (0 < share <= 1).
        cap: at most this many seconds per step (>= floor).
        floor: at least this many seconds per step (> 0).

    Raises:
        ValueError: a value outside the ranges above (or not finite).
    """

    share: float = 0.25
    cap: float = 2.0
    floor: float = 0.1

    def __post_init__(self) -> None:
        for name in ("share", "cap", "floor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"StepBudget.{name} must be a finite number, got {value!r}")
        if not 0 < self.share <= 1:
            raise ValueError(f"StepBudget.share must be in (0, 1], got {self.share}")
        if not self.floor > 0:
            raise ValueError(f"StepBudget.floor must be > 0 seconds, got {self.floor}")
        if not self.cap >= self.floor:
            raise ValueError(f"StepBudget.cap ({self.cap}) must be >= floor ({self.floor}) seconds")

    def seconds(self, predicted_step_seconds: float) -> float:
        """The budget of a step predicted to take ``predicted_step_seconds``.

        Raises:
            ValueError: a negative or non-finite prediction.
        """
        if not math.isfinite(predicted_step_seconds) or predicted_step_seconds < 0:
            raise ValueError(
                f"predicted_step_seconds must be finite and >= 0, got {predicted_step_seconds}"
            )
        return min(max(self.share * predicted_step_seconds, self.floor), self.cap)


#: The budget the plan service and ``OnlinePlanner`` use unless given another.
DEFAULT_STEP_BUDGET = StepBudget()
