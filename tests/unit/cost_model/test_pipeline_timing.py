"""Pipelined plans priced: the cut of a micro-batch into stages, transfers, and the timeline."""

from __future__ import annotations

import numpy as np
import pytest

from dyncp.cost_model import CostModel, bundled_profiles, price_pipeline, stage_costs
from dyncp.cost_model.evaluate import time_waves
from dyncp.cost_model.pipeline_schedule import StageCosts, schedule, schedule_graph
from dyncp.cost_model.pipeline_timing import LINEAR_FORWARD, cost_split
from dyncp.plan import (
    Group,
    MicroBatch,
    Pipeline,
    PlanError,
    StepPlan,
    Topology,
    Wave,
    padded_lengths,
)


def _uniform(p: int, v: int, m: int, w: int = 1, f: float = 1.0, b: float = 2.0, t: float = 0.0):
    """Every operation f (forward) or b (backward) seconds, every hop t, one group of w."""
    q = p * v
    hop = np.full((m, w, q), t)
    hop[:, :, 0] = 0.0
    busy = np.ones((m, w), dtype=bool)
    return StageCosts(
        Pipeline(p, v),
        np.full((m, w, q), f),
        np.full((m, w, q), b),
        hop,
        busy,
        tuple(np.array([0]) for _ in range(m)),
    )


def _plan(
    w: int,
    pipeline: Pipeline,
    slots: int,
    *,
    rpn: int = 8,
    seed: int = 0,
    heads: bool = False,
) -> StepPlan:
    """Random slots: pairs of columns or single columns, some idle, lengths 500..6000."""
    rng = np.random.default_rng(seed)
    topo = Topology(
        w, rpn, 1 << 16, head_sizes=(1, 2) if heads else (1,), query_heads=32, kv_heads=8
    )
    lengths: list[int] = []
    waves = []
    for _ in range(slots):
        groups = []
        c = 0
        while c < w:
            roll = rng.random()
            if roll < 0.15 and len(groups) > 0:
                c += 1  # idle column
                continue
            size = 2 if c % 2 == 0 and c + 2 <= w and roll < 0.6 else 1
            ids = []
            for _ in range(int(rng.integers(1, 3))):
                ids.append(len(lengths))
                lengths.append(int(rng.integers(500, 6000)))
            u = 2 if heads and size == 2 and rng.random() < 0.5 else 1
            groups.append(Group(c, size, (MicroBatch(tuple(ids)),), heads=u))
            c += size
        waves.append(Wave(tuple(groups)))
    plan = StepPlan(topo, tuple(lengths), tuple(waves), pipeline=pipeline)
    plan.validate()
    return plan


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("slots", [1, 2, 5, 9])
def test_equal_microbatches_under_1f1b_take_m_plus_p_minus_1_steps(p: int, slots: int) -> None:
    cost = schedule(_uniform(p, 1, slots, w=3))
    assert cost.step_seconds == pytest.approx((slots + p - 1) * 3.0)
    # The bubble of 1F1B: (P - 1) / (M + P - 1) of every process's time.
    assert cost.bubble_fraction == pytest.approx((p - 1) / (slots + p - 1))


@pytest.mark.parametrize(("p", "v"), [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_shrinks_the_bubble_to_p_minus_1_chunks(p: int, v: int, groups: int) -> None:
    # Megatron-LM's interleaved schedule (Narayanan et al., SC'21): bubble (P - 1) x (f + b) / V
    # for a whole stage's f and b, i.e. P - 1 chunk forward+backwards; the rest is M x V chunks.
    m = groups * p
    cost = schedule(_uniform(p, v, m))
    assert cost.step_seconds == pytest.approx((m * v + p - 1) * 3.0)


def test_one_transfer_per_hop_each_way_for_a_single_microbatch() -> None:
    cost = schedule(_uniform(3, 1, 1, t=0.5))
    assert cost.step_seconds == pytest.approx(3 * 3.0 + 2 * 2 * 0.5)
    assert cost.transfer_seconds == pytest.approx(2 * 2 * 0.5)


def _two_groups(delay: float) -> StageCosts:
    """Four columns, groups {0, 1} and {2, 3} in every slot; column 1's first forward slower."""
    m, p = 4, 2
    costs = _uniform(p, 1, m, w=4)
    forward = costs.forward.copy()
    forward[0, 1, 0] += delay
    segments = tuple(np.array([0, 2]) for _ in range(m))
    return StageCosts(costs.pipeline, forward, costs.backward, costs.transfer, costs.busy, segments)


def test_a_slow_column_delays_its_group_and_no_other() -> None:
    base, slow = schedule(_two_groups(0.0)), schedule(_two_groups(0.7))
    # The other group runs exactly as before.
    np.testing.assert_allclose(slow.op_start[:, :, 2:], base.op_start[:, :, 2:])
    np.testing.assert_allclose(slow.op_end[:, :, 2:], base.op_end[:, :, 2:])
    # Its partner starts every later operation with it (the ring needs both).
    np.testing.assert_allclose(slow.op_start[:, :, 0], slow.op_start[:, :, 1])
    assert slow.op_start[1, 0, 0] == pytest.approx(base.op_start[1, 0, 0] + 0.7)
    assert slow.step_seconds == pytest.approx(base.step_seconds + 0.7)


def test_an_idle_column_waits_for_nothing_and_takes_no_time() -> None:
    costs = _two_groups(0.0)
    busy = costs.busy.copy()
    busy[:, 3] = False
    forward, backward = costs.forward.copy(), costs.backward.copy()
    forward[:, 3], backward[:, 3] = 0.0, 0.0
    segments = tuple(np.array([0, 2, 3]) for _ in range(costs.slots))
    idle = schedule(StageCosts(costs.pipeline, forward, backward, costs.transfer, busy, segments))
    assert np.all(idle.op_end[:, :, 3] == 0.0) and idle.stage_busy_seconds[:, 3].sum() == 0.0
    # Column 2, now alone, runs unhindered: the same timeline as a full group.
    np.testing.assert_allclose(idle.op_end[:, :, 2], idle.op_end[:, :, 0])
    total = idle.step_seconds * 2 * 4
    assert idle.bubble_fraction == pytest.approx(1 - idle.compute_seconds / total)


def _unpipelined(plan: StepPlan) -> StepPlan:
    return StepPlan(plan.topology, plan.lengths, plan.waves)


@pytest.mark.parametrize("name", ["h100-reference", "h100-falcon-h1-7b-like", "cpu-gloo"])
def test_one_stage_is_the_dataflow_price_without_wave_overhead(name: str) -> None:
    """P = 1: each slot's group starts when its last member is free and runs T: dataflow."""
    model = CostModel.load(name, 8)
    plan = _plan(8, Pipeline(1), 6, seed=3)
    cost = price_pipeline(plan, model)
    seconds = np.asarray(
        [
            model.microbatch_seconds(g.size, [plan.lengths[i] for i in g.microbatches[0].seq_ids])
            for wave in plan.waves
            for g in wave.groups
        ]
    )
    flat = _unpipelined(plan)
    assert cost.step_seconds == pytest.approx(time_waves(flat, seconds, 0.0).step_seconds)


@pytest.mark.parametrize("name", sorted(bundled_profiles()))
@pytest.mark.parametrize("pipeline", [Pipeline(2), Pipeline(2, 2), Pipeline(4)])
def test_the_stages_add_up_to_the_microbatch_plus_a_constant_per_extra_stage(
    name: str, pipeline: Pipeline
) -> None:
    model = CostModel.load(name, 8)
    heads = model.profile.communication.kind == "ring" and model.profile.layer_mix is None
    plan = _plan(8, pipeline, 2 * pipeline.slot_multiple(), seed=1, heads=heads)
    if model.layers < pipeline.model_stages:  # cpu-gloo's 2 layers: too few to cut that far
        with pytest.raises(PlanError, match="need at least"):
            stage_costs(plan, model)
        return
    costs = stage_costs(plan, model)
    c = model.microbatch_overhead
    for j, wave in enumerate(plan.waves):
        for g in wave.groups:
            lens = [plan.lengths[i] for i in g.microbatches[0].seq_ids]
            split = {"heads": g.heads} if g.heads > 1 else {}
            t = model.microbatch_seconds(g.size, lens, **split)
            cols = (
                costs.forward[j, g.start : g.start + g.size]
                + costs.backward[j, g.start : g.start + g.size]
            )
            np.testing.assert_allclose(cols.sum(axis=1), t + (pipeline.model_stages - 1) * c)
            assert (costs.forward[j, g.start] > 0).all() and costs.busy[j, g.start]
    idle = ~costs.busy
    assert (costs.forward[idle] == 0).all() and (costs.transfer[idle] == 0).all()


def test_the_head_sits_on_the_last_virtual_stage_at_the_layers_rate_per_flop() -> None:
    model = CostModel.load("h100-reference", 8)  # llama3-8b-like: 32 layers, 4096, 128256
    layer = 2 * 4096 * (32 * 128 + 2 * 8 * 128) + 2 * 32 * 128 * 4096 + 3 * 2 * 4096 * 14336
    head = 2 * 4096 * 128256
    assert cost_split(model).head_fraction == pytest.approx(head / (32 * layer + head))
    plan = _plan(4, Pipeline(2, 2), 2, seed=2)  # 32 layers: 8 per virtual stage
    costs = stage_costs(plan, model)
    g = plan.waves[0].groups[0]
    lens = np.asarray([plan.lengths[i] for i in g.microbatches[0].seq_ids])
    lin = model.lin * model.priced(g.size, lens).sum() / g.size
    h = head / (32 * layer + head) * lin
    fwd, bwd = costs.forward[0, g.start], costs.backward[0, g.start]
    assert fwd[3] - fwd[0] == pytest.approx(LINEAR_FORWARD * h)
    assert bwd[3] - bwd[0] == pytest.approx((1 - LINEAR_FORWARD) * h)
    np.testing.assert_allclose(fwd[:3], fwd[0])


def test_activations_cross_the_node_link_between_stages_on_different_nodes() -> None:
    model = CostModel.load("h100-reference", 8)
    comm, shape = model.profile.communication, model.profile.model
    for w, link in ((8, comm.inter_node), (4, comm.intra_node)):
        plan = _plan(w, Pipeline(2), 1, seed=4)
        costs = stage_costs(plan, model)
        g = plan.waves[0].groups[0]
        lens = [plan.lengths[i] for i in g.microbatches[0].seq_ids]
        local = padded_lengths(np.asarray(lens), g.size).sum() / g.size
        want = link.latency_seconds + local * shape.hidden_size * shape.dtype_bytes / (
            link.bandwidth_bytes_per_second
        )
        assert costs.transfer[0, g.start, 1] == pytest.approx(want)
        assert costs.transfer[0, g.start, 0] == 0.0


class _PlugIn:
    """A cost model with only what the protocol's simulator side needs: no parts to cut."""

    def __init__(self, inner: CostModel) -> None:
        self._inner = inner
        self.microbatch_overhead = inner.microbatch_overhead

    def packs_seconds(self, cp: int, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return self._inner.packs_seconds(cp, lengths, starts)


def test_a_model_without_parts_is_cut_uniformly_and_needs_its_layer_count() -> None:
    inner = CostModel.load("h100-reference", 8)
    plan = _plan(4, Pipeline(2), 2, seed=5)
    plug = _PlugIn(inner)
    with pytest.raises(ValueError, match="pass num_layers"):
        stage_costs(plan, plug)
    with pytest.raises(ValueError, match="pass activation_bytes_per_token"):
        stage_costs(plan, plug, num_layers=4)
    costs = stage_costs(
        plan, plug, num_layers=4, activation_bytes_per_token=8192.0, p2p=((1e-6, 1e11),) * 2
    )
    busy = costs.busy
    # 1 : 2 everywhere, equal stages (4 layers over 2: no head of its own).
    np.testing.assert_allclose(costs.backward[busy], 2 * costs.forward[busy])
    np.testing.assert_allclose(costs.forward[busy][:, 0], costs.forward[busy][:, 1])
    g = plan.waves[0].groups[0]
    t = inner.microbatch_seconds(g.size, [plan.lengths[i] for i in g.microbatches[0].seq_ids])
    total = costs.forward[0, g.start].sum() + costs.backward[0, g.start].sum()
    assert total == pytest.approx(t + inner.microbatch_overhead)


def test_bad_inputs_are_refused_with_what_is_allowed() -> None:
    model = CostModel.load("h100-reference", 8)
    plan = _plan(4, Pipeline(2), 2)
    with pytest.raises(ValueError, match="pipeline=None"):
        stage_costs(_unpipelined(plan), model)
    costs = stage_costs(plan, model)
    with pytest.raises(ValueError, match="costs are for"):
        price_pipeline(_plan(4, Pipeline(4), 2), model, costs=costs)
    with pytest.raises(ValueError, match="costs are for 2 slots x 4 columns, the plan has 3 x 4"):
        price_pipeline(_plan(4, Pipeline(2), 3), model, costs=costs)
    bad = (np.array([1, 2]),) + costs.segments[1:]
    with pytest.raises(ValueError, match=r"segments\[0\] must start at column 0"):
        StageCosts(costs.pipeline, costs.forward, costs.backward, costs.transfer, costs.busy, bad)
    with pytest.raises(ValueError, match="StageCosts.backward has shape"):
        StageCosts(
            costs.pipeline,
            costs.forward,
            costs.backward[:1],
            costs.transfer,
            costs.busy,
            costs.segments,
        )


def test_a_large_plan_prices_to_a_consistent_timeline() -> None:
    """512 columns, 4 stages, 64 slots: operations never overlap on a process, dependencies
    hold, and the bubble is the definition's."""
    model = CostModel.load("h100-reference", 8)
    plan = _plan(512, Pipeline(4), 64, seed=6)
    costs = stage_costs(plan, model)
    cost = price_pipeline(plan, model, costs=costs)
    dur = cost.op_end - cost.op_start
    assert (dur >= -1e-12).all()
    assert (cost.op_start[:, 1:] >= cost.op_end[:, :-1] - 1e-9).all()
    busy = cost.stage_busy_seconds.sum()
    assert busy == pytest.approx(costs.forward.sum() * 1 + costs.backward.sum())
    assert cost.bubble_fraction == pytest.approx(1 - busy / (cost.step_seconds * 4 * 512))
    # The last stage's first forward of slot 0 waits for the three stages before it.
    first = cost.op_start[3, 0]
    chain = costs.forward[0, :, :3].sum(axis=1) + costs.transfer[0, :, 1:4].sum(axis=1)
    assert (first >= chain - 1e-9).all()


def test_a_graph_made_once_prices_every_plan_of_its_slot_count_alike() -> None:
    model = CostModel.load("h100-reference", 8)
    graph = schedule_graph(Pipeline(2, 2), 4)
    for seed in range(3):
        plan = _plan(8, Pipeline(2, 2), 4, seed=seed)
        fresh, reused = price_pipeline(plan, model), price_pipeline(plan, model, graph=graph)
        np.testing.assert_array_equal(fresh.op_end, reused.op_end)
    with pytest.raises(ValueError, match="the graph is of"):
        price_pipeline(_plan(8, Pipeline(2, 2), 6), model, graph=graph)
