"""Helpers shared by the planner tests: a hypothesis topology strategy and plan checks."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from dyncp.plan import StepPlan, Topology


@st.composite
def topologies(draw: st.DrawFn, full_world: bool = False) -> Topology:
    """Small worlds (12: not a power of two), odd and even capacities (100: not a power of two),
    and sometimes a subset of the default group sizes that keeps the largest (so every length up
    to the topology's maximum fits). ``full_world``: only worlds whose group of all ranks is an
    allowed size (megatron's fallback needs it)."""
    world = draw(st.sampled_from([4, 8, 16] if full_world else [4, 8, 12, 16]))
    rpn = draw(st.sampled_from([r for r in (2, 4, 8) if world % r == 0]))
    capacity = draw(st.sampled_from([64, 100, 128, 256, 512]))
    default = Topology(world, rpn, capacity).group_sizes
    sizes: tuple[int, ...] = ()
    if draw(st.booleans()):
        subset = draw(st.lists(st.sampled_from(default), unique=True, max_size=len(default)))
        sizes = tuple(sorted(set(subset) | {default[-1]}))
    return Topology(world, rpn, capacity, sizes)


def canonical(plan: StepPlan) -> str:
    """The plan's JSON without the wall-clock timings."""
    data = json.loads(plan.to_json())
    data["stats"].pop("timings", None)
    return json.dumps(data, sort_keys=True)


def assert_exactly_once(plan: StepPlan, n: int) -> None:
    ids = [i for _, _, mb in plan.microbatches() for i in mb.seq_ids]
    assert sorted(ids) == list(range(n))


def pipelined_plans(model, *, n: int, seed: int, size: int, capacity: int, max_length: int) -> list:
    """``n`` plans of the deterministic PP 2 planner on 2 columns under ``model``, each of
    ``size`` log-uniform lengths in [8, max_length] (CP 1 and CP 2 micro-batches, short and
    long: what a refit needs to tell the coefficients apart)."""
    import numpy as np

    from dyncp.plan import Pipeline
    from dyncp.planner import Planner

    planner = Planner(
        model,
        world=2,
        ranks_per_node=2,
        capacity=capacity,
        max_length=max_length,
        pipeline=Pipeline(2, 1),
        bound="simple",
        deterministic=True,
        cpsat=None,
    )
    rng = np.random.default_rng(seed)
    return [
        planner.plan([int(x) for x in np.exp(rng.uniform(np.log(8), np.log(max_length), size))])
        for _ in range(n)
    ]
