"""The pipelined plan contract: slots, counts, JSON, digest, and operation orders that can run."""

from __future__ import annotations

import json

import pytest

from dyncp.plan import (
    Group,
    MicroBatch,
    Pipeline,
    PipelineOp,
    PlanError,
    StepPlan,
    Topology,
    Wave,
    plan_digest,
    slice_plan,
    stage_layers,
    stage_order,
)

TWO_STAGES = Pipeline(2)


def _plan(slots: int = 4, pipeline: Pipeline | None = TWO_STAGES) -> StepPlan:
    topo = Topology(4, 4, 256, (1, 2, 4))
    waves = []
    for j in range(slots):
        a, b, c = 3 * j, 3 * j + 1, 3 * j + 2
        groups = (Group(0, 2, (MicroBatch((a,)),)), Group(2, 1, (MicroBatch((b, c)),)))
        waves.append(Wave(groups))  # column 3 idle in every slot
    return StepPlan(topo, tuple([40] * (3 * slots)), tuple(waves), pipeline=pipeline)


def test_a_pipelined_plan_validates_and_round_trips() -> None:
    plan = _plan()
    plan.validate()
    back = StepPlan.from_json(plan.to_json())
    assert back.pipeline == Pipeline(2) and back.waves == plan.waves
    assert plan_digest(back) == plan_digest(plan)


def test_the_pipeline_changes_the_digest_and_its_absence_does_not_change_json() -> None:
    plain = _plan(pipeline=None)
    assert plan_digest(plain) != plan_digest(_plan())
    assert plan_digest(_plan(pipeline=Pipeline(2))) != plan_digest(_plan(pipeline=Pipeline(4)))
    assert "pipeline" not in json.loads(plain.to_json())


def test_a_group_with_two_microbatches_is_not_a_slot() -> None:
    plan = _plan()
    g = plan.waves[1].groups[1]
    two = Group(g.start, g.size, (MicroBatch((4,)), MicroBatch((5,))))
    plan.waves = (plan.waves[0], Wave((plan.waves[1].groups[0], two)), *plan.waves[2:])
    with pytest.raises(PlanError, match="slot 1: group at rank 2 holds 2") as err:
        plan.validate()
    assert err.value.rule == "pipeline-slot"


def test_interleaved_needs_a_slot_count_that_is_a_multiple_of_the_stages() -> None:
    _plan(slots=4, pipeline=Pipeline(2, 2)).validate()
    with pytest.raises(PlanError, match="multiple of 2; the plan has 3 slots") as err:
        _plan(slots=3, pipeline=Pipeline(2, 2)).validate()
    assert err.value.rule == "pipeline-count"
    _plan(slots=3, pipeline=Pipeline(2, 1)).validate()  # 1F1B takes any count


@pytest.mark.parametrize(
    ("stages", "virtual", "match"),
    [(0, 1, "stages must be an integer >= 1"), (1, 2, "need at least 2"), (2, True, "virtual")],
)
def test_bad_pipelines_are_refused(stages: object, virtual: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Pipeline(stages, virtual)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "pipeline",
    [{"stages": 0, "virtual": 1}, {"stages": 2}, [2], {"stages": 2, "virtual": 1, "x": 1}],
)
def test_bad_pipeline_json_is_a_decode_error(pipeline: object) -> None:
    data = _plan().to_dict()
    data["pipeline"] = pipeline
    with pytest.raises(PlanError):
        StepPlan.from_dict(data)


def test_version_3_plans_still_read_and_cannot_carry_a_pipeline() -> None:
    data = _plan(pipeline=None).to_dict()
    data["schema_version"] = 3
    assert StepPlan.from_dict(data).pipeline is None
    data["pipeline"] = {"stages": 2, "virtual": 1}
    with pytest.raises(PlanError, match="needs schema_version 4"):
        StepPlan.from_dict(data)


def test_slices_refuse_a_pipelined_plan_rather_than_drop_its_stages() -> None:
    with pytest.raises(PlanError, match="do not carry pipeline stages"):
        slice_plan(_plan())


def test_1f1b_order_of_four_stages() -> None:
    p = Pipeline(4)
    names = ["".join(f"{o.kind}{o.slot}" for o in stage_order(p, 6, s)) for s in range(4)]
    assert names[0] == "F0F1F2F3B0F4B1F5B2B3B4B5"
    assert names[3] == "F0B0F1B1F2B2F3B3F4B4F5B5"
    assert names[1] == "F0F1F2B0F3B1F4B2F5B3B4B5"


def _runs(pipeline: Pipeline, slots: int, orders: list[list[PipelineOp]] | None = None) -> bool:
    """Unit-time replay of every stage's order with the pipeline's data dependencies (forward of
    virtual stage q after q - 1's, backward of q after q + 1's and after its own forward): True
    when every operation runs, False on a deadlock."""
    p, v = pipeline.stages, pipeline.virtual
    if orders is None:
        orders = [list(stage_order(pipeline, slots, s)) for s in range(p)]
    done: set[tuple[str, int, int]] = set()  # (kind, slot, virtual stage)
    heads = [0] * p
    last = p * v - 1
    while any(heads[s] < len(orders[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if heads[s] == len(orders[s]):
                continue
            o = orders[s][heads[s]]
            q = o.chunk * p + s
            if o.kind == "F":
                ok = q == 0 or ("F", o.slot, q - 1) in done
            else:
                ok = ("F", o.slot, q) in done and (q == last or ("B", o.slot, q + 1) in done)
            if ok:
                ready.append((s, (o.kind, o.slot, q)))
        if not ready:
            return False
        for s, key in ready:
            done.add(key)
            heads[s] += 1
    return len(done) == 2 * slots * p * v


@pytest.mark.parametrize(("stages", "virtual"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (3, 3)])
@pytest.mark.parametrize("multiple", [1, 2, 3])
def test_every_order_runs_each_operation_once_without_deadlock(
    stages: int, virtual: int, multiple: int
) -> None:
    pipeline = Pipeline(stages, virtual)
    slots = stages * multiple if virtual > 1 else stages * multiple + 1
    for s in range(stages):
        ops = stage_order(pipeline, slots, s)
        want = {(k, j, c) for k in "FB" for j in range(slots) for c in range(virtual)}
        assert sorted((o.kind, o.slot, o.chunk) for o in ops) == sorted(want)
    assert _runs(pipeline, slots)


def test_the_replay_catches_a_wrong_order() -> None:
    """The deadlock check can fail: stage 0 running a slot's backward before its forwards have
    filled the pipeline waits forever on stage 1, which waits on stage 0's next forward."""
    pipeline = Pipeline(2)
    orders = [list(stage_order(pipeline, 3, s)) for s in range(2)]
    assert _runs(pipeline, 3, orders)
    orders[0][1], orders[0][2] = orders[0][2], orders[0][1]  # F0 B0 F1 ... on stage 0
    assert orders[0][1] == PipelineOp("B", 0, 0)
    orders[1] = [PipelineOp("F", 1, 0), *[o for o in orders[1] if o != PipelineOp("F", 1, 0)]]
    assert not _runs(pipeline, 3, orders)


def test_stage_layers_split_evenly_with_the_first_stages_taking_the_rest() -> None:
    assert stage_layers(8, Pipeline(4)) == (2, 2, 2, 2)
    assert stage_layers(10, Pipeline(2, 2)) == (3, 3, 2, 2)
    with pytest.raises(PlanError, match="need at least 8 layers"):
        stage_layers(6, Pipeline(4, 2))
