"""The planner's stages around the search: the construction each policy runs, and the improvements.

``Planner.plan`` (``planner``) runs a pipeline with a deadline; its stages are here, as methods
of ``PlannerStages``, the base of ``Planner``: ``_construct`` (the constructor of each policy,
two constructions with half the time each for a menu whose sizes do not nest and for head
splits), then ``_run_layout``, ``_run_cpsat`` and ``_run_improver``, each of whose plans is kept
only when it is valid and predicted faster (``_keep_better``). The state they read (the model,
topology, policy, solvers, time limits) is the ``Planner``'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np

from dyncp.cost_model.evaluate import PlanCost, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import PlanError, StepPlan, Topology
from dyncp.planner.baselines.dp_balanced import dp_balanced_plan
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.static import batch_adaptive_plan, fixed_cp_plan
from dyncp.planner.config import HYBRID_POLICY, Improver
from dyncp.planner.construction.assignment import Assignment
from dyncp.planner.construction.greedy import GreedyConstructor
from dyncp.planner.improvement.cpsat import CpSatImprover
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits
from dyncp.planner.improvement.laminar import LaminarImprover

__all__ = ["LAYOUT_SHARE", "PlannerStages", "nested_core"]

log = logging.getLogger(__name__)

#: Share of what is left after the constructor that the layout search
#: (``dyncp.planner.improvement.laminar``, batches of at most ``LAYOUT_MAX_SEQUENCES``) may take
#: before CP-SAT on the slots gets the rest.
LAYOUT_SHARE = 0.6


def _halfway(deadline: float | None) -> float | None:
    """Half of the time from now to ``deadline`` (``time.perf_counter()`` seconds), or None."""
    if deadline is None:
        return None
    now = time.perf_counter()
    return now + max(deadline - now, 0.0) / 2


def nested_core(topology: Topology) -> Topology | None:
    """The topology on the menu's powers of two when the menu's sizes do not nest (some size
    does not divide the next), else None: what ``Planner`` also constructs on such a menu."""
    sizes = topology.group_sizes
    if all(b % a == 0 for a, b in zip(sizes, sizes[1:])):
        return None
    core = tuple(c for c in sizes if c & (c - 1) == 0)
    if len(core) < 2:
        return None
    return Topology(topology.world, topology.ranks_per_node, topology.capacity, core)


class PlannerStages:
    """The construction and improvement stages of ``Planner`` (module docstring)."""

    model: CostModel
    topology: Topology
    policy: str
    timing: str
    time_limit: float
    deterministic: bool
    static_cp: int | None
    cpsat: CpSatImprover | None
    layout: LaminarImprover | None
    min_improve_seconds: float
    improver: Improver | None
    solver_status_counts: Counter[str]
    _envelope: SplitEnvelope | None

    # ------------------------------------------------------------------------------ stages
    def _construct(
        self, lengths: np.ndarray, deadline: float | None = None
    ) -> tuple[StepPlan, GreedyConstructor | None]:
        topo, model = self.topology, self.model
        if self.policy == "dp-balanced":
            assert self.static_cp is not None
            return dp_balanced_plan(lengths, topo, self.static_cp), None
        if self.policy == "static":
            assert self.static_cp is not None
            return fixed_cp_plan(lengths, topo, model, self.static_cp), None
        if self.policy == "batch-adaptive":
            return batch_adaptive_plan(lengths, topo, model, timing=self.timing), None
        if self.policy == "megatron":
            return megatron_plan(lengths, topo), None
        if self.policy == HYBRID_POLICY:
            return self._construct_hybrid(lengths, deadline)
        core = nested_core(topo)
        if core is not None:
            return self._construct_menu(lengths, core, deadline)
        greedy = GreedyConstructor(lengths, topo, model, timing=self.timing)
        return greedy.best(deadline=deadline), greedy

    def _construct_menu(
        self, lengths: np.ndarray, core: Topology, deadline: float | None
    ) -> tuple[StepPlan, GreedyConstructor]:
        """A menu whose sizes do not nest (``dyncp.plan.menu``: 8 and 9 on an NVL72): two
        constructions, each with half of the time, one on the menu and one on its powers of two
        (which nest); the faster wins, as a plan of the menu's topology.

        The search is heuristic, so a larger menu can lead it elsewhere; with its powers of two
        constructed too, dyncp on a menu is never slower than dyncp on those powers of two in
        deterministic mode (the same construction); with a wall-clock deadline, than that
        construction with half the time. The powers of two are skipped when they cannot hold
        the batch's longest sequence.
        """
        half = _halfway(deadline)
        menu = GreedyConstructor(lengths, self.topology, self.model, timing=self.timing)
        plan = menu.best(deadline=half)
        if len(lengths) and core.min_cp(int(lengths.max())) is None:
            return plan, menu
        nested = GreedyConstructor(lengths, core, self.model, timing=self.timing)
        other = nested.best(deadline=deadline)
        menu.tried += nested.tried
        if self._seconds(other, self.model) < self._seconds(plan, self.model):
            other.topology = self.topology
            other.stats["construction"] = "powers-of-two"
            return other, menu
        plan.stats["construction"] = "menu"
        return plan, menu

    def _construct_hybrid(
        self, lengths: np.ndarray, deadline: float | None
    ) -> tuple[StepPlan, GreedyConstructor]:
        """Two constructions, each with half of the time: one priced as rings (what ``dyncp``
        builds), one priced at every CP size's cheapest split; the faster once every group has
        its best split wins.

        The ring-priced plan with its splits chosen is never slower than it is as rings (u = 1
        is a split), so the hybrid policy never ends slower than the ring-only construction it
        contains: the same plan as ``dyncp`` in deterministic mode; with a wall-clock deadline,
        ``dyncp``'s construction with half the time.
        """
        half = _halfway(deadline)
        ring = GreedyConstructor(lengths, self.topology, self.model, timing=self.timing)
        split = GreedyConstructor(lengths, self.topology, self.search_model, timing=self.timing)
        ring_plan = ring.best(deadline=half)
        split_plan = split.best(deadline=deadline)
        ring_seconds, split_seconds = (
            self._seconds(choose_splits(p, self.model), self.model) for p in (ring_plan, split_plan)
        )
        if ring_seconds < split_seconds:
            ring_plan.stats["construction"] = "ring-priced"
            ring.tried += split.tried
            return ring_plan, ring
        split_plan.stats["construction"] = "split-priced"
        split.tried += ring.tried
        return split_plan, split

    def _run_cpsat(
        self,
        plan: StepPlan,
        cost: PlanCost,
        greedy: GreedyConstructor,
        start: float,
        stats: dict,
        limit: float | None = None,
    ) -> tuple[StepPlan, PlanCost]:
        """CP-SAT on ``plan`` for what is left of ``limit`` (default ``time_limit``) seconds
        since ``start``; in deterministic mode ``limit`` deterministic units."""
        assert self.cpsat is not None
        limit = self.time_limit if limit is None else limit
        if self.deterministic:
            budget = limit
            run = budget >= self.min_improve_seconds
        else:
            left = limit - (time.perf_counter() - start)
            run = left >= self.min_improve_seconds
            # Keep a reserve for realising, validating and pricing the solver's answer.
            budget = 0.9 * left - 0.02
        if not run or len(plan.lengths) == 0:
            reason = "empty batch" if len(plan.lengths) == 0 else "not enough time left"
            self.solver_status_counts["SKIPPED"] += 1
            stats["solver"] = {"status": "SKIPPED", "reason": reason}
            return plan, cost
        assignment, result = self.cpsat.solve(Assignment.from_plan(plan, greedy.costs), budget)
        self.solver_status_counts[result.status.split(":")[0]] += 1
        stats["timings"].update(
            solver_wall_seconds=result.wall_seconds, solver_build_seconds=result.build_seconds
        )
        stats["solver"] = {
            "status": result.status,
            "objective_seconds": result.objective_seconds,
            "bound_seconds": result.bound_seconds,
            "variables": result.variables,
        }
        if result.objective_seconds is None:
            return plan, cost
        try:
            candidate = assignment.to_plan(plan)
        except (ValueError, IndexError) as exc:  # e.g. a sequence in a slot too small for it
            log.warning(
                "CP-SAT plan rejected (cannot be packed), keeping the previous one: %s", exc
            )
            self.solver_status_counts["REJECTED"] += 1
            return plan, cost
        return self._keep_better(plan, cost, candidate, "CP-SAT")

    def _run_layout(
        self, plan: StepPlan, cost: PlanCost, start: float, stats: dict, limit: float
    ) -> tuple[StepPlan, PlanCost]:
        """The layout search (``dyncp.planner.improvement.laminar``) on a small batch for
        ``LAYOUT_SHARE`` of what is left of ``limit`` (deterministic mode: of ``limit`` units), when
        that is at least ``LAYOUT_SHARE`` x ``min_improve_seconds``; kept only if valid and faster.
        Deterministic mode leaves CP-SAT its own ``limit`` units (reproducible either way)."""
        assert self.layout is not None
        if self.deterministic:
            budget = LAYOUT_SHARE * limit
        else:
            budget = LAYOUT_SHARE * (limit - (time.perf_counter() - start))
        if budget < self.min_improve_seconds * LAYOUT_SHARE:
            stats["layout"] = {"status": "SKIPPED: not enough time left"}
            return plan, cost
        candidate, result = self.layout.solve(plan, self._pricing, budget)
        stats["layout"] = {
            "status": result.status,
            "objective_seconds": result.objective_seconds,
            "variables": result.variables,
        }
        stats["timings"]["layout_seconds"] = result.wall_seconds
        if candidate is None:
            return plan, cost
        before = cost.step_seconds
        plan, cost = self._keep_better(plan, cost, candidate, "layout search")
        stats["layout"]["kept"] = cost.step_seconds < before
        return plan, cost

    def _keep_better(
        self, plan: StepPlan, cost: PlanCost, candidate: StepPlan, who: str
    ) -> tuple[StepPlan, PlanCost]:
        """``candidate`` and its cost if it is valid, for this batch, and predicted faster."""
        try:
            if candidate.lengths != plan.lengths or candidate.topology != plan.topology:
                raise ValueError(f"{who} returned a plan for another batch or topology")
            candidate.validate()
        except (PlanError, ValueError) as exc:
            log.warning("%s plan rejected, keeping the previous one: %s", who, exc)
            self.solver_status_counts["REJECTED"] += 1
            return plan, cost
        new = self._price(candidate, self._pricing)
        return (candidate, new) if new.step_seconds < cost.step_seconds else (plan, cost)

    def _price(self, plan: StepPlan, model: CostModel | SplitEnvelope) -> PlanCost:
        """``plan``'s cost under ``model``, timed as this planner's objective."""
        return evaluate_plan(plan, model, timing=self.timing)  # type: ignore[arg-type]

    def _seconds(self, plan: StepPlan, model: CostModel | SplitEnvelope) -> float:
        return self._price(plan, model).step_seconds

    @property
    def search_model(self) -> CostModel | SplitEnvelope:
        """What the search and the bounds price: each CP size at its cheapest head split when
        the topology allows splits, else the model itself. Follows ``self.model`` when it is
        replaced (a calibrated model version)."""
        if self.topology.head_sizes == (1,):
            return self.model
        if self._envelope is None or self._envelope.model is not self.model:
            self._envelope = SplitEnvelope(self.model, self.topology)
        return self._envelope

    @property
    def _pricing(self) -> CostModel:
        """The model the policy's candidates are compared with (before splits are chosen)."""
        return self.search_model if self.policy == HYBRID_POLICY else self.model

    def _run_improver(self, plan: StepPlan, cost: PlanCost) -> tuple[StepPlan, PlanCost]:
        assert self.improver is not None
        try:
            candidate = self.improver(plan, self.model)
        except (PlanError, ValueError, RuntimeError) as exc:
            log.warning("improver failed, keeping the constructed plan: %s", exc)
            return plan, cost
        return self._keep_better(plan, cost, candidate, "improver")
