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

__all__ = ["PlanCost", "evaluate_plan", "time_waves"]


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
    """Predicted cost of ``plan`` under ``model`` (the plan is assumed valid).

    Micro-batches are priced in one vectorised call per group layout (CP size and head split),
    so pricing a plan of thousands of sequences costs about as much as a handful of
    microbatch_seconds calls.
    """
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    # Flatten: for every micro-batch its group layout (CP size, head split) and its slice of the
    # concatenated ids.
    layouts: list[tuple[int, int]] = []
    ids: list[int] = []
    starts: list[int] = []
    for wave in plan.waves:
        for group in wave.groups:
            for mb in group.microbatches:
                layouts.append((group.size, group.heads))
                starts.append(len(ids))
                ids.extend(mb.seq_ids)
    mb_starts = np.asarray(starts, dtype=np.int64)
    ends = np.append(mb_starts[1:], len(ids))
    flat = lengths[np.asarray(ids, dtype=np.int64)] if ids else lengths[:0]
    seconds = np.zeros(len(layouts))
    by_layout: dict[tuple[int, int], list[int]] = {}
    for j, key in enumerate(layouts):
        by_layout.setdefault(key, []).append(j)
    for (cp, heads), sel in sorted(by_layout.items()):
        parts = [flat[mb_starts[j] : ends[j]] for j in sel]
        sub_starts = np.cumsum([0] + [len(x) for x in parts[:-1]])
        # The head split is passed only when there is one: plug-in models without it still work.
        split = {"heads": heads} if heads > 1 else {}
        seconds[sel] = model.packs_seconds(cp, np.concatenate(parts), sub_starts, **split)
    return time_waves(plan, seconds, model.wave_overhead)


def time_waves(plan: StepPlan, seconds: np.ndarray, wave_overhead: float) -> PlanCost:
    """Step and rank times from each micro-batch's seconds, given in plan order.

    A wave lasts as long as its slowest group (the sum of the group's micro-batches) plus the
    wave overhead; a rank is busy for the micro-batches of its groups. Shared by the prediction
    and by anything that re-times a plan with other per-micro-batch seconds.
    """
    busy = np.zeros(plan.topology.world)
    waves = []
    per_mb: list[tuple[float, ...]] = []
    j = 0
    for wave in plan.waves:
        slowest = 0.0
        first = j
        for group in wave.groups:
            n = len(group.microbatches)
            t = float(seconds[j : j + n].sum())
            j += n
            busy[group.start : group.start + group.size] += t
            slowest = max(slowest, t)
        waves.append(slowest + wave_overhead)
        per_mb.append(tuple(float(x) for x in seconds[first:j]))
    return PlanCost(float(sum(waves)), tuple(waves), busy, tuple(per_mb))
