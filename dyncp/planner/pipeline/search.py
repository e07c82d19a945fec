"""Choosing a pipelined plan: which groups and packs, how many slots, in which order.

The unpipelined search (``dyncp.planner.construction`` and the improvements) already balances
columns; the pipeline adds a second concern, its bubbles: warm-up and cool-down cost about
``(stages - 1)`` slot-times of the slots at the ends, so fewer, larger slots balance better but
bubble more, and more, smaller ones the reverse. Rather than weigh the two by a rule,
:class:`PipelineSearch` prices each candidate with the pipelined price and keeps the fastest:

1. every unpipelined candidate plan (the planner's own, its constructions at smaller micro-batch
   token budgets, the baselines') is read as slots (``slots.to_slots``) and its count raised to
   at least ``stages`` and the schedule's multiple by halving its most expensive slots
   (``slots.split_to``); each is also tried with twice that many slots (smaller packs, fewer
   bubbles, worse balance -- the price decides);
2. already pipelined candidates (the PP baselines) come as they are;
3. each candidate is priced in its own order and in verl's (``order.ends_small_order``), the
   better kept;
4. the fastest candidate's order is then searched (``order.OrderSearch``) with what is left of
   the evaluation budget and the deadline.

The result is never slower than any candidate in either order, in particular than the PP
baselines, and never slower than verl's ordering of the chosen plan.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dyncp.cost_model.model import CostModel
from dyncp.plan import Pipeline, StepPlan
from dyncp.planner.pipeline.order import (
    OrderPrice,
    OrderPricer,
    OrderResult,
    OrderSearch,
    ends_small_order,
)
from dyncp.planner.pipeline.slots import (
    slot_seconds,
    split_steps,
    target_slots,
    to_slots,
    with_order,
    with_waves,
)

__all__ = ["COUNT_FACTORS", "PipelineCandidate", "PipelineChoice", "PipelineSearch", "slotted"]

#: Slot counts tried per unpipelined candidate, as multiples of ``target_slots``: the least the
#: schedule allows, and twice it (step 1 of the module docstring).
COUNT_FACTORS = (1, 2)


@dataclass(frozen=True, slots=True)
class PipelineCandidate:
    """One pipelined candidate: its name, plan (in its better order) and prices."""

    name: str
    plan: StepPlan
    seconds: float  # the better of its own order and verl's
    rule_seconds: float  # in verl's order
    own_seconds: float  # in the order it came in
    price: OrderPrice = field(compare=False, repr=False)  # ``plan``'s, by slot order


@dataclass(frozen=True, slots=True)
class PipelineChoice:
    """What :meth:`PipelineSearch.choose` chose: the plan, its seconds, where it came from."""

    plan: StepPlan
    seconds: float
    name: str
    rule_seconds: float  # the chosen candidate in verl's order
    order: OrderResult | None
    candidates: dict[str, float] = field(default_factory=dict)  # name -> best seconds


def slotted(plan: StepPlan, pipeline: Pipeline, model: CostModel, factor: int) -> StepPlan | None:
    """``plan`` as slots with ``factor`` x the target count, or, where it cannot be split that
    far, the most slots it can be split to that the schedule allows; None when not even the
    least count the schedule allows can be split out of it."""
    slots = to_slots(plan, pipeline)
    m, k = len(slots.waves), pipeline.slot_multiple()
    least = -(-m // k) * k
    want = max(factor * target_slots(m, pipeline), least)
    steps = split_steps(slots, want, model)  # one split, read at two counts
    most = len(steps[-1])
    if most < least:
        return None
    return with_waves(slots, steps[most - most % k - m])


class PipelineSearch:
    """Prices pipelined candidates and searches the best one's order (module docstring).

    Args:
        pipeline: the stages and virtual stages.
        model: the cost model (slot seconds for splits and verl's rule).
        pricer: each plan's pipelined step seconds by slot order (``order.OrderPricer``).
        seed: the order search's seed.
    """

    def __init__(
        self, pipeline: Pipeline, model: CostModel, pricer: OrderPricer, *, seed: int = 0
    ) -> None:
        self.pipeline, self.model, self.pricer, self.seed = pipeline, model, pricer, seed

    def candidate(self, name: str, plan: StepPlan) -> PipelineCandidate:
        """``plan`` (pipelined) priced in its own order and in verl's; the better kept."""
        price = self.pricer(plan)
        n = len(plan.waves)
        own = price(range(n))
        rule_order = ends_small_order(slot_seconds(plan, self.model))
        rule = price(rule_order)
        if rule < own:
            ruled = with_order(plan, rule_order)
            return PipelineCandidate(
                name, ruled, rule, rule, own, lambda o: price([rule_order[i] for i in o])
            )
        return PipelineCandidate(name, plan, own, rule, own, price)

    def candidates(
        self,
        unpipelined: Sequence[tuple[str, StepPlan]],
        pipelined: Sequence[tuple[str, StepPlan]] = (),
        *,
        factors: Sequence[int] = COUNT_FACTORS,
        deadline: float | None = None,
        first: bool = True,
    ) -> list[PipelineCandidate]:
        """Steps 1-3 of the module docstring, each unpipelined plan at ``factors`` x the
        least slot count; with a ``deadline``, the first candidate is priced whatever the
        time when ``first``, the rest while time is left."""
        out: list[PipelineCandidate] = []
        for name, plan in pipelined:
            if (out or not first) and deadline is not None and time.perf_counter() >= deadline:
                return out
            out.append(self.candidate(name, plan))
        for name, plan in unpipelined:
            previous = 0
            for factor in factors:
                if (out or not first) and deadline is not None and time.perf_counter() >= deadline:
                    return out
                slots = slotted(plan, self.pipeline, self.model, factor)
                if slots is None:
                    continue
                if len(slots.waves) <= previous:
                    continue  # (could not be split further: the same candidate)
                previous = len(slots.waves)
                label = name if factor == 1 else f"{name}x{factor}"
                out.append(self.candidate(label, slots))
        return out

    def choose(
        self,
        candidates: Sequence[PipelineCandidate],
        *,
        evaluations: int,
        deadline: float | None = None,
    ) -> PipelineChoice:
        """The fastest candidate, its order searched (step 4).

        Raises:
            ValueError: no candidate (every plan had too few sequences for the schedule).
        """
        if not candidates:
            raise ValueError(
                f"no pipelined plan: {self.pipeline.schedule} over {self.pipeline.stages} stages "
                f"needs a slot count that is a multiple of {self.pipeline.slot_multiple()}, and "
                "no candidate could be split that far"
            )
        best = min(range(len(candidates)), key=lambda i: (candidates[i].seconds, i))
        chosen = candidates[best]
        search = OrderSearch(evaluations=max(int(evaluations), 0), seed=self.seed)
        result = search.run(
            len(chosen.plan.waves), chosen.price, start_seconds=chosen.seconds, deadline=deadline
        )
        plan = with_order(chosen.plan, result.order) if result.accepted else chosen.plan
        plan.policy = chosen.plan.policy
        return PipelineChoice(
            plan,
            result.seconds,
            chosen.name,
            chosen.rule_seconds,
            result,
            {c.name: c.seconds for c in candidates},
        )
