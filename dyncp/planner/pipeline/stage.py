"""The planner's pipeline stage: from the unpipelined search's plans to the pipelined plan.

``Planner(pipeline=Pipeline(P, V))`` runs its usual search (construction, improvements,
baselines) for ``1 - PIPELINE_SHARE`` of the step's limit, then hands this stage the plans it
found; the stage gets the rest (in deterministic mode ``ORDER_EVALUATIONS_PER_SECOND`` x its
share of prices, never a clock, and every construction below). For the dyncp policies it
prices, most valuable first, while its time lasts (``PipelineSearch.candidates``):

1. whatever the time: the search's plan and the pipelined baselines
   (``dyncp.planner.baselines.pipeline``: Megatron dev's dynamic CP with PP, static CP with PP,
   from the search's own baseline plans; those the search skipped for time are built only when
   they fit, as the search's are), so that the plan handed out is never slower than theirs;
   then while time is left the search's plan at twice the least slot count;
2. new constructions at smaller micro-batch token budgets (``TOKEN_BUDGETS`` x capacity:
   smaller packs *and* the CP sizes that suit them), each only when its build time (the last
   one's, per sequence; ``CONSTRUCT_SECONDS_PER_SEQUENCE`` before the first) fits before the
   deadline less the order search's ``ORDER_SHARE`` (in deterministic mode always, as the
   stretch rule's and the early levels' candidates only: ``PipelineStage._quick``): on the
   batches of ``bench/pipeline_bench.py`` they are the largest gain;
3. the search's plan and those constructions pass-aligned (``dyncp.planner.improvement.
   pass_align``: groups grown into idle ranks and counts rebalanced so that every column runs a
   micro-batch in every pass; read as slots, an aligned plan has no idle column in any slot),
   while the deadline less ``ORDER_SHARE`` allows (deterministic mode: ``ALIGN_WORK_PER_SECOND``
   x the stage's share of work units over them);
4. the search's plan repacked at those budgets (``slots.repack``: the same groups, more and
   smaller packs), then the other baselines' plans as slots;

then searches the order of the fastest (``PipelineSearch.choose``). Smaller packs are more
slots: the bubbles' share falls, the balance across columns may worsen; the pipelined price
decides. The other policies are pipelined as their baseline would be (``megatron`` as
``megatron-pp``, ``static`` as ``static-pp``; the rest read as slots, count aligned, in their own
order).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.pipeline_schedule import ScheduleGraph, schedule_graph
from dyncp.cost_model.pipeline_timing import StageCosts, price_pipeline, stage_costs
from dyncp.plan import Pipeline, StepPlan, Topology
from dyncp.planner.baselines.candidates import SECONDS_PER_SEQUENCE
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.pipeline import megatron_pp_from, static_pp_from
from dyncp.planner.baselines.static import fixed_cp_plan, static_cp_size
from dyncp.planner.batch import Batch
from dyncp.planner.construction.greedy import EARLY_LEVELS, GreedyConstructor
from dyncp.planner.construction.level import LEVEL_FACTORS
from dyncp.planner.construction.stretch import STRUCTURES
from dyncp.planner.improvement.pass_align import AlignBudget, align_best
from dyncp.planner.pipeline.order import OrderPrice, OrderPricer
from dyncp.planner.pipeline.search import COUNT_FACTORS, PipelineSearch, slotted
from dyncp.planner.pipeline.slots import repack

__all__ = [
    "CONSTRUCT_SECONDS_PER_SEQUENCE",
    "ORDER_EVALUATIONS_PER_SECOND",
    "ORDER_SHARE",
    "PIPELINE_SHARE",
    "TOKEN_BUDGETS",
    "PipelineStage",
    "PipelineStats",
    "priced_stage",
    "reordering_pricer",
]

#: Share of the step's planning limit the pipeline stage keeps (the unpipelined search gets the
#: rest): the stage makes up to two constructions (at smaller token budgets, each about what
#: the search's first construction costs) and prices every candidate, the search one
#: construction and its improvements.
PIPELINE_SHARE = 0.6
#: Micro-batch token budgets tried beside the planner's capacity, as shares of it: each
#: halving about doubles the slots.
TOKEN_BUDGETS = (0.5, 0.25)
#: Share of the stage's time kept for the order search when deciding whether a construction
#: fits (the constructions change the step by more than reordering does, on the batches of
#: ``bench/pipeline_bench.py``).
ORDER_SHARE = 0.25
#: Build seconds per sequence of a construction before one has been measured: 0.29 s for
#: 2,560 sequences on 512 ranks at half the capacity with a 0.1 s deadline, this project's
#: 2-core machine (shared).
CONSTRUCT_SECONDS_PER_SEQUENCE = 110e-6
#: Prices the order search makes per second of its share in deterministic mode (where a clock
#: would make plans differ between ranks): the slowest measured, 4.5 ms a price at 512 columns
#: interleaved over 4 stages (8 slots; 0.65 ms under 1F1B, 0.6-1.4 ms at 64 columns), is 222 a
#: second on this project's 2-core machine shared with other jobs; 150 leaves a third for load.
ORDER_EVALUATIONS_PER_SECOND = 150


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineStats:
    """``plan.stats["pipeline"]``: what the pipeline stage chose and how (``as_dict``)."""

    stages: int
    virtual: int
    schedule: str
    slots: int
    predicted_step_seconds: float
    bubble_fraction: float | None
    chosen: str
    rule_step_seconds: float  # the chosen candidate in verl's order
    order_evaluations: int
    order_accepted: int
    candidate_seconds: dict[str, float]
    baseline_seconds: dict[str, float]  # the PP baselines in their own order
    lower_bound_seconds: float | None = None
    gap_to_lower_bound: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, plan: StepPlan) -> PipelineStats:
        """The typed record of a pipelined plan's ``stats["pipeline"]`` (``PlanStats`` lives in
        ``dyncp.plan``, which keeps no planner field of its own for it yet).

        Raises:
            ValueError: the plan was not made by a pipelined planner.
        """
        found = plan.stats.get("pipeline")
        if not isinstance(found, dict):
            raise ValueError(
                "the plan has no stats['pipeline']: plan it with Planner(pipeline=...)"
            )
        return cls(**found)


class PipelineStage:
    """The pipeline stage of one planner (module docstring).

    Args:
        pipeline: stages and virtual stages.
        topology: the planner's topology.
        model: its cost model.
        pricer: each plan's pipelined step seconds by slot order (``order.OrderPricer``).
        bubble: the bubble fraction of a plan (reported only), or None.
        timing: the unpipelined objective of the extra constructions.
        max_length: the longest admitted document (static CP's size), or None.
        seed: the order search's seed.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        topology: Topology,
        model: CostModel,
        pricer: OrderPricer,
        *,
        bubble: Callable[[StepPlan], float] | None = None,
        timing: str = "dataflow",
        max_length: int | None = None,
        seed: int = 0,
    ) -> None:
        self.pipeline, self.topology, self.model = pipeline, topology, model
        self.pricer, self.bubble = pricer, bubble
        self.timing, self.max_length = timing, max_length
        self.search = PipelineSearch(pipeline, model, pricer, seed=seed)
        #: Build seconds per sequence of the last construction (module docstring, step 2) and
        #: of each baseline built here.
        self.construct_per_sequence = CONSTRUCT_SECONDS_PER_SEQUENCE
        self.build_per_sequence: dict[str, float] = {}

    def baselines(
        self, batch: Batch, plans: dict[str, StepPlan], deadline: float | None = None
    ) -> list[tuple[str, StepPlan]]:
        """The PP baselines' plans of ``batch``, from the search's ``megatron`` and ``static``
        plans where given (the same plans: built once), else built -- with a ``deadline`` only
        when the build is expected to end before it (the last build's seconds per sequence;
        ``SECONDS_PER_SEQUENCE`` before the first), as the search's own baselines are; a
        baseline that cannot align the batch (too few sequences) is no candidate."""
        out = []
        longest = int(batch.lengths.max())
        cp = static_cp_size(max(longest, self.max_length or 0), self.topology)
        builders: dict[str, tuple[str, Callable[[], StepPlan]]] = {
            "megatron-pp": ("megatron", lambda: megatron_plan(batch, self.topology)),
            "static-pp": ("static", lambda: fixed_cp_plan(batch, self.topology, self.model, cp)),
        }
        for name, (base, build) in builders.items():
            plan = plans.get(base)
            if plan is None:
                expected = len(batch) * self.build_per_sequence.get(name, SECONDS_PER_SEQUENCE)
                if deadline is not None and time.perf_counter() + expected > deadline:
                    continue
                t0 = time.perf_counter()
                plan = build()
                self.build_per_sequence[name] = (time.perf_counter() - t0) / len(batch)
            try:
                if name == "megatron-pp":
                    out.append((name, megatron_pp_from(plan, self.pipeline)))
                else:
                    out.append((name, static_pp_from(plan, self.pipeline, self.model)))
            except ValueError:
                continue
        return out

    def constructions(
        self, batch: Batch, deadline: float | None, reserve: float
    ) -> list[tuple[str, StepPlan]]:
        """The dyncp construction at each of ``TOKEN_BUDGETS`` x capacity (module docstring,
        step 3), as plans of the planner's topology."""
        out = []
        longest = int(batch.lengths.max())
        for share in TOKEN_BUDGETS:
            capacity = int(share * self.topology.capacity)
            topo = replace(self.topology, capacity=capacity)
            if capacity < 1 or topo.min_cp(longest) is None:
                continue
            until = None
            if deadline is not None:
                now = time.perf_counter()
                expected = self.construct_per_sequence * len(batch)
                if now + expected > deadline - reserve:
                    break
                until = now + expected
            t0 = time.perf_counter()
            greedy = GreedyConstructor(
                Batch(batch.lengths, topo), topo, self.model, timing=self.timing
            )
            plan = greedy.best(deadline=until) if deadline is not None else self._quick(greedy)
            self.construct_per_sequence = (time.perf_counter() - t0) / len(batch)
            plan.topology = self.topology
            out.append((f"tokens-{share:g}", plan))
        return out

    def _quick(self, greedy: GreedyConstructor) -> StepPlan:
        """Deterministic mode's construction (no clock): the stretch rule's and the early
        levels' candidates of ``greedy`` (``GreedyConstructor.candidates`` without the
        structure search, whose unbounded run takes minutes at 512 ranks and smaller token
        budgets), the fastest under the planner's timing."""
        k = greedy.choose_sizes(*STRUCTURES[0])
        ideal = greedy.ideal_seconds()
        plans = [greedy.build(k, level) for level in greedy.levels(k)]
        plans += [greedy.build_level(ideal * f) for f in LEVEL_FACTORS[:EARLY_LEVELS]]
        seconds = [evaluate_plan(p, self.model, timing=self.timing).step_seconds for p in plans]
        return plans[min(range(len(plans)), key=lambda i: (seconds[i], i))]

    def run(
        self,
        batch: Batch,
        plans: Sequence[tuple[str, StepPlan]],
        *,
        search: bool,
        evaluations: int,
        deadline: float | None = None,
        bound: float | None = None,
        align_work: int | None = None,
    ) -> tuple[StepPlan, PipelineStats]:
        """The pipelined plan of ``batch`` from the unpipelined ``plans`` (the policy's own
        first, then the baselines' by name); ``search``: the dyncp policies' search (module
        docstring), else the policy's plan pipelined as its baseline would be. ``bound``: the
        batch's pipelined lower bound (reported with the gap to it); ``align_work``: the pass
        alignments' work units (deterministic mode)."""
        if not search:
            return self._policy(batch, plans[0], bound)
        reserve = 0.0
        if deadline is not None:
            reserve = ORDER_SHARE * max(deadline - time.perf_counter(), 0.0)
        own_name, own = plans[0]
        baselines = self.baselines(batch, dict(plans[1:]), deadline)
        find = self.search.candidates
        # Whatever the time: the search's plan and the PP baselines (never slower than them).
        priced = find([(own_name, own)], baselines, factors=(1,))
        doubled = find([(own_name, own)], factors=COUNT_FACTORS[1:], deadline=deadline, first=False)
        priced += [c for c in doubled if len(c.plan.waves) > len(priced[-1].plan.waves)]
        extra = self.constructions(batch, deadline, reserve)
        priced += find(extra, deadline=deadline, first=False)
        aligned = []
        for name, plan in [(own_name, own), *extra]:
            if deadline is not None and time.perf_counter() >= deadline - reserve:
                break
            budget = AlignBudget(
                deadline=None if deadline is None else deadline - reserve,
                work=None if align_work is None else align_work // (1 + len(extra)),
            )
            aligned.append((f"{name}-aligned", align_best([plan], self.model, None, budget)[1]))
        priced += find(aligned, factors=(1,), deadline=deadline, first=False)
        for share in TOKEN_BUDGETS:
            capacity = int(share * self.topology.capacity)
            if capacity < 1 or (deadline is not None and time.perf_counter() >= deadline):
                continue
            smaller = [(f"{own_name}-repacked-{share:g}", repack(own, capacity))]
            priced += find(smaller, factors=(1,), deadline=deadline, first=False)
        priced += find(plans[1:], factors=(1,), deadline=deadline, first=False)
        own_seconds = {c.name: c.own_seconds for c in priced if c.name in dict(baselines)}
        choice = self.search.choose(priced, evaluations=evaluations, deadline=deadline)
        order = choice.order
        stats = self._stats(
            choice.plan,
            choice.seconds,
            chosen=choice.name,
            rule=choice.rule_seconds,
            evaluations=order.evaluations if order is not None else 0,
            accepted=order.accepted if order is not None else 0,
            candidates=choice.candidates,
            baselines=own_seconds,
            bound=bound,
        )
        return choice.plan, stats

    def _policy(
        self, batch: Batch, named: tuple[str, StepPlan], bound: float | None
    ) -> tuple[StepPlan, PipelineStats]:
        """A baseline policy's plan pipelined (module docstring), in its own order."""
        name, plan = named
        if name == "megatron":
            slots = megatron_pp_from(plan, self.pipeline)
        elif name == "static":
            slots = static_pp_from(plan, self.pipeline, self.model)
        else:
            found = slotted(plan, self.pipeline, self.model, 1)
            if found is None:
                raise ValueError(
                    f"policy {name!r}: the batch has too few sequences for a slot count that is a "
                    f"multiple of {self.pipeline.slot_multiple()}"
                )
            slots = found
        seconds = self.pricer(slots)(range(len(slots.waves)))
        stats = self._stats(
            slots, seconds, chosen=name, rule=seconds, evaluations=0, accepted=0,
            candidates={name: seconds}, baselines={}, bound=bound,
        )  # fmt: skip
        return slots, stats

    def _stats(
        self,
        plan: StepPlan,
        seconds: float,
        *,
        chosen: str,
        rule: float,
        evaluations: int,
        accepted: int,
        candidates: dict[str, float],
        baselines: dict[str, float],
        bound: float | None,
    ) -> PipelineStats:
        return PipelineStats(
            stages=self.pipeline.stages,
            virtual=self.pipeline.virtual,
            schedule=self.pipeline.schedule,
            slots=len(plan.waves),
            predicted_step_seconds=seconds,
            bubble_fraction=self.bubble(plan) if self.bubble is not None else None,
            chosen=chosen,
            rule_step_seconds=rule,
            order_evaluations=evaluations,
            order_accepted=accepted,
            candidate_seconds=candidates,
            baseline_seconds=baselines,
            lower_bound_seconds=bound,
            gap_to_lower_bound=(seconds / bound - 1.0) if bound else None,
        )


def reordering_pricer(model: CostModel) -> OrderPricer:
    """``price_pipeline`` under ``model`` by slot order: each plan's operation costs
    (``stage_costs``) computed once, permuted per order (a slot's costs do not depend on its
    position), only the schedule re-run, on a graph built once per slot count
    (``schedule_graph``)."""
    graphs: dict[tuple[Pipeline, int], ScheduleGraph] = {}

    def prepare(plan: StepPlan) -> OrderPrice:
        costs = stage_costs(plan, model)
        assert plan.pipeline is not None
        key = (plan.pipeline, len(plan.waves))
        if key not in graphs:
            graphs[key] = schedule_graph(*key)
        graph = graphs[key]

        def price(order) -> float:  # type: ignore[no-untyped-def]
            o = np.asarray(list(order), dtype=np.int64)
            moved = StageCosts(
                costs.pipeline,
                costs.forward[o],
                costs.backward[o],
                costs.transfer[o],
                costs.busy[o],
                tuple(costs.segments[i] for i in o),
            )
            return price_pipeline(plan, model, costs=moved, graph=graph).step_seconds

        return price

    return prepare


def priced_stage(
    pipeline: Pipeline,
    topology: Topology,
    model: CostModel,
    *,
    timing: str = "dataflow",
    max_length: int | None = None,
    seed: int = 0,
) -> PipelineStage:
    """A ``PipelineStage`` priced by ``dyncp.cost_model.pipeline_timing.price_pipeline``."""
    return PipelineStage(
        pipeline,
        topology,
        model,
        reordering_pricer(model),
        bubble=lambda plan: price_pipeline(plan, model).bubble_fraction,
        timing=timing,
        max_length=max_length,
        seed=seed,
    )
