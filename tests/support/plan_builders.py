"""Builders shared by the plan contract tests (tests/unit/plan): small plans and rule checks."""

from __future__ import annotations

import math

import pytest

from dyncp.plan import (
    Group,
    MicroBatch,
    PlanError,
    StepPlan,
    Topology,
    Wave,
)


def mb(*ids: int) -> MicroBatch:
    return MicroBatch(tuple(ids))


def group(start: int, size: int, *mbs: tuple[int, ...]) -> Group:
    return Group(start, size, tuple(MicroBatch(tuple(m)) for m in mbs))


def wave(*groups: Group) -> Wave:
    return Wave(tuple(groups))


def ref_padded(length: int, cp: int) -> int:
    """Independent padding rule: a multiple of 2*cp when cp > 1, unchanged at cp = 1."""
    if cp == 1:
        return length
    return math.ceil(length / (2 * cp)) * 2 * cp


TOPO = Topology(world=8, ranks_per_node=4, capacity=1000)


def valid_plan() -> StepPlan:
    """A hand-built plan exercising several waves, sizes, packs and idle ranks."""
    lengths = (4000, 900, 100, 200, 300, 1500, 7000, 50)
    waves = (
        wave(
            group(0, 4, (0,)),  # 4000 at cp=4: exactly 4 * capacity
            group(4, 1, (1,), (2, 3, 4)),  # 100 + 200 + 300 <= 1000
            group(6, 2, (5,)),  # 1500 -> padded 1500 / 2 = 750
        ),
        wave(group(0, 8, (6, 7))),  # 7000 + pad(50, 8) = 7008 + 64 -> 884 per rank
    )
    return StepPlan(
        topology=TOPO,
        lengths=lengths,
        waves=waves,
        policy="hand",
        sample_ids=(10, 11, 12, 13, 14, 15, 16, 17),
        stats={"predicted_seconds": 1.25, "solver": {"status": "OPTIMAL", "waves": [1, 2]}},
    )


def with_waves(plan: StepPlan, *waves: Wave, lengths: tuple[int, ...] | None = None) -> StepPlan:
    return StepPlan(
        topology=plan.topology,
        lengths=plan.lengths if lengths is None else lengths,
        waves=tuple(waves),
        policy=plan.policy,
    )


def raises_rule(plan: StepPlan, rule: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        plan.validate()
    assert info.value.rule == rule, str(info.value)
    assert str(info.value).startswith(f"[{rule}]")
    assert isinstance(info.value, ValueError)
    return info.value
