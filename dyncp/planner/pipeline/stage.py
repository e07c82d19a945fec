"""The planner's pipeline stage: from the unpipelined search's plans to the pipelined plan.

``Planner(pipeline=Pipeline(P, V))`` runs its usual search (construction, improvements,
baselines) for ``1 - PIPELINE_SHARE`` of the step's limit, then hands this stage the plans it
found; the stage gets the rest of the limit (in deterministic mode ``ORDER_EVALUATIONS_PER_SECOND``
x its share prices, never a clock). For the dyncp policies it adds:

- constructions at smaller micro-batch token budgets (``TOKEN_BUDGETS`` x capacity, while the
  batch's longest sequence still fits the world): smaller packs are more slots, the bubble's
  share falls and the balance may worsen -- the pipelined price decides;
- the pipelined baselines (``dyncp.planner.baselines.pipeline``: Megatron dev's dynamic CP with
  PP, static CP with PP) as candidates, so the plan handed out is never slower than theirs;

and chooses with ``PipelineSearch`` (``dyncp.planner.pipeline.search``). The other policies
are pipelined as their baseline would be (``megatron`` as ``megatron-pp``, ``static`` as
``static-pp``; the rest read as slots, count aligned, in their own order).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.pipeline_timing import StageCosts, price_pipeline, stage_costs
from dyncp.plan import Pipeline, StepPlan, Topology
from dyncp.planner.baselines.pipeline import megatron_pp_plan, static_pp_plan
from dyncp.planner.baselines.static import static_cp_size
from dyncp.planner.batch import Batch
from dyncp.planner.construction.greedy import GreedyConstructor
from dyncp.planner.pipeline.order import OrderPrice, OrderPricer
from dyncp.planner.pipeline.search import PipelineSearch, slotted

__all__ = [
    "ORDER_EVALUATIONS_PER_SECOND",
    "PIPELINE_SHARE",
    "TOKEN_BUDGETS",
    "PipelineStage",
    "PipelineStats",
    "priced_stage",
    "reordering_pricer",
]

#: Share of the step's planning limit the pipeline stage keeps (the unpipelined search gets the
#: rest). Half, as pass alignment does (``dyncp.planner.planner.ALIGN_SHARE``): the stage's
#: extra constructions cost about what the first one did, and the order search takes what is
#: left.
PIPELINE_SHARE = 0.5
#: Micro-batch token budgets tried beside the planner's capacity, as shares of it: each
#: halving about doubles the slots (module docstring).
TOKEN_BUDGETS = (0.5, 0.25)
#: Prices the order search makes per second of its share in deterministic mode (where a clock
#: would make plans differ between ranks); measured with ``bench/pipeline_bench.py --latency``.
ORDER_EVALUATIONS_PER_SECOND = 200


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


class PipelineStage:
    """The pipeline stage of one planner (module docstring).

    Args:
        pipeline: stages and virtual stages.
        topology: the planner's topology.
        model: its cost model.
        pricer: each plan's pipelined step seconds by slot order (``order.OrderPricer``).
        bubble: the bubble fraction of a plan (reported only), or None.
        bound: the pipelined lower bound of a batch (reported only), or None.
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
        bound: Callable[[StepPlan], float] | None = None,
        timing: str = "dataflow",
        max_length: int | None = None,
        seed: int = 0,
    ) -> None:
        self.pipeline, self.topology, self.model = pipeline, topology, model
        self.pricer, self.bubble, self.bound = pricer, bubble, bound
        self.timing, self.max_length = timing, max_length
        self.search = PipelineSearch(pipeline, model, pricer, seed=seed)

    def baselines(self, batch: Batch) -> list[tuple[str, StepPlan]]:
        """The PP baselines' plans of ``batch`` that can be built (too few sequences to align:
        none)."""
        out = []
        longest = int(batch.lengths.max())
        cp = static_cp_size(max(longest, self.max_length or 0), self.topology)
        for name, build in (
            ("megatron-pp", lambda: megatron_pp_plan(batch, self.topology, self.pipeline)),
            (
                "static-pp",
                lambda: static_pp_plan(batch, self.topology, self.model, cp, self.pipeline),
            ),
        ):
            try:
                out.append((name, build()))
            except ValueError:
                continue
        return out

    def constructions(self, batch: Batch, deadline: float | None) -> list[tuple[str, StepPlan]]:
        """The dyncp construction at each of ``TOKEN_BUDGETS`` x capacity, each with an equal
        share of the time to ``deadline``; as plans of the planner's topology."""
        out = []
        longest = int(batch.lengths.max())
        for k, share in enumerate(TOKEN_BUDGETS):
            capacity = int(share * self.topology.capacity)
            topo = replace(self.topology, capacity=capacity)
            if capacity < 1 or topo.min_cp(longest) is None:
                continue
            until = None
            if deadline is not None:
                now = time.perf_counter()
                until = now + max(deadline - now, 0.0) / (len(TOKEN_BUDGETS) - k + 1)
            plan = GreedyConstructor(
                Batch(batch.lengths, topo), topo, self.model, timing=self.timing
            ).best(deadline=until)
            plan.topology = self.topology
            out.append((f"tokens-{share:g}", plan))
        return out

    def run(
        self,
        batch: Batch,
        plans: Sequence[tuple[str, StepPlan]],
        *,
        search: bool,
        evaluations: int,
        deadline: float | None = None,
    ) -> tuple[StepPlan, PipelineStats]:
        """The pipelined plan of ``batch`` from the unpipelined ``plans`` (the policy's own
        first); ``search``: the dyncp policies' search (module docstring), else the policy's
        plan pipelined as its baseline would be."""
        if not search:
            return self._policy(batch, plans[0])
        baselines = self.baselines(batch)
        extra = self.constructions(batch, deadline)
        priced = self.search.candidates([*plans, *extra], baselines, deadline=deadline)
        own = {c.name: c.own_seconds for c in priced if c.name in dict(baselines)}
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
            baselines=own,
        )
        return choice.plan, stats

    def _policy(self, batch: Batch, named: tuple[str, StepPlan]) -> tuple[StepPlan, PipelineStats]:
        """A baseline policy's plan pipelined (module docstring), in its own order."""
        name, plan = named
        if plan.policy == "megatron":
            slots = megatron_pp_plan(batch, self.topology, self.pipeline)
        elif plan.policy == "static":
            cp = max(g.size for w in plan.waves for g in w.groups)
            slots = static_pp_plan(batch, self.topology, self.model, cp, self.pipeline)
        else:
            found = slotted(plan, self.pipeline, self.model, 1)
            if found is None:
                raise ValueError(
                    f"policy {plan.policy!r}: the batch has too few sequences for a slot count "
                    f"that is a multiple of {self.pipeline.slot_multiple()}"
                )
            slots = found
        slots.policy = plan.policy
        seconds = self.pricer(slots)(range(len(slots.waves)))
        stats = self._stats(
            slots, seconds, chosen=name, rule=seconds, evaluations=0, accepted=0,
            candidates={name: seconds}, baselines={},
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
    ) -> PipelineStats:
        bound = self.bound(plan) if self.bound is not None else None
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
    position), only the schedule re-run."""

    def prepare(plan: StepPlan) -> OrderPrice:
        costs = stage_costs(plan, model)

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
            return price_pipeline(plan, model, costs=moved).step_seconds

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
