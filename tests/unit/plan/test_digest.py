"""Tests for plan_digest: it covers what a plan executes, and only that."""

from __future__ import annotations

import dataclasses

import pytest
from plan_builders import group, valid_plan, wave

from dyncp.plan import PlanError, StepPlan, Topology

# ------------------------------------------------------------------------------ digest


def test_digest_covers_what_executes_and_ignores_stats() -> None:
    from dyncp.plan import plan_digest

    base = valid_plan()
    digest = plan_digest(base)
    assert plan_digest(StepPlan.from_json(base.to_json())) == digest
    assert plan_digest(dataclasses.replace(base, stats={"x": 1}, policy="other")) == digest
    variants = [
        dataclasses.replace(base, sample_ids=None),
        dataclasses.replace(base, lengths=(*base.lengths[:-1], 51)),
        dataclasses.replace(base, topology=Topology(world=8, ranks_per_node=8, capacity=1000)),
        dataclasses.replace(base, waves=base.waves[::-1]),
        # the same ids, split differently into micro-batches
        dataclasses.replace(
            base,
            waves=(
                wave(group(0, 4, (0,)), group(4, 1, (1, 2), (3, 4)), group(6, 2, (5,))),
                base.waves[1],
            ),
        ),
    ]
    digests = {plan_digest(v) for v in variants}
    assert digest not in digests and len(digests) == len(variants)


def test_digest_refuses_values_beyond_int64() -> None:
    from dyncp.plan import plan_digest

    with pytest.raises(PlanError, match="int64"):
        plan_digest(dataclasses.replace(valid_plan(), lengths=(2**70,) * 8))
