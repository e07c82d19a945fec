"""PlannerConfig: a planner's options in one frozen, validated record, apart from its cost model.

``Planner(model, world=..., ...)`` builds one from its keywords; ``Planner(model, config=cfg)``
takes one, and ``planner.config`` gives it back, so a planner with other options is
``Planner(model, config=dataclasses.replace(planner.config, ...))`` instead of a hand copy of its
arguments (the plan service's fallback, a new model version). Options are validated here, where
they can be without the model; what needs the model (its ``ranks_per_node``, the heads its
profile names, the topology built from both) is checked by ``Planner``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dyncp.cost_model.evaluate import check_timing
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.sharding import ShardingCost
from dyncp.plan import Pipeline, StepPlan
from dyncp.planner.budget import StepBudget
from dyncp.planner.improvement.cpsat import CpSatImprover
from dyncp.planner.improvement.pass_align import PASSES

__all__ = [
    "ALL_POLICIES",
    "BOUNDS",
    "CONSTRUCTIONS",
    "DEFAULT_TIME_LIMIT",
    "DEFER_BOUND",
    "HYBRID_POLICY",
    "Improver",
    "PASSES",
    "POLICIES",
    "PlannerConfig",
]

#: Policies that run rings only (every group u = 1).
POLICIES = ("static", "dp-balanced", "batch-adaptive", "megatron", "dyncp")
#: dyncp with a head split chosen per group (needs ``head_sizes`` beyond 1).
HYBRID_POLICY = "dyncp-hybrid"
ALL_POLICIES = (*POLICIES, HYBRID_POLICY)
BOUNDS = ("tight", "simple")
CONSTRUCTIONS = ("search", "quick", "auto")
DEFER_BOUND = ("auto", "always", "never")
#: Seconds per step without ``time_limit`` or ``budget``.
DEFAULT_TIME_LIMIT = 0.1

Improver = Callable[[StepPlan, CostModel], StepPlan]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """The options of a ``Planner`` (everything but its cost model).

    Args:
        world, ranks_per_node, capacity: the DP x CP ranks and tokens per rank per micro-batch.
        policy: one of ``ALL_POLICIES``.
        max_length: longest admitted document; sets the static policy's CP size (required for
            ``static`` and ``dp-balanced``).
        group_sizes: allowed CP sizes (default: powers of two dividing world).
        time_limit: seconds the dyncp policy may spend per step (deterministic units in
            deterministic mode); default ``DEFAULT_TIME_LIMIT``. Not with ``budget``.
        deterministic: reproducible CP-SAT (``dyncp.planner.planner``'s docstring).
        cpsat: the CP-SAT improver; ``None`` disables it. Default (``"default"``):
            ``CpSatImprover(deterministic=deterministic)``.
        min_improve_seconds: CP-SAT runs only when at least this much of ``time_limit`` is left
            after the greedy (building its model alone takes tens of milliseconds).
        improver: optional user improvement of the plan (dyncp policy only), same guarantees.
        bound: ``"tight"`` (LP, reported every step) or ``"simple"`` (closed form: skips the LP,
            e.g. in the plan service where latency matters more than the report).
        defer_bound: ``"auto"``, ``"always"`` or ``"never"``: whether the bounds are computed
            after ``plan()`` returns (``Planner.wait_bound``). Only the tight bound is ever
            deferred.
        reserve_seconds: wall time the anytime constructor leaves for validation, the bound and
            pricing (at most half of ``time_limit``); at least 1.1 x what ran after its deadline
            in the previous call (pricing, validation, a synchronous bound, the constructor's
            own overshoot; on the first call an estimate from the batch's size:
            ``TAIL_SECONDS_PER_SEQUENCE``, plus ``BOUND_SECONDS_PER_SEQUENCE`` when the bound
            is not deferred), still at most half.
        head_sizes: allowed head-parallel degrees u of a group (``Topology.head_sizes``). The
            ``dyncp-hybrid`` policy plans like ``dyncp`` with every group priced at its cheapest
            split and then gives each group its fastest split
            (``dyncp.planner.improvement.head_split``); the other policies run rings (u = 1).
            The lower bound counts the splits whatever the policy, so every policy's gap is
            against the same bound.
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
        layout: run the layout search (``dyncp.planner.improvement.laminar``) on batches of at
            most ``LAYOUT_MAX_SEQUENCES`` sequences, before CP-SAT, with ``LAYOUT_SHARE`` of the
            time left (when that is at least ``LAYOUT_SHARE`` x ``min_improve_seconds``; so
            never at the default ``time_limit``); off with ``cpsat=None`` too.
        passes: ``"free"`` (default: plans as the policy builds them) or ``"aligned"``: every
            rank runs a micro-batch in every pass, as far as moves allow, for FSDP2 full
            sharding (``dyncp.planner.improvement.pass_align``: groups grown into idle ranks,
            counts rebalanced, empty passes only where nothing else fits). The plan is then
            priced as lockstep passes: ``predicted_step_seconds`` is that price and
            ``stats.alignment`` compares it with the unaligned plan's. ``timing="barrier"``
            builds plans whose waves end together, closer to lockstep than dataflow, and often
            gives the faster aligned plan (``bench/fsdp_predict.py``).
        sharding: what full sharding adds to each pass (``dyncp.cost_model.sharding``), used
            by ``passes="aligned"`` (None: collectives priced free).
        pipeline: plan pipelined steps over these stages (``dyncp.plan.pipeline.Pipeline``;
            None: no pipeline parallelism). The plans are then pipelined (slots, one
            micro-batch per group), chosen and ordered by the pipelined price
            (``dyncp.planner.pipeline``), and ``predicted_step_seconds`` is that price. Not with
            ``passes="aligned"`` (lockstep passes are another schedule).
        construction: how the dyncp policies construct a plan: ``"search"`` (default: the
            greedy constructor's candidates and local search, ``dyncp.planner.construction``),
            ``"quick"`` (``dyncp.planner.construction.quick``: a few vectorised passes, no
            baselines; for the deterministic fallback at scale) or ``"auto"``: quick when the
            search's estimated seconds (``SEARCH_SECONDS_PER_SEQUENCE`` per sequence, a pure
            function of the batch) exceed the step's limit (``time_limit`` or the budget's
            seconds), so a deterministic planner stays within its budget without a clock;
            ``stats["constructor"]`` says which ran. Not for pipelined plans (they search).
        step_parts: also price the step's named parts into ``stats["step_parts"]``
            (``dyncp.cost_model.step_parts``: three more pricings of the plan, after
            ``plan_seconds`` is taken; 0.07 s at 512 ranks, 0.77 s at 4,096 on 2 cores), for
            reports and examples. Off by default: a plan service at scale should not pay it
            inside its step budget.

    Raises:
        ValueError: an option outside what is allowed (the message names it).
    """

    world: int
    ranks_per_node: int
    capacity: int
    policy: str = "dyncp"
    max_length: int | None = None
    group_sizes: tuple[int, ...] = ()
    time_limit: float | None = None
    deterministic: bool = False
    cpsat: CpSatImprover | None | str = "default"
    min_improve_seconds: float = 0.2
    improver: Improver | None = None
    bound: str = "tight"
    defer_bound: str = "auto"
    reserve_seconds: float = 0.03
    head_sizes: tuple[int, ...] = (1,)
    query_heads: int | None = None
    kv_heads: int | None = None
    timing: str = "dataflow"
    budget: StepBudget | None = None
    baselines: bool = True
    layout: bool = True
    passes: str = "free"
    sharding: ShardingCost | None = None
    pipeline: Pipeline | None = None
    step_parts: bool = False
    construction: str = "search"

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_sizes", tuple(self.group_sizes))
        object.__setattr__(self, "head_sizes", tuple(self.head_sizes))
        check_timing(self.timing)
        if self.budget is not None:
            if not isinstance(self.budget, StepBudget):
                raise ValueError(f"budget must be a StepBudget or None, got {self.budget!r}")
            if self.time_limit is not None:
                raise ValueError(
                    "give time_limit (a fixed limit per step) or budget (a share of the "
                    "predicted step, at least budget.floor), not both"
                )
        if self.bound not in BOUNDS:
            raise ValueError(f"unknown bound {self.bound!r}; choose one of {', '.join(BOUNDS)}")
        if self.construction not in CONSTRUCTIONS:
            raise ValueError(
                f"unknown construction {self.construction!r}; choose one of "
                f"{', '.join(CONSTRUCTIONS)}"
            )
        if self.defer_bound not in DEFER_BOUND:
            raise ValueError(
                f"unknown defer_bound {self.defer_bound!r}; choose one of {', '.join(DEFER_BOUND)}"
            )
        if not self.reserve_seconds >= 0:
            raise ValueError(f"reserve_seconds must be >= 0, got {self.reserve_seconds}")
        if self.policy not in ALL_POLICIES:
            raise ValueError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(ALL_POLICIES)}"
            )
        if self.passes not in PASSES:
            raise ValueError(f"unknown passes {self.passes!r}; choose one of {', '.join(PASSES)}")
        if self.sharding is not None:
            if not isinstance(self.sharding, ShardingCost):
                raise ValueError(f"sharding must be a ShardingCost or None, got {self.sharding!r}")
            if self.passes != "aligned":
                raise ValueError(
                    "sharding prices the passes of passes='aligned'; give passes='aligned' "
                    "or leave sharding None"
                )
        if self.pipeline is not None:
            if not isinstance(self.pipeline, Pipeline):
                raise ValueError(
                    f"pipeline must be a Pipeline(stages, virtual) or None, got {self.pipeline!r}"
                )
            if self.passes != "free":
                raise ValueError(
                    "pipeline plans slots in the pipeline's order; give passes='free' with a "
                    f"pipeline, got passes={self.passes!r}"
                )
        if not self.seconds_per_step > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {self.seconds_per_step}")

    @property
    def seconds_per_step(self) -> float:
        """``time_limit`` (default ``DEFAULT_TIME_LIMIT``), or the budget's floor (what a policy
        without a budget, or a planner asked for its ``time_limit``, uses)."""
        if self.budget is not None:
            return self.budget.floor
        return DEFAULT_TIME_LIMIT if self.time_limit is None else self.time_limit
