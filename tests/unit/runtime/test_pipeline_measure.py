"""Reading a pipelined step's timelines: a timeline the pricing itself produced, written as the
processes' reports (each on its own clock origin, early ring members waiting inside their
operation), reads back as exactly the pricing's operations, busy times, step and hand-offs."""

from __future__ import annotations

import numpy as np
import pytest

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.pipeline_timing import price_pipeline, stage_costs
from dyncp.plan import Group, MicroBatch, Pipeline, StepPlan, Topology, Wave
from dyncp.runtime.pipeline import OpTiming, PipelineReport
from dyncp.runtime.pipeline_measure import pipeline_measurement

LINK = ((2e-4, 5e7), (2e-4, 5e7))  # slow enough that hand-offs decide some starts
BYTES = 256.0  # per token
RING_WAIT = 0.003  # an early ring member's wait inside its operation


def _model(layers: int) -> CostModel:
    """cpu-gloo's model with ``layers`` layers (one a virtual stage at least)."""
    profile = load_profile("cpu-gloo")
    shape = profile.model.model_copy(update={"num_layers": layers})
    return CostModel(profile.model_copy(update={"model": shape}), 2)


def _plan(pipeline: Pipeline) -> StepPlan:
    """2 columns, 4 slots: CP 2, two CP 1, CP 1 beside an idle column, CP 2."""
    lengths = (61, 17, 9, 33, 40, 26, 5)
    waves = (
        Wave((Group(0, 2, (MicroBatch((0,)),)),)),
        Wave((Group(0, 1, (MicroBatch((1, 2)),)), Group(1, 1, (MicroBatch((3,)),)))),
        Wave((Group(0, 1, (MicroBatch((4,)),)),)),
        Wave((Group(0, 2, (MicroBatch((5, 6)),)),)),
    )
    plan = StepPlan(Topology(2, 2, 64, (1, 2)), lengths, waves, policy="hand", pipeline=pipeline)
    plan.validate()
    return plan


def _reports(plan: StepPlan, model: CostModel) -> tuple[list[PipelineReport], object, object]:
    """The priced timeline as every process would report it (module docstring)."""
    costs = stage_costs(plan, model, activation_bytes_per_token=BYTES, p2p=LINK)
    cost = price_pipeline(plan, model, costs=costs)
    p, w = plan.pipeline.stages, plan.topology.world
    reports = []
    for s in range(p):
        for c in range(w):
            # clocks started apart: absolute time 10.7 + t is t + off on this process
            off = 0.7 + 0.37 * (s * w + c)
            rep = PipelineReport(s, c, origin=10.0 - 0.37 * (s * w + c), began=off)
            free = 0.0  # when the process finished its previous operation
            for k, op in enumerate(cost.ops[s]):
                if not costs.busy[op.slot, c]:
                    continue
                start, end = cost.op_start[s, k, c], cost.op_end[s, k, c]
                group = next(
                    g for g in plan.waves[op.slot].groups if g.start <= c < g.start + g.size
                )
                ready = start - (RING_WAIT if c > group.start else 0.0)  # waited in the ring
                waited = min(free, ready)
                rep.ops.append(
                    OpTiming(
                        op.kind,
                        op.slot,
                        op.chunk,
                        group.size,
                        waited + off,
                        end + off,
                        ready + off,
                        end + off,
                    )  # fmt: skip
                )
                free = end
            rep.step_seconds = free + off
            reports.append(rep)
    return reports, costs, cost


@pytest.mark.parametrize("virtual", [1, 2])
def test_a_priced_timeline_reads_back_as_the_pricing(virtual: int) -> None:
    plan = _plan(Pipeline(2, virtual))
    model = _model(4)
    reports, costs, cost = _reports(plan, model)
    m = pipeline_measurement(plan, reports[::-1], activation_bytes_per_token=BYTES)
    # the group's member that did not wait in the ring is read, not the early one
    np.testing.assert_allclose(m.forward, costs.forward, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(m.backward, costs.backward, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(m.busy, cost.stage_busy_seconds, rtol=1e-9)
    # one clock: first operation's start (0) to the last end, whatever each origin
    assert m.step_seconds == pytest.approx(cost.step_seconds, rel=1e-9)
    assert m.bubble_fraction == pytest.approx(cost.bubble_fraction, rel=1e-9)
    # one measurement per group per slot: its CP, lengths, operations summed
    groups = [(j, g) for j, wave in enumerate(plan.waves) for g in wave.groups]
    assert [(x.cp, x.lengths) for x in m.microbatches] == [
        (g.size, tuple(plan.lengths[i] for i in g.microbatches[0].seq_ids)) for _, g in groups
    ]
    for x, (j, g) in zip(m.microbatches, groups):
        total = costs.forward[j, g.start].sum() + costs.backward[j, g.start].sum()
        assert x.seconds == pytest.approx(total, rel=1e-9)
    # every hand-off read is one whose receiver waited: its seconds are the priced transfer
    assert m.hops
    lat, bw = LINK[0]
    sizes = {
        plan.topology.memory_tokens([plan.lengths[i] for i in g.microbatches[0].seq_ids], g.size)
        * BYTES
        for _, g in groups
    }
    for h in m.hops:
        assert h.bytes in sizes
        assert h.seconds == pytest.approx(lat + h.bytes / bw, rel=1e-6)


def test_reports_of_another_plan_or_grid_are_refused() -> None:
    plan = _plan(Pipeline(2, 1))
    model = _model(2)
    reports, _, _ = _reports(plan, model)
    with pytest.raises(ValueError, match="reports of 3 distinct processes for a grid of 2"):
        pipeline_measurement(plan, reports[:3], activation_bytes_per_token=BYTES)
    reports[1].ops.pop()
    with pytest.raises(ValueError, match="the reports hold .* operations; the plan runs"):
        pipeline_measurement(plan, reports, activation_bytes_per_token=BYTES)
    unpiped = StepPlan(plan.topology, plan.lengths, plan.waves[:1], policy="hand")
    with pytest.raises(ValueError, match="this plan has pipeline=None"):
        pipeline_measurement(unpiped, reports, activation_bytes_per_token=BYTES)
