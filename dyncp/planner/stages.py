"""The planner's stages around the search: the construction each policy runs, and the improvements.

``Planner.plan`` (``planner``) runs a pipeline with a deadline; its stages are here, as methods
of ``PlannerStages``, the base of ``Planner``: ``_construct`` (the constructor of each policy,
two constructions with half the time each for a menu whose sizes do not nest and for head
splits), then ``_run_layout``, ``_run_cpsat`` and ``_run_improver``, each of whose plans is
kept only when it is valid and predicted faster (``_keep_better``), and for a pipeline
``_pipelined`` (``dyncp.planner.pipeline.stage``). The state they read (the model,
topology, policy, solvers, time limits) is the ``Planner``'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import NamedTuple

from dyncp.cost_model.evaluate import PlanCost, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import Pipeline, PlanError, StepPlan, Topology
from dyncp.planner.baselines.dp_balanced import dp_balanced_plan
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.static import batch_adaptive_plan, fixed_cp_plan
from dyncp.planner.batch import Batch
from dyncp.planner.config import HYBRID_POLICY, Improver, PlannerConfig
from dyncp.planner.construction.assignment import Assignment
from dyncp.planner.construction.greedy import GreedyConstructor
from dyncp.planner.construction.quick import QuickConstructor
from dyncp.planner.improvement.cpsat import CpSatImprover
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits
from dyncp.planner.improvement.laminar import LaminarImprover
from dyncp.planner.improvement.pass_align import ALIGN_WORK_PER_SECOND
from dyncp.planner.pipeline.stage import ORDER_EVALUATIONS_PER_SECOND, PipelineStage, priced_stage

__all__ = ["BaselinePlan", "LAYOUT_SHARE", "PlannerStages", "nested_core"]

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


class BaselinePlan(NamedTuple):
    """A baseline's plan as rings, as handed out, and its seconds (``Planner.timing``)."""

    name: str
    rings: StepPlan
    final: StepPlan
    seconds: float


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
    pipeline: Pipeline | None
    config: PlannerConfig
    reserve_seconds: float
    _pipeline_stage: PipelineStage | None

    # ------------------------------------------------------------------------------ stages
    def _construct(
        self, batch: Batch, deadline: float | None = None, *, quick: bool = False
    ) -> tuple[StepPlan, GreedyConstructor | None]:
        """The policy's plan of ``batch`` (on ``self.topology``), and its constructor (dyncp;
        None with ``quick``: the quick construction, which nothing after it improves)."""
        topo, model = self.topology, self.model
        if quick and self.policy in ("dyncp", HYBRID_POLICY):
            return QuickConstructor(batch, topo, self._pricing, timing=self.timing).best(), None
        if self.policy == "dp-balanced":
            assert self.static_cp is not None
            return dp_balanced_plan(batch, topo, self.static_cp), None
        if self.policy == "static":
            assert self.static_cp is not None
            return fixed_cp_plan(batch, topo, model, self.static_cp), None
        if self.policy == "batch-adaptive":
            return batch_adaptive_plan(batch, topo, model, timing=self.timing), None
        if self.policy == "megatron":
            return megatron_plan(batch, topo), None
        if self.policy == HYBRID_POLICY:
            return self._construct_hybrid(batch, deadline)
        core = nested_core(topo)
        if core is not None:
            return self._construct_menu(batch, core, deadline)
        greedy = GreedyConstructor(batch, topo, model, timing=self.timing)
        return greedy.best(deadline=deadline), greedy

    def _construct_menu(
        self, batch: Batch, core: Topology, deadline: float | None
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
        menu = GreedyConstructor(batch, self.topology, self.model, timing=self.timing)
        plan = menu.best(deadline=half)
        if len(batch) and core.min_cp(int(batch.lengths.max())) is None:
            return plan, menu
        nested = GreedyConstructor(batch.lengths, core, self.model, timing=self.timing)
        other = nested.best(deadline=deadline)
        menu.tried += nested.tried
        if self._seconds(other, self.model) < self._seconds(plan, self.model):
            other.topology = self.topology
            other.stats.construction = "powers-of-two"
            return other, menu
        plan.stats.construction = "menu"
        return plan, menu

    def _construct_hybrid(
        self, batch: Batch, deadline: float | None
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
        ring = GreedyConstructor(batch, self.topology, self.model, timing=self.timing)
        split = GreedyConstructor(batch, self.topology, self.search_model, timing=self.timing)
        ring_plan = ring.best(deadline=half)
        split_plan = split.best(deadline=deadline)
        ring_seconds, split_seconds = (
            self._seconds(choose_splits(p, self.model), self.model) for p in (ring_plan, split_plan)
        )
        if ring_seconds < split_seconds:
            ring_plan.stats.construction = "ring-priced"
            ring.tried += split.tried
            return ring_plan, ring
        split_plan.stats.construction = "split-priced"
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

    def _pipelined(
        self,
        batch: Batch,
        named: list[tuple[str, StepPlan]],
        stats: dict,
        start: float,
        limit: float,
        pipe_limit: float,
    ) -> tuple[StepPlan, float]:
        """The pipeline stage (``dyncp.planner.pipeline.stage``) on the search's plan and the
        baselines' plans (``named``: the policy's first), for ``pipe_limit`` seconds after the
        search's ``limit`` (deterministic mode: ``ORDER_EVALUATIONS_PER_SECOND`` x
        ``pipe_limit`` prices)."""
        assert self.pipeline is not None
        stage = self._pipeline_stage
        if stage is None or stage.model is not self.model:  # (a new model version: anew)
            stage = self._pipeline_stage = priced_stage(
                self.pipeline,
                self.topology,
                self.model,
                timing=self.timing,
                max_length=self.config.max_length,
            )
        search = self.policy in ("dyncp", HYBRID_POLICY)
        if self.deterministic:
            deadline, evaluations = None, int(pipe_limit * ORDER_EVALUATIONS_PER_SECOND)
        else:
            reserve = min(self.reserve_seconds, 0.5 * pipe_limit)
            deadline, evaluations = start + limit + pipe_limit - reserve, 1 << 30
        out, pstats = stage.run(
            batch,
            named,
            search=search,
            evaluations=evaluations,
            deadline=deadline,
            bound=stats.pop("pipeline_bound", None),
            align_work=int(pipe_limit * ALIGN_WORK_PER_SECOND) if self.deterministic else None,
        )
        stats["pipeline"] = pstats.as_dict()
        if pstats.lower_bound_seconds is not None:
            stats["lower_bound_seconds"] = pstats.lower_bound_seconds
            stats["gap_to_lower_bound"] = pstats.gap_to_lower_bound
        if pstats.chosen != self.policy:
            stats["chosen"] = f"pipeline:{pstats.chosen}"
        out.policy = self.policy
        return out, pstats.predicted_step_seconds

    def _take_baseline(
        self,
        plan: StepPlan,
        cost: PlanCost,
        baselines: list[BaselinePlan],
        stats: dict,
    ) -> tuple[StepPlan, PlanCost]:
        """The constructed plan, or the fastest baseline where it is faster (under the
        planner's timing, as the search prices it): the improvement then starts from the
        better of them."""
        if not baselines:
            return plan, cost
        stats["baseline_seconds"] = {b.name: b.seconds for b in baselines}
        # ``cost`` is ``plan``'s under the search's pricing; so is each baseline's below.
        priced = [self._price(b.rings, self._pricing) for b in baselines]
        n = min(range(len(baselines)), key=lambda i: (priced[i].step_seconds, i))
        if priced[n].step_seconds >= cost.step_seconds:
            return plan, cost
        stats["chosen"] = f"baseline:{baselines[n].name}"
        return baselines[n].rings, priced[n]

    def _never_worse(
        self,
        plan: StepPlan,
        cost: PlanCost,
        baselines: list[BaselinePlan],
        stats: dict,
    ) -> tuple[StepPlan, PlanCost]:
        """The final plan, or the fastest baseline where the final plan is slower under the
        planner's timing (an improvement accepted under another objective can be)."""
        best = min(baselines, key=lambda b: b.seconds)
        if best.seconds >= cost.step_seconds:  # ``cost``: ``plan``'s under the model
            return plan, cost
        stats["chosen"] = f"baseline:{best.name}"
        return best.final, self._price(best.final, self.model)
