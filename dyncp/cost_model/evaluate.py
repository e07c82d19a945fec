"""Price a StepPlan with a CostModel: step seconds, per-rank busy time and imbalance.

Two timings of the same plan (``TIMINGS``):

- ``"barrier"``: every wave ends together. Step seconds = sum over waves of (the slowest group's
  summed micro-batch seconds + the wave overhead). This is how dyncp's runtime ran before it
  became dataflow, and how a runtime with a collective between micro-batches still runs.
- ``"dataflow"``: no barrier between waves. Each rank runs its groups in wave order, and a group
  starts when its last member is free (its first collective cannot complete earlier); it then
  takes the wave overhead (the switch to its communicator) plus its summed micro-batch seconds.
  Step seconds = when the last rank is free. ``dyncp.runtime.execute`` runs plans this way, so
  it is the default everywhere (planner, simulator, benches).

Dataflow is never slower than barrier for the same plan and seconds: by induction over waves,
a group starts no later than its wave would start under the barrier, and it ends no later than
that wave's end (start + overhead + its own time <= start + overhead + the slowest group's).

A rank's busy time is the sum of the micro-batches it takes part in (overheads excluded) under
both timings; imbalance is the busiest rank's time over the mean (DESIGN.md), and
``efficiency`` = mean busy / step seconds shows how much of the step the ranks actually work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan

__all__ = ["PlanCost", "TIMINGS", "check_timing", "evaluate_plan", "time_waves"]

#: How a plan's waves are timed (see the module docstring).
TIMINGS = ("barrier", "dataflow")


def check_timing(timing: str) -> str:
    """``timing`` if it is one of ``TIMINGS``, else a ValueError naming the allowed values."""
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; choose one of {', '.join(TIMINGS)}")
    return timing


@dataclass(frozen=True, slots=True)
class PlanCost:
    """A plan's predicted (or re-timed) cost.

    ``wave_seconds[w]`` is how much wave ``w`` moves the step's finish line: under barrier the
    wave's length, under dataflow the increase of the latest group end over the previous waves'.
    Either way they sum to ``step_seconds``. ``group_spans[w][g]`` is group ``g`` of wave ``w``'s
    (start, end) in seconds from the step's start, overhead included.
    """

    step_seconds: float
    wave_seconds: tuple[float, ...]
    rank_busy_seconds: np.ndarray
    microbatch_seconds: tuple[tuple[float, ...], ...]  # per wave, in group-then-micro-batch order
    group_spans: tuple[tuple[tuple[float, float], ...], ...] = ()
    timing: str = "barrier"

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_busy_seconds.mean())
        return float(self.rank_busy_seconds.max()) / mean if mean > 0 else 1.0

    @property
    def efficiency(self) -> float:
        return (
            float(self.rank_busy_seconds.mean()) / self.step_seconds if self.step_seconds else 1.0
        )


def evaluate_plan(plan: StepPlan, model: CostModel, *, timing: str = "dataflow") -> PlanCost:
    """Predicted cost of ``plan`` under ``model`` (the plan is assumed valid), timed as ``timing``.

    Micro-batches are priced in one vectorised call per group layout (CP size and head split),
    so pricing a plan of thousands of sequences costs about as much as a handful of
    microbatch_seconds calls.
    """
    check_timing(timing)
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
    return time_waves(plan, seconds, model.wave_overhead, timing=timing)


def time_waves(
    plan: StepPlan, seconds: np.ndarray, wave_overhead: float, *, timing: str = "dataflow"
) -> PlanCost:
    """Step and rank times from each micro-batch's seconds, given in plan order.

    Under ``"barrier"`` a wave lasts as long as its slowest group (the sum of the group's
    micro-batches) plus the wave overhead; under ``"dataflow"`` a group starts when its last
    member is free and pays the overhead once (module docstring). A rank is busy for the
    micro-batches of its groups. Shared by the prediction and by anything that re-times a plan
    with other per-micro-batch seconds (the simulator's synthetic measurements, calibration).
    """
    check_timing(timing)
    busy = np.zeros(plan.topology.world)
    free = np.zeros(plan.topology.world)  # dataflow: when each rank finishes its last group
    finish = 0.0  # the latest group end so far (barrier: the end of the previous wave)
    waves: list[float] = []
    spans: list[tuple[tuple[float, float], ...]] = []
    per_mb: list[tuple[float, ...]] = []
    j = 0
    for wave in plan.waves:
        first = j
        wave_spans = []
        wave_end = finish
        slowest = 0.0
        for group in wave.groups:
            n = len(group.microbatches)
            t = float(seconds[j : j + n].sum())
            j += n
            ranks = slice(group.start, group.start + group.size)
            busy[ranks] += t
            if timing == "barrier":
                slowest = max(slowest, t)
                wave_spans.append((finish, finish + t))
            else:
                start = float(free[ranks].max())
                end = start + wave_overhead + t
                free[ranks] = end
                wave_end = max(wave_end, end)
                wave_spans.append((start, end))
        # Barrier: the wave's length as before (bit-for-bit); dataflow: how far it moved the end.
        length = slowest + wave_overhead if timing == "barrier" else wave_end - finish
        waves.append(length)
        finish = finish + length if timing == "barrier" else wave_end
        spans.append(tuple(wave_spans))
        per_mb.append(tuple(float(x) for x in seconds[first:j]))
    return PlanCost(finish, tuple(waves), busy, tuple(per_mb), tuple(spans), timing)
