"""Price a plan as lockstep passes: what a step takes when collectives span every rank every pass.

Under FSDP2 full sharding each pass all-gathers and reduce-scatters every unit over all ranks, so
the ranks run the plan's passes (``dyncp.plan.passes``) in lockstep: the k-th pass of every rank
ends together, and it lasts as long as its busiest rank's micro-batch plus the collectives that
micro-batch's compute cannot hide (``dyncp.cost_model.sharding``). An empty pass computes nothing,
so a pass of empty passes only pays its collectives. The step::

    sum over waves ( wave overhead + sum over the wave's passes  pass_seconds(max compute) )

A pass's compute is the largest micro-batch seconds (the cost model's) among the groups that run
their p-th micro-batch there. This is neither of ``dyncp.cost_model.evaluate``'s timings: ranks
do not run ahead of each other (as under ``"dataflow"``), and a group's micro-batches do not sum
(as under ``"barrier"``); it is at least the barrier price of the same plan when the collectives
are free (a sum of maxima is at least the maximum of sums), and more by what they expose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.sharding import ShardingCost
from dyncp.plan import StepPlan, pass_schedule

__all__ = ["PassCost", "pass_compute", "price_passes"]


@dataclass(frozen=True, slots=True)
class PassCost:
    """A plan priced as passes (module docstring)."""

    step_seconds: float
    pass_seconds: tuple[float, ...]  # each pass, in execution order
    pass_compute: tuple[float, ...]  # each pass's busiest micro-batch (0: every rank empty)
    per_wave: tuple[int, ...]  # passes in each wave
    empty: int  # empty rank-passes

    @property
    def passes(self) -> int:
        return len(self.pass_seconds)

    @property
    def exposed_seconds(self) -> float:
        """What the collectives add over the passes' compute."""
        return float(sum(self.pass_seconds) - sum(self.pass_compute))


def pass_compute(plan: StepPlan, microbatch_seconds: tuple[tuple[float, ...], ...]) -> list[float]:
    """Each pass's busiest micro-batch seconds, from the seconds of every micro-batch per wave in
    group-then-micro-batch order (``PlanCost.microbatch_seconds``)."""
    out: list[float] = []
    for wave, seconds in zip(plan.waves, microbatch_seconds):
        count = max((len(g.microbatches) for g in wave.groups), default=0)
        busiest = [0.0] * count
        j = 0
        for group in wave.groups:
            for p in range(len(group.microbatches)):
                busiest[p] = max(busiest[p], seconds[j])
                j += 1
        out += busiest
    return out


def price_passes(
    plan: StepPlan, model: CostModel, sharding: ShardingCost | None = None
) -> PassCost:
    """``plan`` priced as lockstep passes under ``model``; ``sharding`` prices each pass's
    collectives (``None``: free, a pass lasts its busiest micro-batch)."""
    priced = evaluate_plan(plan, model, timing="barrier")
    compute = pass_compute(plan, priced.microbatch_seconds)
    if sharding is None:
        seconds = compute
    else:  # ``reduce="once"``: only the last pass reduce-scatters
        n = len(compute)
        seconds = [
            sharding.pass_seconds(t, scatter=sharding.scatters(p, n)) for p, t in enumerate(compute)
        ]
    schedule = pass_schedule(plan)
    step = float(np.sum(seconds)) + len(plan.waves) * model.wave_overhead
    return PassCost(step, tuple(seconds), tuple(compute), schedule.per_wave, schedule.empty)
