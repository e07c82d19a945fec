"""The whole step as a sum of named parts, so a predicted speedup is an end-to-end one.

The planner's objective (``evaluate_plan``) is the time of a step's micro-batches: attention,
linear work, rings and all-to-alls, the fixed cost of each forward+backward, the waves'
synchronisation. A training step also pays for its embedding and LM head with its loss (per
token, in every micro-batch), its gradient reduction and its optimizer update. The last two are
paid once per step whatever the plan; left out, they make every speedup look larger than the
user will see (a step that is half optimizer and reduction can at best get 2x faster).

:class:`StepParts` is one step's parts on its critical rank (the busiest one):

- ``attention``, ``linear``, ``communication``, ``launch``, ``embedding_head``: what that rank's
  micro-batches cost. Each is read off the cost model itself, never re-derived: the plan is
  priced once as planned, once with free links (the difference is the communication its compute
  does not hide) and once more also without linear work (the difference is linear work plus the
  per-token embedding and head, split between them by their per-token seconds); what is left is
  attention (every mixer's compute with its kernels' fixed costs) and ``launch``, the profile's
  fixed cost of each micro-batch.
- ``synchronisation``: the rest of the planned step (the waves' overheads, and waiting for the
  slowest group under the plan's timing, or a pass-timed or pipelined price's extra). The six
  sum to ``planned``, the planner's ``predicted_step_seconds``.
- ``gradient_reduction``, ``optimizer``, ``fixed``: the common parts (:func:`common_parts`), the
  same for every policy on a given world, priced from the profile's ``step`` (a version-2
  profile); a version-1 profile has no step and prices them 0, so it prices exactly as before.

Gradient reduction, by integration mode (``schema.INTEGRATIONS``), over the profile's measured
links (``sharding.collective_from_profile``, where an all-gather or a reduce-scatter of B bytes
over the world costs ``latency + B / bandwidth``):

- ``ddp``: an all-reduce of the gradients, priced as a reduce-scatter plus an all-gather of
  them (the ring all-reduce of Thakur, Rabenseifner and Gropp, IJHPCA 2005); every rank updates
  every parameter;
- ``fsdp2-once`` (gather-once): the parameters are all-gathered once and the gradients
  reduce-scattered once per step; each rank updates 1/W of the parameters;
- ``fsdp2-full`` (full sharding): every pass all-gathers the parameters twice (forward and
  backward) and reduce-scatters the gradients, priced unhidden (the bound of a plan that is not
  priced as passes; ``pass_timing.price_passes`` with a ``ShardingCost`` prices the overlap);
  each rank updates 1/W of the parameters.

Nothing here is fitted: the seconds per parameter and per token are the profile's, measured by
the profiler or stated with their source in its provenance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dyncp.cost_model.evaluate import PlanCost, evaluate_plan
from dyncp.cost_model.schema import INTEGRATIONS, Profile
from dyncp.cost_model.sharding import collective_from_profile
from dyncp.plan import StepPlan, pass_schedule

__all__ = ["StepParts", "common_parts", "free_links", "step_parts"]

#: Bandwidth of a link that costs nothing (finite: profiles refuse inf).
_FREE_BANDWIDTH = 1e300


@dataclass(frozen=True, slots=True)
class StepParts:
    """One step's named parts, in seconds (module docstring). ``total`` is the whole step."""

    attention: float
    linear: float
    communication: float
    launch: float
    embedding_head: float
    synchronisation: float
    gradient_reduction: float
    optimizer: float
    fixed: float

    #: The parts every policy pays alike on one world (:func:`common_parts`).
    COMMON = ("gradient_reduction", "optimizer", "fixed")

    @property
    def planned(self) -> float:
        """The planner's price of the step's micro-batches (``predicted_step_seconds``)."""
        return (
            self.attention
            + self.linear
            + self.communication
            + self.launch
            + self.embedding_head
            + self.synchronisation
        )

    @property
    def common(self) -> float:
        return self.gradient_reduction + self.optimizer + self.fixed

    @property
    def total(self) -> float:
        return self.planned + self.common

    def as_dict(self) -> dict[str, float]:
        """Every part, ``planned`` and ``total``: the form ``plan.stats["step_parts"]`` holds."""
        return {**asdict(self), "planned": self.planned, "total": self.total}


def common_parts(
    profile: Profile,
    *,
    world: int,
    ranks_per_node: int,
    passes: int = 1,
    integration: str | None = None,
) -> tuple[float, float, float]:
    """(gradient reduction, optimizer, fixed) seconds of one step over ``world`` ranks.

    ``integration`` (default: the profile's ``step.integration``) is one of ``INTEGRATIONS``;
    ``passes`` (forward+backward passes per rank) matters only to ``fsdp2-full``. A profile
    without ``step`` (schema version 1) pays none of them: (0, 0, 0).
    """
    if integration is not None and integration not in INTEGRATIONS:
        raise ValueError(
            f"unknown integration {integration!r}; choose one of {', '.join(INTEGRATIONS)}"
        )
    if passes < 0:
        raise ValueError(f"passes must be >= 0, got {passes}")
    step = profile.step
    if step is None:
        return 0.0, 0.0, 0.0
    mode = integration or step.integration
    coll = collective_from_profile(profile, world=world, ranks_per_node=ranks_per_node)
    grads = step.parameters * step.gradient_bytes_per_parameter
    params = step.parameters * step.parameter_bytes_per_parameter
    update = step.parameters * step.optimizer_seconds_per_parameter
    if mode == "ddp":
        reduction = 2.0 * coll.seconds(grads) if world > 1 else 0.0
        return reduction, update, step.fixed_seconds
    if world == 1:
        reduction = 0.0
    elif mode == "fsdp2-once":
        reduction = coll.seconds(params) + coll.seconds(grads)
    else:
        reduction = passes * (2.0 * coll.seconds(params) + coll.seconds(grads))
    return reduction, update / world, step.fixed_seconds


def free_links(profile: Profile) -> Profile:
    """``profile`` with every link free (no latency, unbounded bandwidth): what the step costs
    when nothing waits on the network."""
    comm = profile.communication
    free = {"latency_seconds": 0.0, "bandwidth_bytes_per_second": _FREE_BANDWIDTH}
    update = {
        "intra_node": comm.intra_node.model_copy(update=free),
        "inter_node": comm.inter_node.model_copy(update=free),
        "links": [link.model_copy(update=free) for link in comm.links],
        "all_to_all_links": [link.model_copy(update=free) for link in comm.all_to_all_links],
    }
    return profile.model_copy(update={"communication": comm.model_copy(update=update)})


def _rank_sum(plan: StepPlan, seconds: tuple[tuple[float, ...], ...], rank: int) -> float:
    """Seconds of the micro-batches ``rank`` takes part in (group-then-micro-batch order)."""
    total = 0.0
    for wave, per_mb in zip(plan.waves, seconds):
        j = 0
        for group in wave.groups:
            n = len(group.microbatches)
            if group.start <= rank < group.start + group.size:
                total += float(sum(per_mb[j : j + n]))
            j += n
    return total


def step_parts(
    plan: StepPlan,
    model: object,
    *,
    planned_seconds: float | None = None,
    integration: str | None = None,
    timing: str = "dataflow",
    priced: PlanCost | None = None,
) -> StepParts:
    """``plan``'s step as named parts under ``model`` (a ``CostModel``: one built from a
    profile). ``planned_seconds`` (default: ``plan.stats["predicted_step_seconds"]``, else the
    plan priced under ``timing``) is the planner's price; ``integration`` as in
    :func:`common_parts`; ``priced``: ``evaluate_plan(plan, model, timing=timing)`` where the
    caller has it already (one pricing fewer)."""
    profile = getattr(model, "profile", None)
    if not isinstance(profile, Profile):
        raise ValueError(
            f"step_parts needs a cost model built from a profile; {type(model).__name__} has none"
        )
    # Built by the model's own class, so a calibrated or layer-mix model decomposes as priced.
    build = type(model)
    rpn = model.ranks_per_node  # type: ignore[attr-defined]
    if priced is None:
        priced = evaluate_plan(plan, model, timing=timing)  # type: ignore[arg-type]
    free = free_links(profile)
    no_comm = evaluate_plan(plan, build(free, rpn), timing=timing)
    bare = free.model_copy(update={"linear_seconds_per_token": 0.0, "step": None})
    no_linear = evaluate_plan(plan, build(bare, rpn), timing=timing)
    rank = int(np.argmax(priced.rank_busy_seconds)) if plan.topology.world else 0
    busy = _rank_sum(plan, priced.microbatch_seconds, rank)
    compute = _rank_sum(plan, no_comm.microbatch_seconds, rank)
    mixers = _rank_sum(plan, no_linear.microbatch_seconds, rank)
    count = sum(
        len(g.microbatches)
        for w in plan.waves
        for g in w.groups
        if g.start <= rank < g.start + g.size
    )
    launch = count * model.microbatch_overhead  # type: ignore[attr-defined]
    per_token = compute - mixers
    lin = profile.linear_seconds_per_token
    head = getattr(model, "embed_head", 0.0)
    share = head / (lin + head) if lin + head > 0 else 0.0
    if planned_seconds is None:
        planned_seconds = plan.stats.get("predicted_step_seconds", priced.step_seconds)
    reduction, optimizer, fixed = common_parts(
        profile,
        world=plan.topology.world,
        ranks_per_node=rpn,
        passes=sum(pass_schedule(plan).per_wave),
        integration=integration,
    )
    return StepParts(
        attention=mixers - launch,
        linear=per_token * (1.0 - share),
        communication=busy - compute,
        launch=launch,
        embedding_head=per_token * share,
        synchronisation=float(planned_seconds) - busy,
        gradient_reduction=reduction,
        optimizer=optimizer,
        fixed=fixed,
    )
