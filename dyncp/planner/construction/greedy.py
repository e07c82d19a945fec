"""dyncp's constructor: a good plan in milliseconds, driven by the real cost model; anytime.

The structure of a good plan matters more than where each short sequence goes
(notes/planner-findings.md), so every candidate decides the structure first. Candidates, in
order of promise (``candidates``), each priced with the exact cost model:

1. the structure search's best structures (``dyncp.planner.construction.structure``: waves, groups
   -- which may stack several long sequences -- and CP sizes of the long sequences, priced with a
   fluid model; searched again with the short sequences the best one has no room for, or that its
   realisation left above a wave's fluid level (``overshoot``), placed as long ones), realised
   by ``fill``: long sequences in their groups, the longest short ones that run
   efficiently on a ring into the rings' room, the rest poured up to the fluid levels, slots
   charged the passes their tokens need;
2. stretch-rule structures (``build``): CP size per sequence = the cheapest in rank-seconds,
   raised while the sequence alone would outlast ``stretch`` x the ideal step and a larger group
   is faster (or doubled ``boost`` times); long sequences first-fit into groups up to a level,
   groups laid into waves largest first (aligned blocks); short sequences poured into the spare
   time under each wave's level, the rest into a final wave balanced by LPT;
3. level-filled structures (``build_level``): each sequence at the smallest size whose time fits
   a common level, long ones first-fit into groups of their size in the earliest wave with room.

Every group's sequences are packed first-fit-decreasing into micro-batches within capacity.
``best`` prices candidates until the deadline (or all of them without one: deterministic, ties
broken by index), then runs the local search on the fastest. Candidates are priced under
``timing`` (default dataflow: no barrier between waves, ``dyncp.cost_model.evaluate``); under
dataflow each is also tried re-laid out (``dyncp.planner.construction.dataflow``) and the barrier's
pick is searched too (``best``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from dyncp.cost_model.evaluate import PlanCost, evaluate_plan, time_waves
from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan, Topology
from dyncp.planner.construction.assignment import Assignment
from dyncp.planner.construction.dataflow import relayout
from dyncp.planner.construction.level import LEVEL_FACTORS, LevelCandidates
from dyncp.planner.construction.local_search import improve
from dyncp.planner.construction.stretch import STRUCTURES
from dyncp.planner.construction.structured import StructuredCandidates

__all__ = ["greedy_plan", "GreedyConstructor"]

# Share of the time to the deadline spent pricing candidates; the local search gets the rest.
CANDIDATE_SHARE = 0.85
# How many of LEVEL_FACTORS are tried right after the first structure (they win most often).
EARLY_LEVELS = 5


class GreedyConstructor(StructuredCandidates, LevelCandidates):
    """Builds candidate plans for one batch; ``best()`` returns the fastest.

    Args:
        lengths: sequence lengths of the step.
        topology: ranks and capacity.
        model: the cost model used both to choose and to price.
        structures: (stretch, boost) pairs tried, see ``choose_sizes``.
        timing: how candidates are timed and compared (``dyncp.cost_model.evaluate.TIMINGS``).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        topology: Topology,
        model: CostModel,
        structures: tuple[tuple[float, int], ...] = STRUCTURES,
        *,
        timing: str = "dataflow",
    ) -> None:
        super().__init__(lengths, topology, model, timing=timing)
        self.structures = structures

    def candidates(self) -> Iterator[StepPlan]:
        """Candidate plans, most promising first (measured: notes in docs/planner.md), so an
        anytime caller that stops early has already seen the likely winners."""
        ideal = self.ideal_seconds()
        first, rest = LEVEL_FACTORS[:EARLY_LEVELS], LEVEL_FACTORS[EARLY_LEVELS:]
        yield from self.structured(self.deadline)
        seen: set[bytes] = set()
        for n, (stretch, boost) in enumerate(self.structures):
            k = self.choose_sizes(stretch, boost)
            key = k.tobytes()
            if key not in seen:
                seen.add(key)
                for level in self.levels(k):
                    yield self.build(k, level)
            if n == 0:
                for f in first:
                    yield self.build_level(ideal * f)
        for f in rest:
            yield self.build_level(ideal * f)

    def best(self, deadline: float | None = None) -> StepPlan:
        """The fastest candidate under the cost model and ``timing`` (first one on ties).

        Anytime: with a ``deadline`` (``time.perf_counter()`` seconds) it stops pricing
        candidates when the next one, as slow as the last, would end past ``CANDIDATE_SHARE`` of
        the time left (the first is always priced), then runs
        the local search (``dyncp.planner.construction.local_search``) on the best until the
        deadline, and returns the best so far; ``tried`` counts the candidates priced. Without a
        deadline it prices them all and bounds the local search by rounds only (deterministic).

        Under the dataflow timing every candidate is also tried re-laid out
        (``dyncp.planner.construction.dataflow.relayout``: the same groups on the ranks free first;
        priced by the re-layout itself, no cost-model call), and the candidate the barrier timing
        would pick is kept beside the dataflow best: the local search (whose additive objective
        is the barrier's) runs on both, the second half of the time on the barrier pick, and
        the fastest of them all under dataflow wins. So in deterministic mode the result is
        never slower, timed as dataflow, than what the barrier objective would have returned.
        """
        self.tried = 0
        self.moves = 0
        if len(self.lengths) == 0:
            return StepPlan(self.topology, (), (), policy="dyncp")
        stop = None
        if deadline is not None:
            now = time.perf_counter()
            stop = now + CANDIDATE_SHARE * max(deadline - now, 0.0)
        self.deadline = stop
        dataflow = self.timing == "dataflow"
        best: tuple[float, StepPlan] | None = None
        picked: StepPlan | None = None  # the candidate ``best`` was made from (re-laid out)
        barrier: tuple[float, StepPlan] | None = None  # dataflow only: the barrier's pick
        last = time.perf_counter()
        for plan in self.candidates():
            cost = evaluate_plan(plan, self.model, timing=self.timing)
            self.tried += 1
            seconds = cost.step_seconds
            candidate = plan
            if dataflow:
                flat = np.concatenate([np.asarray(s) for s in cost.microbatch_seconds])
                wall = time_waves(
                    plan, flat, self.model.wave_overhead, timing="barrier"
                ).step_seconds
                if barrier is None or wall < barrier[0]:
                    barrier = (wall, plan)
                seconds, plan = self._relaid(plan, cost)
            if best is None or seconds < best[0]:
                best = (seconds, plan)
                picked = candidate
            now = time.perf_counter()
            # Stop when the next candidate, if it takes as long as this one, would end late.
            if stop is not None and now + (now - last) >= stop:
                break
            last = now
        assert best is not None
        # The local search from the dataflow pick and from the barrier's (once when they are the
        # same candidate: from the candidate as built, which is what the barrier would search).
        starts = [best[1]]
        if barrier is not None:
            starts = [barrier[1]] if barrier[1] is picked else [best[1], barrier[1]]
        for n, start in enumerate(starts):
            until = deadline
            if deadline is not None and n == 0 and len(starts) > 1:
                until = time.perf_counter() + 0.5 * max(deadline - time.perf_counter(), 0.0)
            found = self._searched(start, until)
            if found is not None and found[0] < best[0]:
                best = found
        return best[1]

    def _relaid(self, plan: StepPlan, cost: PlanCost) -> tuple[float, StepPlan]:
        """Dataflow seconds and plan: ``plan`` or its re-layout, whichever is faster."""
        relaid = relayout(plan, cost, self.model.wave_overhead)
        if relaid is not None and relaid[0] < cost.step_seconds:
            return relaid
        return cost.step_seconds, plan

    def _searched(self, plan: StepPlan, deadline: float | None) -> tuple[float, StepPlan] | None:
        """The local search's plan from ``plan`` and its seconds (re-laid out under dataflow), or
        None when it moved nothing or its slots no longer pack into micro-batches."""
        moved, moves = improve(Assignment.from_plan(plan, self.costs), deadline)
        self.moves += moves
        if not moves:
            return None
        try:
            plan = moved.to_plan(plan)
        except ValueError:  # a slot whose sequences no longer pack into micro-batches
            return None
        cost = evaluate_plan(plan, self.model, timing=self.timing)
        if self.timing == "dataflow":
            return self._relaid(plan, cost)
        return cost.step_seconds, plan


def greedy_plan(lengths: np.ndarray, topology: Topology, model: CostModel) -> StepPlan:
    """dyncp's greedy plan for one step (see the module docstring)."""
    return GreedyConstructor(lengths, topology, model).best()
