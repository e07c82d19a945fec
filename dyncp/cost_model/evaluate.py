"""Price a StepPlan with a CostModel: step seconds, per-rank busy time and imbalance.

Step seconds = sum over waves of (slowest group's summed micro-batch seconds + wave overhead).
A rank's busy time is the sum of the micro-batches it takes part in; imbalance is the busiest
rank's time over the mean (DESIGN.md), and ``efficiency`` = mean busy / step seconds shows how much
of the step the ranks actually work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan

__all__ = ["PlanCost", "evaluate_plan"]


@dataclass(frozen=True, slots=True)
class PlanCost:
    step_seconds: float
    wave_seconds: tuple[float, ...]
    rank_busy_seconds: np.ndarray
    microbatch_seconds: tuple[tuple[float, ...], ...]  # per wave, in group-then-micro-batch order

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_busy_seconds.mean())
        return float(self.rank_busy_seconds.max()) / mean if mean > 0 else 1.0

    @property
    def efficiency(self) -> float:
        return (
            float(self.rank_busy_seconds.mean()) / self.step_seconds if self.step_seconds else 1.0
        )


def evaluate_plan(plan: StepPlan, model: CostModel) -> PlanCost:
    """Predicted cost of ``plan`` under ``model`` (the plan is assumed valid)."""
    busy = np.zeros(plan.topology.world)
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    waves = []
    per_mb: list[tuple[float, ...]] = []
    for wave in plan.waves:
        slowest = 0.0
        times = []
        for group in wave.groups:
            t = 0.0
            for mb in group.microbatches:
                s = model.microbatch_seconds(group.size, lengths[list(mb.seq_ids)])
                times.append(s)
                t += s
            busy[group.start : group.start + group.size] += t
            slowest = max(slowest, t)
        waves.append(slowest + model.wave_overhead)
        per_mb.append(tuple(times))
    return PlanCost(float(sum(waves)), tuple(waves), busy, tuple(per_mb))
