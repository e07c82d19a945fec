"""Planner facade: one object, one ``plan(lengths)`` call, any policy, stats attached.

    planner = Planner(model, world=64, ranks_per_node=8, capacity=8192, policy="dyncp",
                      time_limit=0.1)
    plan = planner.plan(lengths)          # validated StepPlan
    plan.stats["predicted_step_seconds"], plan.stats["gap_to_lower_bound"], plan.stats["solver"]
    plan.stats["timings"]["plan_seconds"]  # wall clock: the only values that vary between runs

The dyncp policy is a pipeline with a deadline: the greedy constructor (anytime: candidates in
order of promise until ``time_limit`` minus a reserve for validation and the bound), then, if the
remaining time allows (``min_improve_seconds``), the CP-SAT improvement for what is left of
``time_limit``, then an optional user ``improver``. Every improvement is validated and kept only
when the exact cost model predicts it faster, so nothing after the greedy can make a plan worse
or invalid, and nothing raises because a solver ran out of time: the best plan found by the
deadline is returned. Solver outcomes are counted in ``Planner.solver_status_counts``.

Objective (``timing``, default ``"dataflow"``): a plan is priced as ``dyncp.runtime.execute``
runs it -- each rank runs its groups in wave order and a group starts when its last member is free
(``dyncp.cost_model.evaluate``) -- and every comparison above (candidates, local search, CP-SAT,
the user improver, head splits, the baselines' own choices) and every reported figure
(``predicted_step_seconds``, ``imbalance``, ``efficiency``; ``stats["timing"]`` names it) uses that
timing. ``timing="barrier"`` prices a barrier after every wave, as before, for comparison.

Budget and baselines: ``budget=StepBudget(...)`` (``dyncp.planner.budget``) makes the limit a
share of the step the batch's closed-form lower bound predicts, decided before planning, so the
whole pipeline above (the constructor first, then the improvement) runs within it. The baseline
policies' plans (``dyncp.planner.baselines``) are built first and kept as candidates, so the
plan handed out is never slower than theirs under the planner's model and ``timing``.

Deterministic mode (``deterministic=True``): the constructor tries every candidate, CP-SAT runs
with one worker, a deterministic time limit and a fixed seed, and whether it runs depends on
``time_limit`` only, never on elapsed wall time, so identical inputs give identical plans on every
machine.

Bounds: ``stats["lower_bound_seconds"]`` is the tight LP bound (``dyncp.planner.bounds.lp_bound``, a
few milliseconds) with ``bound="tight"`` (default), the closed-form one
(``dyncp.planner.bounds.closed_form``) with ``bound="simple"``; both are reported
(``simple_lower_bound_seconds``) and the gap is against the tighter. ``timings.plan_seconds`` is the
wall clock of the whole ``plan()`` call, validation included, and the bounds unless they are
deferred.

Deferred bounds (``defer_bound``): at 16,384 ranks the tight bound takes as long as building the
plan, so it may be computed after ``plan()`` returns, on a worker thread
(``dyncp.planner.bounds.deferred``): the plan's bound fields are ``None`` and
``stats["bound"]["status"]`` is ``"PENDING"`` until it is written; ``Planner.wait_bound(plan)``
waits for it. ``"auto"`` (default) defers where the bound would not fit the deadline: with a
wall-clock deadline, when the bound is predicted (``BOUND_SECONDS_PER_SEQUENCE`` per sequence) to
take more than ``DEFER_SHARE`` of ``time_limit`` and more than ``DEFER_MIN_SECONDS`` -- never for a
batch of at most 3,333 sequences, never in deterministic mode. ``"always"`` and ``"never"`` force
it. A deferred bound is the same number the synchronous one is (the same computation, later).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from dyncp.cost_model.evaluate import PlanCost, check_timing, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import PlanError, StepPlan, Topology
from dyncp.planner.baselines.candidates import BaselineCandidates
from dyncp.planner.baselines.dp_balanced import dp_balanced_plan
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.static import batch_adaptive_plan, fixed_cp_plan, static_cp_size
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.deferred import DeferredBounds
from dyncp.planner.bounds.lp_bound import lp_lower_bound
from dyncp.planner.budget import StepBudget
from dyncp.planner.construction.assignment import Assignment
from dyncp.planner.construction.greedy import GreedyConstructor
from dyncp.planner.improvement.cpsat import CpSatImprover
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits
from dyncp.planner.improvement.laminar import MAX_SEQUENCES as LAYOUT_MAX_SEQUENCES
from dyncp.planner.improvement.laminar import LaminarImprover

__all__ = [
    "Planner",
    "POLICIES",
    "ALL_POLICIES",
    "HYBRID_POLICY",
    "BOUNDS",
    "DEFER_BOUND",
    "Improver",
    "nested_core",
]

#: Policies that run rings only (every group u = 1).
POLICIES = ("static", "dp-balanced", "batch-adaptive", "megatron", "dyncp")
#: dyncp with a head split chosen per group (needs ``head_sizes`` beyond 1).
HYBRID_POLICY = "dyncp-hybrid"
ALL_POLICIES = (*POLICIES, HYBRID_POLICY)
BOUNDS = ("tight", "simple")
DEFER_BOUND = ("auto", "always", "never")
#: ``defer_bound="auto"``'s prediction of the bounds' wall time per sequence of the batch.
#: Measured here (one core, quiet): 3.3-3.6 s for 131,072 sequences on 16,384 ranks (25-27 us),
#: 0.4 s for 32,768 on 4,096 (12 us), 12-15 ms for 512 on 64 (23-29 us); rounded up.
BOUND_SECONDS_PER_SEQUENCE = 30e-6
#: ``"auto"`` defers the bounds when predicted to take more than this share of ``time_limit``
#: (the constructor's reserve for validation and bounds is at most half of it)...
DEFER_SHARE = 0.25
#: ... and more than this many seconds (so batches of at most 3,333 sequences never defer).
DEFER_MIN_SECONDS = 0.1
#: First call's estimate of validation + pricing wall time per sequence (measured here: 0.12 s
#: + 0.04 s for 131,072 sequences); later calls use the previous call's measured time.
TAIL_SECONDS_PER_SEQUENCE = 1.5e-6

Improver = Callable[[StepPlan, CostModel], StepPlan]

log = logging.getLogger(__name__)

#: Share of the construction's wall time the baseline candidates may take (``_baseline_deadline``):
#: all four take 13-17 ms at 64 ranks and 512 sequences on a quiet core, three times that under
#: load, and a skipped baseline is a step on which dyncp may lose to it; the construction always
#: realises its first structure, whatever is left.
BASELINE_SHARE = 0.75
#: Share of what is left after the constructor that the layout search
# (``dyncp.planner.improvement.laminar``, : batches of at most ``LAYOUT_MAX_SEQUENCES``) may take
# before CP-SAT on the slots gets the rest.
LAYOUT_SHARE = 0.6


class _Baseline(NamedTuple):
    """A baseline's plan as rings, as handed out, and its seconds (``Planner.timing``)."""

    name: str
    rings: StepPlan
    final: StepPlan
    seconds: float


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


class Planner:
    """Plans steps under one policy.

    Args:
        model: cost model used to choose (dyncp, batch-adaptive) and to report predictions.
        world, ranks_per_node, capacity: the DP x CP ranks and tokens per rank per micro-batch.
        policy: one of ``POLICIES``.
        max_length: longest admitted document; sets the static policy's CP size (required for
            ``static``).
        group_sizes: allowed CP sizes (default: powers of two dividing world).
        time_limit: seconds the dyncp policy may spend per step (deterministic units in
            deterministic mode); default 0.1. Not with ``budget``.
        deterministic: reproducible CP-SAT (see the module docstring).
        cpsat: the CP-SAT improver; ``None`` disables it. Default: ``CpSatImprover()``.
        min_improve_seconds: CP-SAT runs only when at least this much of ``time_limit`` is left
            after the greedy (building its model alone takes tens of milliseconds).
        improver: optional user improvement of the plan (dyncp policy only), same guarantees.
        bound: ``"tight"`` (LP, reported every step) or ``"simple"`` (closed form: skips the LP,
            e.g. in the plan service where latency matters more than the report).
        defer_bound: ``"auto"``, ``"always"`` or ``"never"``: whether the bounds are computed
            after ``plan()`` returns (module docstring; ``wait_bound``). Only the tight bound is
            ever deferred.
        reserve_seconds: wall time the anytime constructor leaves for validation, the bound and
            pricing (at most half of ``time_limit``); at least 1.1 x what ran after its deadline
            in the previous call (pricing, validation, a synchronous bound, the constructor's
            own overshoot; on the first call an estimate from the batch's size:
            ``TAIL_SECONDS_PER_SEQUENCE``, plus ``BOUND_SECONDS_PER_SEQUENCE`` when the bound
            is not deferred), still at most half.
        head_sizes: allowed head-parallel degrees u of a group (``Topology.head_sizes``). The
            ``dyncp-hybrid`` policy plans like ``dyncp`` with every group priced at its cheapest
            split and then gives each group its fastest split
            (``dyncp.planner.improvement.head_split``); the other policies run rings (u = 1). The
            lower bound counts the splits whatever the policy, so every policy's gap is against the
            same bound.
        query_heads, kv_heads: the model's attention heads (default: the profile's
            ``model.num_heads`` / ``num_kv_heads`` when the cost model has a profile).
        timing: the objective (``dyncp.cost_model.evaluate.TIMINGS``): ``"dataflow"``
            (default: how ``dyncp.runtime.execute`` runs a plan, no barrier between waves) or
            ``"barrier"`` (the wave-barrier price, kept for comparison). Every candidate, every
            improvement and the baselines are compared and reported under it, and the tight
            bound is proven for it (a dataflow bound also bounds barrier plans).
        budget: plan each step for a share of its predicted seconds instead of a fixed
            ``time_limit`` (``dyncp.planner.budget``); ``plan(lengths, budget=...)`` overrides
            it per call.
        baselines: build the baseline policies' plans as candidates of the dyncp policies
            (``dyncp.planner.baselines``), so that the plan handed out is never slower than
            theirs; ``False`` shows what the search alone finds.
        layout: run the layout search (``dyncp.planner.improvement.laminar``) on batches of at most
            ``LAYOUT_MAX_SEQUENCES`` sequences, before CP-SAT, with ``LAYOUT_SHARE`` of the time
            left (when that is at least ``LAYOUT_SHARE`` x ``min_improve_seconds``; so never
            at the default ``time_limit``); off with ``cpsat=None`` too.
    """

    def __init__(
        self,
        model: CostModel,
        *,
        world: int,
        ranks_per_node: int,
        capacity: int,
        policy: str = "dyncp",
        max_length: int | None = None,
        group_sizes: Sequence[int] = (),
        time_limit: float | None = None,
        deterministic: bool = False,
        cpsat: CpSatImprover | None | str = "default",
        min_improve_seconds: float = 0.2,
        improver: Improver | None = None,
        bound: str = "tight",
        defer_bound: str = "auto",
        reserve_seconds: float = 0.03,
        head_sizes: Sequence[int] = (1,),
        query_heads: int | None = None,
        kv_heads: int | None = None,
        timing: str = "dataflow",
        budget: StepBudget | None = None,
        baselines: bool = True,
        layout: bool = True,
    ) -> None:
        self.timing = check_timing(timing)
        time_limit = self._check_budget(time_limit, budget)
        if bound not in BOUNDS:
            raise ValueError(f"unknown bound {bound!r}; choose one of {', '.join(BOUNDS)}")
        if defer_bound not in DEFER_BOUND:
            raise ValueError(
                f"unknown defer_bound {defer_bound!r}; choose one of {', '.join(DEFER_BOUND)}"
            )
        if not reserve_seconds >= 0:
            raise ValueError(f"reserve_seconds must be >= 0, got {reserve_seconds}")
        if policy not in ALL_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(ALL_POLICIES)}")
        if model.ranks_per_node != ranks_per_node:
            raise ValueError(
                f"cost model built for ranks_per_node={model.ranks_per_node}, planner has "
                f"{ranks_per_node}"
            )
        if not time_limit > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
        self.budget = budget
        self.model = model
        splits = any(int(u) > 1 for u in head_sizes)
        shape = getattr(getattr(model, "profile", None), "model", None) if splits else None
        if query_heads is None:
            query_heads = shape.num_heads if shape is not None else 0
        if kv_heads is None:
            kv_heads = shape.num_kv_heads if shape is not None else 0
        self.topology = Topology(
            world,
            ranks_per_node,
            capacity,
            tuple(group_sizes),
            tuple(head_sizes),
            int(query_heads),
            int(kv_heads),
        )
        self._envelope: SplitEnvelope | None = None
        if policy == HYBRID_POLICY and self.topology.head_sizes == (1,):
            raise ValueError(
                "policy 'dyncp-hybrid' chooses head splits: give head_sizes beyond (1,), "
                "e.g. (1, 2, 4, 8)"
            )
        self.policy = policy
        self.time_limit = float(time_limit)
        self.deterministic = deterministic
        if cpsat == "default":
            cpsat = CpSatImprover(deterministic=deterministic)
        self.cpsat: CpSatImprover | None = cpsat  # type: ignore[assignment]
        # The layout search of small batches runs with the CP-SAT improvement (off with it).
        self.layout = (
            LaminarImprover(deterministic=deterministic) if layout and cpsat is not None else None
        )
        self.min_improve_seconds = min_improve_seconds
        self.improver = improver
        self.bound = bound
        self.defer_bound = defer_bound
        self._deferred = DeferredBounds()
        self.reserve_seconds = min(float(reserve_seconds), 0.5 * self.time_limit)
        # Pricing, validation and (synchronous) bounds of the previous call (wall clock).
        self._tail_seconds: float | None = None
        self.solver_status_counts: Counter[str] = Counter()
        self.baselines: BaselineCandidates | None = None
        if baselines and policy in ("dyncp", HYBRID_POLICY):
            self.baselines = BaselineCandidates(self.topology, max_length=max_length)
        self.static_cp: int | None = None
        if policy in ("static", "dp-balanced"):
            if max_length is None:
                raise ValueError(f"policy {policy!r} needs max_length (longest admitted document)")
            self.static_cp = static_cp_size(max_length, self.topology)

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
        half = None
        if deadline is not None:
            now = time.perf_counter()
            half = now + max(deadline - now, 0.0) / 2
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
        half = None
        if deadline is not None:
            now = time.perf_counter()
            half = now + max(deadline - now, 0.0) / 2
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

    # ------------------------------------------------------------------------ budget, baselines
    @staticmethod
    def _check_budget(time_limit: float | None, budget: StepBudget | None) -> float:
        """``time_limit`` (default 0.1 s), or the budget's floor (what a policy without a
        budget, or a planner asked for its ``time_limit``, uses): the two are exclusive."""
        if budget is None:
            return 0.1 if time_limit is None else time_limit
        if not isinstance(budget, StepBudget):
            raise ValueError(f"budget must be a StepBudget or None, got {budget!r}")
        if time_limit is not None:
            raise ValueError(
                "give time_limit (a fixed limit per step) or budget (a share of the predicted "
                "step, at least budget.floor), not both"
            )
        return budget.floor

    def _budget_seconds(
        self, budget: StepBudget | None, predicted: float | None, stats: dict
    ) -> float:
        """The step's whole planning limit: ``time_limit``, or the budget of the step
        ``predicted`` (seconds: the batch's closed-form lower bound, a pure function of the
        batch, so deterministic mode stays deterministic)."""
        if budget is None or predicted is None:
            return self.time_limit
        seconds = budget.seconds(predicted)
        stats["budget"] = {
            "seconds": seconds,
            "predicted_step_seconds": predicted,
            "share": budget.share,
            "cap": budget.cap,
            "floor": budget.floor,
            "units": "deterministic" if self.deterministic else "wall",
        }
        return seconds

    @staticmethod
    def _baseline_deadline(start: float, deadline: float | None) -> float | None:
        """The baselines are built first (milliseconds at 64 ranks: the search may overrun
        its deadline, they must not be skipped for it), within ``BASELINE_SHARE`` of the
        construction's time; those expected to take longer are skipped."""
        if deadline is None:
            return None
        return start + BASELINE_SHARE * max(deadline - start, 0.0)

    def _build_baselines(self, lengths: np.ndarray, deadline: float | None) -> list[_Baseline]:
        """The baseline plans built by ``deadline`` (all in deterministic mode): each as rings
        (what the search continues from) and as handed out (a hybrid policy's with its splits
        chosen), with its seconds under the model and the planner's timing."""
        if self.baselines is None:
            return []
        out = []
        for name, rings in self.baselines.plans(lengths, self.model, deadline=deadline):
            rings.policy = self.policy
            final = rings
            if self.policy == HYBRID_POLICY:
                final = choose_splits(rings, self.model)
                final.policy = self.policy
            seconds = self._seconds(final, self.model)
            out.append(_Baseline(name, rings, final, seconds))
        return out

    def _take_baseline(
        self,
        plan: StepPlan,
        cost: PlanCost,
        baselines: list[_Baseline],
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
        baselines: list[_Baseline],
        stats: dict,
    ) -> tuple[StepPlan, PlanCost]:
        """The final plan, or the fastest baseline where the final plan is slower under the
        planner's timing (an improvement accepted under another objective can be)."""
        best = min(baselines, key=lambda b: b.seconds)
        if best.seconds >= cost.step_seconds:  # ``cost``: ``plan``'s under the model
            return plan, cost
        stats["chosen"] = f"baseline:{best.name}"
        return best.final, self._price(best.final, self.model)

    # ------------------------------------------------------------------------------ API
    def plan(
        self, lengths: Sequence[int] | np.ndarray, *, budget: StepBudget | None = None
    ) -> StepPlan:
        """A validated plan for one global batch, with predictions and timings in ``stats``.

        ``budget`` (default: the planner's own, else ``time_limit``): plan this step with a
        share of its predicted duration (``dyncp.planner.budget``; dyncp policies only).
        """
        start = time.perf_counter()
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 1).any():
            raise ValueError("lengths must be a 1-D sequence of positive integers")
        if budget is not None and not isinstance(budget, StepBudget):
            raise ValueError(f"budget must be a StepBudget or None, got {budget!r}")
        budget = budget if budget is not None else self.budget
        stats: dict = {"timings": {}}  # wall-clock values live under "timings", apart
        simple: float | None = None  # the closed-form bound, when the budget follows it
        if budget is not None and self.policy in ("dyncp", HYBRID_POLICY):
            simple = lower_bound(lengths, self.topology, self.search_model)
        limit = self._budget_seconds(budget, simple, stats)
        defer = self._defers(len(lengths), limit)
        tail = self._tail_seconds
        if tail is None:  # first call: an estimate from the batch's size
            tail = TAIL_SECONDS_PER_SEQUENCE * len(lengths)
            if not defer and self.bound == "tight":
                tail += BOUND_SECONDS_PER_SEQUENCE * len(lengths)
        reserve = min(max(self.reserve_seconds, 1.1 * tail), 0.5 * limit)
        deadline = None if self.deterministic else start + limit - reserve
        baselines = self._build_baselines(lengths, self._baseline_deadline(start, deadline))
        plan, greedy = self._construct(lengths, deadline)
        t_construct = time.perf_counter()
        cost = self._price(plan, self._pricing)
        price_seconds = time.perf_counter() - t_construct
        if greedy is not None:
            stats["greedy_step_seconds"] = cost.step_seconds
            stats["timings"]["candidates"] = greedy.tried  # depends on the deadline
            plan, cost = self._take_baseline(plan, cost, baselines, stats)
            if self.layout is not None and 0 < len(lengths) <= LAYOUT_MAX_SEQUENCES:
                plan, cost = self._run_layout(plan, cost, start, stats, limit)
            if self.cpsat is not None:
                plan, cost = self._run_cpsat(plan, cost, greedy, start, stats, limit)
            if self.improver is not None:
                plan, cost = self._run_improver(plan, cost)
        t_split = time.perf_counter()
        if self.policy == HYBRID_POLICY:
            plan = choose_splits(plan, self.model)
            plan.policy = self.policy
            cost = self._price(plan, self.model)
        if baselines:
            plan, cost = self._never_worse(plan, cost, baselines, stats)
        t0 = time.perf_counter()
        plan.validate()
        t1 = time.perf_counter()
        plan.stats.update(stats)
        plan.stats.update(
            policy=self.policy,
            timing=self.timing,
            predicted_step_seconds=cost.step_seconds,
            imbalance=cost.imbalance,
            efficiency=cost.efficiency,
            waves=len(plan.waves),
        )
        if defer:
            seconds, search_model = cost.step_seconds, self.search_model
            plan.stats["bound"] = {"kind": "tight"}
            self._deferred.submit(
                plan,
                lambda: self._bound_fields(
                    lengths, seconds, search_model, tight=True, simple=simple
                ),
                lambda exc: self._bound_fields(
                    lengths, seconds, search_model, tight=False, failed=exc, simple=simple
                ),
            )
        else:
            fields = self._bound_fields(
                lengths,
                cost.step_seconds,
                self.search_model,
                tight=self.bound == "tight",
                simple=simple,
            )
            plan.stats.update({k: v for k, v in fields.items() if k != "bound_seconds"})
        t2 = time.perf_counter()
        # What ran after the constructor's deadline and is not a solver's budget: the
        # constructor's own overshoot (realising its last improvement), pricing, validation,
        # synchronous bounds. The next call's constructor leaves that much (x 1.1) in reserve.
        overshoot = max(t_construct - deadline, 0.0) if deadline is not None else 0.0
        self._tail_seconds = overshoot + price_seconds + (t2 - t_split)
        plan.stats["timings"].update(
            construct_seconds=t_construct - start,
            price_seconds=price_seconds + (t0 - t_split),
            validate_seconds=t1 - t0,
            plan_seconds=time.perf_counter() - start,
        )
        if not defer:
            plan.stats["timings"]["bound_seconds"] = t2 - t1
        return plan

    def _defers(self, sequences: int, limit: float) -> bool:
        """Whether this batch's bounds are computed after ``plan()`` returns (module
        docstring): the tight bound only; in ``"auto"`` mode with a wall-clock deadline only,
        when predicted to take more than ``DEFER_SHARE`` of it and ``DEFER_MIN_SECONDS``."""
        if self.bound != "tight" or self.defer_bound == "never":
            return False
        if self.defer_bound == "always":
            return True
        predicted = BOUND_SECONDS_PER_SEQUENCE * sequences
        return not self.deterministic and predicted > max(DEFER_SHARE * limit, DEFER_MIN_SECONDS)

    def _bound_fields(
        self,
        lengths: np.ndarray,
        seconds: float,
        search_model: CostModel | SplitEnvelope,
        *,
        tight: bool,
        failed: BaseException | None = None,
        simple: float | None = None,
    ) -> dict:
        """The bound fields of ``stats`` for a plan of ``seconds``: the closed-form bound, the
        tight one when ``tight``, the gaps, ``bound`` (what was computed) and ``bound_seconds``
        (wall clock). ``failed``: the tight bound's error, reported with the closed form.
        ``simple``: the closed-form bound when ``plan()`` already computed it (for a budget)."""
        t0 = time.perf_counter()
        if simple is None:
            simple = lower_bound(lengths, self.topology, search_model)
        bound, bound_info = simple, {"kind": "simple"}
        if failed is not None:
            bound_info["status"] = f"tight bound failed: {failed!r}"
        elif tight:
            lp = lp_lower_bound(
                lengths, self.topology, search_model, simple=simple, timing=self.timing
            )
            bound = lp.seconds
            bound_info = {"kind": "tight", "status": lp.status, "variables": lp.variables}
        return {
            "lower_bound_seconds": bound,
            "simple_lower_bound_seconds": simple,
            "gap_to_lower_bound": seconds / bound - 1.0 if bound > 0 else 0.0,
            "gap_to_simple_bound": seconds / simple - 1.0 if simple > 0 else 0.0,
            "bound": bound_info,
            "bound_seconds": time.perf_counter() - t0,
        }

    def wait_bound(self, plan: StepPlan, timeout: float | None = None) -> StepPlan:
        """``plan`` (from this planner) once its bounds are in its ``stats``: at once unless
        they were deferred and are still being computed.

        Raises:
            TimeoutError: the deferred bound is not done within ``timeout`` seconds.
        """
        return self._deferred.wait(plan, timeout)

    def bound_pending(self, plan: StepPlan) -> bool:
        """Whether ``plan``'s deferred bound is still being computed."""
        return self._deferred.pending(plan)

    def wait_bounds(self, timeout: float | None = None) -> None:
        """Return once every bound this planner deferred so far is in its plan's ``stats``."""
        self._deferred.wait_all(timeout)
