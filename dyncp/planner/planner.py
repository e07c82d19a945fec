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
``passes="aligned"`` (FSDP2 full sharding) then aligns the passes of the plan and of the baselines'
plans (``dyncp.planner.improvement.pass_align``) and hands out the best in lockstep, priced so.
Alignment is a stage of the pipeline: it keeps ``ALIGN_SHARE`` of the step's limit (the search
gets the rest), runs to the same deadline (deterministic mode: a number of work units derived
from ``time_limit``, never a clock), aligns the planner's own plan first and the baselines' while
time is left, and when the time runs out hands out the best plan so far -- at worst the unaligned
plan, priced in lockstep (``stats.alignment["complete"]`` is then False).

Budget and baselines: ``budget=StepBudget(...)`` (``dyncp.planner.budget``) makes the limit a
share of the step the batch's closed-form lower bound predicts, decided before planning, so the
whole pipeline above (the constructor first, then the improvement) runs within it. The baseline
policies' plans (``dyncp.planner.baselines``) are built first and kept as candidates, so the
plan handed out is never slower than theirs under the planner's model and ``timing``.

The batch's per-sequence facts (padded tokens, minimum CP sizes, seconds alone) are derived once
per call, as a ``Batch`` (``dyncp.planner.batch``), and handed to the constructor, the baselines
and the bounds.

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

Pipelines (``pipeline=Pipeline(P, V)``): the search runs for ``1 - PIPELINE_SHARE`` of the limit,
then the pipeline stage (``dyncp.planner.pipeline.stage``: count, order, stats) pipelines; the
bound and a budget's prediction are the pipelined bound (``dyncp.planner.bounds.pipeline``).

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

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile
from dyncp.cost_model.step_parts import step_parts
from dyncp.plan import StepPlan, Topology
from dyncp.planner.baselines.candidates import BaselineCandidates
from dyncp.planner.baselines.static import static_cp_size
from dyncp.planner.batch import Batch
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.deferred import DeferredBounds
from dyncp.planner.bounds.pipeline import pipeline_lower_bound
from dyncp.planner.bounds.report import (
    BOUND_SECONDS_PER_SEQUENCE,
    bound_fields,
    defers,
)
from dyncp.planner.budget import StepBudget
from dyncp.planner.config import (
    ALL_POLICIES,
    BOUNDS,
    DEFER_BOUND,
    HYBRID_POLICY,
    POLICIES,
    Improver,
    PlannerConfig,
)
from dyncp.planner.construction.quick import quick_chosen
from dyncp.planner.improvement.cpsat import CpSatImprover
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits
from dyncp.planner.improvement.laminar import MAX_SEQUENCES as LAYOUT_MAX_SEQUENCES
from dyncp.planner.improvement.laminar import LaminarImprover
from dyncp.planner.improvement.pass_align import ALIGN_WORK_PER_SECOND, AlignBudget, align_best
from dyncp.planner.pipeline.stage import PIPELINE_SHARE, PipelineStage
from dyncp.planner.stages import BaselinePlan, PlannerStages, nested_core

__all__ = [
    "Planner",
    "PlannerConfig",
    "POLICIES",
    "ALL_POLICIES",
    "HYBRID_POLICY",
    "BOUNDS",
    "DEFER_BOUND",
    "Improver",
    "nested_core",
]

#: First call's estimate of validation + pricing wall time per sequence (measured here: 0.12 s
#: + 0.04 s for 131,072 sequences); later calls use the previous call's measured time.
TAIL_SECONDS_PER_SEQUENCE = 1.5e-6

#: Share of the construction's wall time the baseline candidates may take (``_baseline_deadline``):
#: all four take 13-17 ms at 64 ranks and 512 sequences on a quiet core, three times that under
#: load, and a skipped baseline is a step on which dyncp may lose to it; the construction always
#: realises its first structure, whatever is left.
BASELINE_SHARE = 0.75

#: Share of the step's planning limit kept for pass alignment (``passes="aligned"``): the rest
#: is the search's (construction, layout search, CP-SAT). Half: at 512 ranks and ~4,300
#: sequences, aligning the plan and its four baselines' plans to the end takes about twice the
#: free planner's whole ``plan()`` (``bench/fsdp_predict.py --latency``: 0.44 s against 0.20 s
#: p50), so an even split lets a limit of about a second do both; a baseline's plan, aligned
#: while time is left, can be the faster in lockstep.
ALIGN_SHARE = 0.5


def _topology(config: PlannerConfig, model: CostModel) -> Topology:
    """``config``'s topology; the heads a head split needs default to the model profile's."""
    splits = any(int(u) > 1 for u in config.head_sizes)
    shape = getattr(getattr(model, "profile", None), "model", None) if splits else None
    query_heads, kv_heads = config.query_heads, config.kv_heads
    if query_heads is None:
        query_heads = shape.num_heads if shape is not None else 0
    if kv_heads is None:
        kv_heads = shape.num_kv_heads if shape is not None else 0
    return Topology(
        config.world,
        config.ranks_per_node,
        config.capacity,
        config.group_sizes,
        config.head_sizes,
        int(query_heads),
        int(kv_heads),
    )


class Planner(PlannerStages):
    """Plans steps under one policy.

    ``Planner(model, world=..., ranks_per_node=..., capacity=..., ...)`` with the options of
    :class:`PlannerConfig` as keywords, or ``Planner(model, config)``; ``planner.config`` is the
    configuration. ``model``: the cost model used to choose (dyncp, batch-adaptive) and to report
    predictions.

    Raises:
        ValueError: an option outside what is allowed (``PlannerConfig``), or one that does not
            fit the model (its ``ranks_per_node``; the heads a head split needs).
        TypeError: both ``config`` and options, or an unknown option.
    """

    def __init__(
        self, model: CostModel, config: PlannerConfig | None = None, **options: Any
    ) -> None:
        if config is None:
            config = PlannerConfig(**options)
        elif options:
            raise TypeError(f"give a config or options, not both (got {sorted(options)})")
        self.config = config
        if model.ranks_per_node != config.ranks_per_node:
            raise ValueError(
                f"cost model built for ranks_per_node={model.ranks_per_node}, planner has "
                f"{config.ranks_per_node}"
            )
        self.timing = config.timing
        self.budget = config.budget
        self.model = model
        self.topology = _topology(config, model)
        self._envelope: SplitEnvelope | None = None
        policy = config.policy
        if policy == HYBRID_POLICY and self.topology.head_sizes == (1,):
            raise ValueError(
                "policy 'dyncp-hybrid' chooses head splits: give head_sizes beyond (1,), "
                "e.g. (1, 2, 4, 8)"
            )
        self.policy = policy
        self.time_limit = float(config.seconds_per_step)
        self.deterministic = deterministic = config.deterministic
        cpsat = config.cpsat
        if cpsat == "default":
            cpsat = CpSatImprover(deterministic=deterministic)
        self.cpsat: CpSatImprover | None = cpsat  # type: ignore[assignment]
        # The layout search of small batches runs with the CP-SAT improvement (off with it).
        self.layout = (
            LaminarImprover(deterministic=deterministic)
            if config.layout and cpsat is not None
            else None
        )
        self.min_improve_seconds = config.min_improve_seconds
        self.improver = config.improver
        self.bound = config.bound
        self.pipeline = config.pipeline
        self._pipeline_stage: PipelineStage | None = None
        self.defer_bound = config.defer_bound
        self._deferred = DeferredBounds()
        self.reserve_seconds = min(float(config.reserve_seconds), 0.5 * self.time_limit)
        # Pricing, validation and (synchronous) bounds of the previous call (wall clock).
        self._tail_seconds: float | None = None
        self.solver_status_counts: Counter[str] = Counter()
        self.baselines: BaselineCandidates | None = None
        if config.baselines and policy in ("dyncp", HYBRID_POLICY):
            self.baselines = BaselineCandidates(self.topology, max_length=config.max_length)
        self.static_cp: int | None = None
        if policy in ("static", "dp-balanced"):
            if config.max_length is None:
                raise ValueError(f"policy {policy!r} needs max_length (longest admitted document)")
            self.static_cp = static_cp_size(config.max_length, self.topology)

    # ------------------------------------------------------------------------ budget, baselines
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

    def _build_baselines(self, batch: Batch, deadline: float | None) -> list[BaselinePlan]:
        """The baseline plans built by ``deadline`` (all in deterministic mode): each as rings
        (what the search continues from) and as handed out (a hybrid policy's with its splits
        chosen), with its seconds under the model and the planner's timing."""
        if self.baselines is None:
            return []
        out = []
        for name, rings in self.baselines.plans(batch, self.model, deadline=deadline):
            rings.policy = self.policy
            final = rings
            if self.policy == HYBRID_POLICY:
                final = choose_splits(rings, self.model)
                final.policy = self.policy
            seconds = self._seconds(final, self.model)
            out.append(BaselinePlan(name, rings, final, seconds))
        return out

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
        # The batch's per-sequence facts on this topology, derived once for every stage.
        batch = Batch(lengths, self.topology)
        if budget is not None and not isinstance(budget, StepBudget):
            raise ValueError(f"budget must be a StepBudget or None, got {budget!r}")
        budget = budget if budget is not None else self.budget
        stats: dict = {"timings": {}}  # wall-clock values live under "timings", apart
        simple: float | None = None  # the closed-form bound, when the budget follows it
        if budget is not None and self.policy in ("dyncp", HYBRID_POLICY):
            simple = lower_bound(batch, self.topology, self.search_model)
        pipeline = self.pipeline
        if pipeline is not None:  # the pipelined bound: reported, and what the budget follows
            pbound = pipeline_lower_bound(batch, self.topology, pipeline, self.model).seconds
            stats["pipeline_bound"] = pbound
        predicted = simple if pipeline is None or simple is None else pbound
        limit = self._budget_seconds(budget, predicted, stats)
        pipe_limit = PIPELINE_SHARE * limit if pipeline is not None else 0.0
        limit -= pipe_limit
        defer = pipeline is None and self._defers(len(lengths), limit)
        tail = self._tail_seconds
        if tail is None:  # first call: an estimate from the batch's size
            tail = TAIL_SECONDS_PER_SEQUENCE * len(lengths)
            if not defer and self.bound == "tight":
                tail += BOUND_SECONDS_PER_SEQUENCE * len(lengths)
        reserve = min(max(self.reserve_seconds, 1.1 * tail), 0.5 * limit)
        align = self._align_budget(start, limit, reserve)
        if align is not None:  # alignment's share is not the search's
            limit *= 1.0 - ALIGN_SHARE
        deadline = None if self.deterministic else start + limit - reserve
        quick = pipeline is None and quick_chosen(self.config.construction, len(lengths), limit)
        if self.config.construction != "search":
            stats["constructor"] = "quick" if quick else "search"
        baselines = (
            [] if quick else self._build_baselines(batch, self._baseline_deadline(start, deadline))
        )
        plan, greedy = self._construct(batch, deadline, quick=quick)
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
        seconds = cost.step_seconds
        if self.config.passes == "aligned":  # the best in lockstep of the plan and baselines
            others = list(baselines)
            unaligned = plan
            best, plan, report = align_best(
                [plan, *(b.final for b in others)], self.model, self.config.sharding, align
            )
            if best:
                stats["chosen"] = f"baseline:{others[best - 1].name}"
            if plan is not unaligned:  # else ``cost`` is still the plan's
                cost = self._price(plan, self.model)
            seconds = report.seconds_after
            stats["alignment"] = report.as_dict()
        if pipeline is not None:
            named = [(self.policy, plan), *((b.name, b.rings) for b in baselines)]
            plan, seconds = self._pipelined(batch, named, stats, start, limit, pipe_limit)
        t0 = time.perf_counter()
        plan.validate()
        t1 = time.perf_counter()
        plan.stats.update(stats)
        st = plan.stats  # a PlanStats (dyncp.plan.stats): typed fields
        st.policy, st.timing = self.policy, self.timing
        st.predicted_step_seconds = seconds
        st.imbalance, st.efficiency = cost.imbalance, cost.efficiency
        st.waves = len(plan.waves)
        if pipeline is not None:
            st.imbalance = st.efficiency = None  # (the unpipelined plan's; the slots differ)
        elif defer:
            search_model = self.search_model
            st.bound = {"kind": "tight"}
            self._deferred.submit(
                plan,
                lambda: self._bound_fields(batch, seconds, search_model, tight=True, simple=simple),
                lambda exc: self._bound_fields(
                    batch, seconds, search_model, tight=False, failed=exc, simple=simple
                ),
            )
        else:
            fields = self._bound_fields(
                batch,
                seconds,
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
        profiled = isinstance(getattr(self.model, "profile", None), Profile)  # not plug-ins
        if self.config.step_parts and profiled:  # after plan_seconds: not planning time
            t3 = time.perf_counter()
            parts = step_parts(plan, self.model, planned_seconds=seconds, timing=self.timing)
            st.step_parts = parts.as_dict()
            plan.stats["timings"]["step_parts_seconds"] = time.perf_counter() - t3
        return plan

    def _align_budget(self, start: float, limit: float, reserve: float) -> AlignBudget | None:
        """Alignment's budget (``passes="aligned"``, else None): what is left of ``limit``
        after the search's ``1 - ALIGN_SHARE`` of it, up to the reserve; in deterministic mode
        ``ALIGN_SHARE`` x ``limit`` x ``ALIGN_WORK_PER_SECOND`` work units, never a clock."""
        if self.config.passes != "aligned":
            return None
        if self.deterministic:
            return AlignBudget(work=int(ALIGN_SHARE * limit * ALIGN_WORK_PER_SECOND))
        return AlignBudget(deadline=start + limit - reserve)

    def _defers(self, sequences: int, limit: float) -> bool:
        """Whether this batch's bounds are computed after ``plan()`` returns
        (``dyncp.planner.bounds.report.defers``)."""
        return defers(
            bound=self.bound,
            defer_bound=self.defer_bound,
            deterministic=self.deterministic,
            sequences=sequences,
            limit=limit,
        )

    def _bound_fields(
        self,
        batch: Batch,
        seconds: float,
        search_model: CostModel | SplitEnvelope,
        *,
        tight: bool,
        failed: BaseException | None = None,
        simple: float | None = None,
    ) -> dict:
        """The bound fields of ``stats`` for a plan of ``seconds``
        (``dyncp.planner.bounds.report.bound_fields``)."""
        return bound_fields(
            batch,
            self.topology,
            seconds,
            search_model,
            timing=self.timing,
            tight=tight,
            failed=failed,
            simple=simple,
        )

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
