"""The planner's head x ring split per group: envelope pricing, the choice, the policy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_helpers import assert_exactly_once, canonical

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.plan import StepPlan, Wave
from dyncp.planner import Planner
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits, layout_histogram
from dyncp.sim.__main__ import main as sim_main

HEADS = (1, 2, 4, 8)


def planner(policy: str, *, world: int = 16, per_node: int = 8, **kw: object) -> Planner:
    model = CostModel.load("h100-reference", per_node)
    return Planner(
        model,
        world=world,
        ranks_per_node=per_node,
        capacity=4096,
        policy=policy,
        max_length=world * 4096,
        head_sizes=HEADS,
        deterministic=True,
        cpsat=None,
        **kw,
    )


def batch(seed: int, n: int = 48) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(np.log(900), 1.5, n).astype(np.int64) + 1, 16 * 4000)


def as_rings(plan: StepPlan) -> StepPlan:
    waves = tuple(
        Wave(tuple(dataclasses.replace(g, heads=1) for g in w.groups)) for w in plan.waves
    )
    return dataclasses.replace(plan, waves=waves)


@pytest.mark.parametrize("seed", range(4))
def test_hybrid_plans_are_valid_and_priced_exactly(seed: int) -> None:
    p = planner("dyncp-hybrid")
    lengths = batch(seed)
    plan = p.plan(lengths)
    plan.validate()
    assert_exactly_once(plan, len(lengths))
    assert plan.policy == "dyncp-hybrid"
    assert plan.topology.head_sizes == HEADS
    assert (plan.topology.query_heads, plan.topology.kv_heads) == (32, 8)  # the profile's
    exact = evaluate_plan(plan, p.model, timing="dataflow").step_seconds
    assert plan.stats["predicted_step_seconds"] == pytest.approx(exact, rel=1e-12)
    assert plan.stats["predicted_step_seconds"] >= plan.stats["lower_bound_seconds"] * (1 - 1e-9)
    # Every group sits on its fastest allowed split.
    for _, g, _ in plan.microbatches():
        assert g.heads in plan.topology.splits(g.size)
    assert choose_splits(as_rings(plan), p.model).waves == plan.waves
    back = StepPlan.from_json(plan.to_json())
    assert back.waves == plan.waves


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_never_slower_than_ring_only(seed: int) -> None:
    lengths = batch(seed, 64)
    ring = planner("dyncp").plan(lengths)
    hybrid = planner("dyncp-hybrid").plan(lengths)
    assert all(g.heads == 1 for _, g, _ in ring.microbatches())
    assert hybrid.stats["predicted_step_seconds"] <= ring.stats["predicted_step_seconds"]
    # Both report the gap against one bound: the one that counts the splits.
    assert hybrid.stats["lower_bound_seconds"] == ring.stats["lower_bound_seconds"]


def test_hybrid_is_deterministic() -> None:
    lengths = batch(7)
    assert canonical(planner("dyncp-hybrid").plan(lengths)) == canonical(
        planner("dyncp-hybrid").plan(lengths)
    )


def test_choose_splits_never_slows_a_group() -> None:
    p = planner("dyncp")
    lengths = batch(3, 64)
    plan = p.plan(lengths)  # rings
    chosen = choose_splits(plan, p.model)
    before = evaluate_plan(plan, p.model)
    after = evaluate_plan(chosen, p.model)
    for mbs_before, mbs_after in zip(before.microbatch_seconds, after.microbatch_seconds):
        assert sum(mbs_after) <= sum(mbs_before) + 1e-15 * len(mbs_before)
    assert after.step_seconds <= before.step_seconds
    hist = layout_histogram(chosen)
    assert sum(hist.values()) == len(lengths)


def test_rings_only_topology_is_left_alone() -> None:
    model = CostModel.load("h100-reference", 8)
    p = Planner(model, world=16, ranks_per_node=8, capacity=4096, cpsat=None, deterministic=True)
    plan = p.plan(batch(1))
    assert choose_splits(plan, model) is plan
    assert plan.topology.head_sizes == (1,) and plan.topology.query_heads == 0


@settings(max_examples=40, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4, 8, 16]),
    lengths=st.lists(st.integers(1, 30000), min_size=1, max_size=6),
)
def test_envelope_keeps_the_bound_contract(cp: int, lengths: list[int]) -> None:
    p = planner("dyncp-hybrid")
    env = p.search_model
    assert isinstance(env, SplitEnvelope)
    x = np.asarray(lengths, dtype=np.int64)
    seconds = env.microbatch_seconds(cp, x)
    splits = p.topology.splits(cp)
    exact = [p.model.microbatch_seconds(cp, x, heads=u) for u in splits]
    assert seconds == pytest.approx(min(exact), rel=1e-12)
    bound = env.fixed_seconds(cp) + env.bound_rank_seconds(cp, x).sum() / cp
    assert seconds >= bound * (1 - 1e-12)
    assert env.alone_seconds(cp, x[:1])[0] == pytest.approx(
        env.microbatch_seconds(cp, x[:1]), rel=1e-12
    )


def test_hybrid_policy_needs_head_sizes() -> None:
    model = CostModel.load("h100-reference", 8)
    with pytest.raises(ValueError, match="dyncp-hybrid.*head_sizes"):
        Planner(model, world=16, ranks_per_node=8, capacity=4096, policy="dyncp-hybrid")


def test_sim_reports_the_split_mix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--steps", "2", "--world", "16", "--capacity", "4096", "--max-length", "32768",
            "--head-sizes", "1,2,4,8", "--json", str(out)]  # fmt: skip
    assert sim_main(argv) == 0
    report = json.loads(out.read_text())
    hybrid = report["policies"]["dyncp-hybrid"]
    assert sum(hybrid["layout_histogram"].values()) == sum(hybrid["cp_histogram"].values())
    assert any(not k.startswith("ring") for k in hybrid["layout_histogram"])
    assert all(k.startswith("ring") for k in report["policies"]["dyncp"]["layout_histogram"])
    assert report["config"]["head_sizes"] == [1, 2, 4, 8]
    assert "head splits:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sim_main(["--head-sizes", "1,3"])


def test_fallback_and_new_model_versions_keep_the_splits() -> None:
    from dyncp.cost_model.calibration import ModelVersion
    from dyncp.planner import VersionedPlanner
    from dyncp.service import check_plan, fallback_planner

    p = planner("dyncp-hybrid", time_limit=0.05)
    fallback = fallback_planner(p)
    assert fallback.policy == "dyncp-hybrid" and fallback.topology == p.topology
    lengths = batch(2)
    plan = fallback.plan(lengths)
    plan.sample_ids = tuple(range(len(lengths)))
    check_plan(plan, topology=p.topology, sample_ids=np.arange(len(lengths)), lengths=lengths)
    assert any(g.heads > 1 for _, g, _ in plan.microbatches())
    # A new model version: the envelope follows the planner's new model.
    profile = p.model.profile.model_copy(update={"linear_seconds_per_token": 1e-3})
    moved = VersionedPlanner.rebuild(p, ModelVersion(1, profile))
    assert moved.search_model.model is moved.model is not p.model
    assert moved.plan(lengths).stats["model_version"] == 1


def test_split_microbatches_enter_the_refit_with_their_split() -> None:
    from dyncp.plan import Group, MicroBatch, Topology
    from dyncp.runtime.executor import MicroBatchTiming, RankReport
    from dyncp.runtime.measure import step_measurements

    topo = Topology(4, 4, 1000, head_sizes=(1, 2), query_heads=4, kv_heads=2)
    plan = StepPlan(
        topology=topo,
        lengths=(1500, 900, 300),
        waves=(
            Wave((Group(0, 2, (MicroBatch((0,)),), heads=2), Group(2, 2, (MicroBatch((1,)),)))),
            Wave((Group(0, 4, (MicroBatch((2,)),)),)),
        ),
    )
    plan.validate()
    reports = []
    for rank in range(4):
        first = (0, 0, 2, (0,), (1500,), 0.3, 2) if rank < 2 else (0, 2, 2, (1,), (900,), 0.2, 1)
        reports.append(
            RankReport(
                timings=[MicroBatchTiming(*first), MicroBatchTiming(1, 0, 4, (2,), (300,), 0.1)],
                wave_seconds=[0.35, 0.12],
            )
        )
    mbs, waves = step_measurements(plan, reports)
    assert [(m.cp, m.lengths, m.heads) for m in mbs] == [
        (2, (1500,), 2),
        (2, (900,), 1),
        (4, (300,), 1),
    ]
    assert mbs[0].seconds == pytest.approx(0.3)
    assert waves[0].busy_seconds == pytest.approx(0.3)  # the split group still sets the wave


def test_metrics_count_sequences_per_layout() -> None:
    from prometheus_client import generate_latest

    from dyncp.observability.metrics import Metrics

    p = planner("dyncp-hybrid")
    plan = p.plan(batch(5))
    metrics = Metrics(policies=("dyncp-hybrid",), cp_sizes=p.topology.group_sizes)
    metrics.observe_step(plan)
    text = generate_latest(metrics.registry).decode()
    for name, n in layout_histogram(plan).items():
        line = f'dyncp_layout_sequences_total{{layout="{name}",policy="dyncp-hybrid"}} {n}.0'
        assert line in text
