"""Planner facade: one object, one ``plan(lengths)`` call, any policy, stats attached.

    planner = Planner(model, world=64, ranks_per_node=8, capacity=16384, policy="dyncp")
    plan = planner.plan(lengths)          # validated StepPlan
    plan.stats["predicted_step_seconds"], plan.stats["gap_to_lower_bound"]

The ``improver`` hook takes the constructed plan and may return a better one (the CP-SAT
improvement plugs in here); whatever it returns is validated and kept only if it is predicted to
be faster, so an improver can never make a plan worse or invalid.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import PlanError, StepPlan, Topology
from dyncp.planner.bound import lower_bound
from dyncp.planner.greedy import greedy_plan
from dyncp.planner.megatron import megatron_plan
from dyncp.planner.static import batch_adaptive_plan, fixed_cp_plan, static_cp_size

__all__ = ["Planner", "POLICIES", "Improver"]

POLICIES = ("static", "batch-adaptive", "megatron", "dyncp")

Improver = Callable[[StepPlan, CostModel], StepPlan]

log = logging.getLogger(__name__)


class Planner:
    """Plans steps under one policy.

    Args:
        model: cost model used to choose (dyncp, batch-adaptive) and to report predictions.
        world, ranks_per_node, capacity: the DP x CP ranks and tokens per rank per micro-batch.
        policy: one of ``POLICIES``.
        max_length: longest admitted document; sets the static policy's CP size (required for
            ``static``).
        group_sizes: allowed CP sizes (default: powers of two up to world).
        improver: optional anytime improvement of the constructed plan (dyncp policy only).
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
        improver: Improver | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if model.ranks_per_node != ranks_per_node:
            raise ValueError(
                f"cost model built for ranks_per_node={model.ranks_per_node}, planner has "
                f"{ranks_per_node}"
            )
        self.model = model
        self.topology = Topology(world, ranks_per_node, capacity, tuple(group_sizes))
        self.policy = policy
        self.improver = improver
        self.static_cp: int | None = None
        if policy == "static":
            if max_length is None:
                raise ValueError("policy 'static' needs max_length (the longest admitted document)")
            self.static_cp = static_cp_size(max_length, self.topology)

    def _construct(self, lengths: np.ndarray) -> StepPlan:
        topo, model = self.topology, self.model
        if self.policy == "static":
            assert self.static_cp is not None
            return fixed_cp_plan(lengths, topo, model, self.static_cp)
        if self.policy == "batch-adaptive":
            return batch_adaptive_plan(lengths, topo, model)
        if self.policy == "megatron":
            return megatron_plan(lengths, topo)
        return greedy_plan(lengths, topo, model)

    def plan(self, lengths: Sequence[int] | np.ndarray) -> StepPlan:
        """A validated plan for one global batch, with predictions and timings in ``stats``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 1).any():
            raise ValueError("lengths must be a 1-D sequence of positive integers")
        start = time.perf_counter()
        plan = self._construct(lengths)
        if self.improver is not None and self.policy == "dyncp":
            plan = self._improve(plan)
        elapsed = time.perf_counter() - start
        plan.validate()
        cost = evaluate_plan(plan, self.model)
        bound = lower_bound(lengths, self.topology, self.model)
        plan.stats.update(
            policy=self.policy,
            plan_seconds=elapsed,
            predicted_step_seconds=cost.step_seconds,
            imbalance=cost.imbalance,
            efficiency=cost.efficiency,
            waves=len(plan.waves),
            lower_bound_seconds=bound,
            gap_to_lower_bound=cost.step_seconds / bound - 1.0 if bound > 0 else 0.0,
        )
        return plan

    def _improve(self, plan: StepPlan) -> StepPlan:
        assert self.improver is not None
        try:
            better = self.improver(plan, self.model)
            if better.lengths != plan.lengths or better.topology != plan.topology:
                raise ValueError("improver returned a plan for another batch or topology")
            better.validate()
        except (PlanError, ValueError, RuntimeError) as exc:
            log.warning("improver failed, keeping the constructed plan: %s", exc)
            return plan
        old = evaluate_plan(plan, self.model).step_seconds
        new = evaluate_plan(better, self.model).step_seconds
        return better if new < old else plan
