"""The whole step in the cost model: old profiles price as before, new parts as stated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dyncp.cost_model import CostModel
from dyncp.cost_model.schema import Profile, ProfileError, bundled_profiles, load_profile
from dyncp.cost_model.sharding import collective_from_profile
from dyncp.cost_model.step_parts import common_parts, step_parts
from dyncp.cost_model.step_reference import reference_step_profile
from dyncp.plan import plan_digest
from dyncp.planner import Planner, PlannerConfig

STEP = {
    "parameters": 1_000_000_000,
    "optimizer_seconds_per_parameter": 2e-11,
    "embedding_seconds_per_token": 1e-7,
    "head_loss_seconds_per_token": 3e-6,
    "fixed_seconds": 0.05,
}


def with_step(profile: Profile, **step: object) -> Profile:
    data = json.loads(profile.to_json())
    data["schema_version"] = 2
    data["step"] = {**STEP, **step}
    return Profile.model_validate(data)


def lengths(seed: int = 0, n: int = 48) -> np.ndarray:
    return np.random.default_rng(seed).integers(64, 12_000, n)


def plan(model: CostModel, policy: str, batch: np.ndarray, world: int = 16, capacity: int = 32_768):
    config = PlannerConfig(
        world=world,
        ranks_per_node=8,
        capacity=capacity,
        policy=policy,
        max_length=int(batch.max()),
        deterministic=True,
        cpsat=None,
        step_parts=True,
    )
    return Planner(model, config).plan(batch)


def test_step_parts_are_priced_only_when_asked() -> None:
    # Off by default: three more pricings per plan (0.77 s at 4,096 ranks) stay out of a plan
    # service's step budget; asked for, they come after ``plan_seconds`` is taken.
    model = CostModel.load("h100-reference", 8)
    batch = lengths()
    config = PlannerConfig(
        world=16,
        ranks_per_node=8,
        capacity=32_768,
        max_length=int(batch.max()),
        deterministic=True,
        cpsat=None,
    )
    assert "step_parts" not in Planner(model, config).plan(batch).stats
    asked = plan(model, "dyncp", batch)
    assert set(asked.stats["step_parts"]) >= {"attention", "total"}
    assert "step_parts_seconds" in asked.stats["timings"]


VERSION_1 = sorted(n for n in bundled_profiles() if load_profile(n).schema_version == 1)


@pytest.mark.parametrize("name", VERSION_1)
def test_version_1_profiles_price_exactly_as_before(name: str) -> None:
    """A version-1 profile has no step: its micro-batches price bit for bit as the same profile
    with a step of zeros, its JSON has no ``step``, and its common parts are all zero."""
    old = load_profile(name)
    assert old.step is None
    assert "step" not in json.loads(old.to_json())
    zero = with_step(
        old,
        parameters=0,
        optimizer_seconds_per_parameter=0.0,
        embedding_seconds_per_token=0.0,
        head_loss_seconds_per_token=0.0,
        fixed_seconds=0.0,
    )
    a, b = CostModel(old, 8), CostModel(zero, 8)
    batch = lengths(1)
    starts = np.arange(0, len(batch), 6)
    for cp in (1, 2, 8):
        np.testing.assert_array_equal(
            a.packs_seconds(cp, batch, starts), b.packs_seconds(cp, batch, starts)
        )
    assert common_parts(old, world=16, ranks_per_node=8) == (0.0, 0.0, 0.0)


def test_old_profile_plan_parts_sum_to_its_prediction() -> None:
    model = CostModel.load("h100-reference", 8)
    p = plan(model, "dyncp", lengths())
    parts = p.stats["step_parts"]
    assert parts["total"] == parts["planned"]
    assert parts["planned"] == pytest.approx(p.stats["predicted_step_seconds"], rel=1e-12)
    assert parts["gradient_reduction"] == parts["optimizer"] == parts["fixed"] == 0.0
    assert min(parts.values()) >= -1e-9


def test_step_needs_version_2() -> None:
    data = json.loads(load_profile("cpu-gloo").to_json())
    data["schema_version"] = 1
    data["step"] = STEP
    with pytest.raises(ProfileError, match="step needs schema_version 2"):
        Profile.from_json(json.dumps(data))


def test_version_2_round_trips() -> None:
    new = with_step(load_profile("h100-reference"))
    assert Profile.from_json(new.to_json()) == new


def test_embedding_and_head_are_paid_per_local_token() -> None:
    old = load_profile("h100-reference")
    a, b = CostModel(old, 8), CostModel(with_step(old), 8)
    batch = [3000, 5000, 700]
    per_token = STEP["embedding_seconds_per_token"] + STEP["head_loss_seconds_per_token"]
    for cp in (1, 4):
        tokens = float(a.priced(cp, np.asarray(batch)).sum())
        extra = b.microbatch_seconds(cp, batch) - a.microbatch_seconds(cp, batch)
        assert extra == pytest.approx(per_token * tokens / cp, rel=1e-9)


def test_gradient_reduction_by_integration() -> None:
    """DDP all-reduce = reduce-scatter + all-gather of the gradients; gather-once: one gather
    of the parameters and one scatter of the gradients; full sharding: both every pass, and
    the sharded optimizer updates 1/W of the parameters."""
    prof = with_step(load_profile("h100-reference"))
    coll = collective_from_profile(prof, world=16, ranks_per_node=8)
    grads, params = 1e9 * 4.0, 1e9 * 2.0
    update = 1e9 * 2e-11
    ddp = common_parts(prof, world=16, ranks_per_node=8, integration="ddp")
    assert ddp == pytest.approx((2 * coll.seconds(grads), update, 0.05))
    once = common_parts(prof, world=16, ranks_per_node=8, integration="fsdp2-once")
    assert once == pytest.approx((coll.seconds(params) + coll.seconds(grads), update / 16, 0.05))
    full = common_parts(prof, world=16, ranks_per_node=8, passes=3, integration="fsdp2-full")
    assert full[0] == pytest.approx(3 * (2 * coll.seconds(params) + coll.seconds(grads)))
    assert common_parts(prof, world=1, ranks_per_node=8)[0] == 0.0
    with pytest.raises(ValueError, match="unknown integration 'zero3'; choose one of ddp"):
        common_parts(prof, world=16, ranks_per_node=8, integration="zero3")


def test_common_parts_are_the_same_for_every_policy_and_parts_sum() -> None:
    model = CostModel(with_step(load_profile("h100-reference")), 8)
    batch = lengths(2, 64)
    seen = []
    for policy in ("static", "megatron", "dyncp"):
        p = plan(model, policy, batch)
        parts = p.stats["step_parts"]
        seen.append(tuple(parts[k] for k in ("gradient_reduction", "optimizer", "fixed")))
        assert parts["planned"] == pytest.approx(p.stats["predicted_step_seconds"], rel=1e-12)
        named = sum(v for k, v in parts.items() if k not in ("planned", "total"))
        assert named == pytest.approx(parts["total"], rel=1e-12)
        assert parts["embedding_head"] > 0 and parts["attention"] > 0 and parts["linear"] > 0
    assert seen[0] == seen[1] == seen[2] and seen[0][0] > 0


def test_exposed_communication_is_what_free_links_save() -> None:
    """Without overlap a ring's transfers are all exposed: the communication part is the step's
    micro-batch time minus the same plan priced with free links, and is positive at CP > 1."""
    data = json.loads(load_profile("cpu-gloo").to_json())
    data["communication"]["overlap"] = False
    model = CostModel(Profile.model_validate(data), 8)
    p = plan(model, "static", np.full(16, 16_000), world=8, capacity=4096)
    assert {g.size for w in p.waves for g in w.groups} == {4}
    parts = step_parts(p, model)
    assert parts.communication > 0
    assert parts.planned == pytest.approx(p.stats["predicted_step_seconds"], rel=1e-12)


def test_plug_in_model_without_profile_is_refused() -> None:
    model = CostModel.load("cpu-gloo", 8)
    p = plan(model, "static", lengths(3, 8), world=2)
    with pytest.raises(ValueError, match="needs a cost model built from a profile; object"):
        step_parts(p, object())


def test_reference_step_profile_is_regenerated_and_prices_micro_batches_as_its_base() -> None:
    """The bundled file is what ``python -m dyncp.cost_model.step_reference`` writes, and its
    micro-batches price bit for bit as h100-reference's (no per-token term is priced twice)."""
    assert len(VERSION_1) >= 10 and "h100-reference" in VERSION_1
    bundled = load_profile("h100-reference-step")
    assert bundled == reference_step_profile()
    assert bundled.schema_version == 2 and bundled.step is not None
    names = {a.name for a in bundled.provenance.assumptions}
    assert {"step.parameters", "step.optimizer_seconds_per_parameter"} <= names
    a, b = CostModel.load("h100-reference", 8), CostModel(bundled, 8)
    batch = lengths(4)
    starts = np.arange(0, len(batch), 5)
    for cp in (1, 4, 16):
        np.testing.assert_array_equal(
            a.packs_seconds(cp, batch, starts), b.packs_seconds(cp, batch, starts)
        )
    reduction, optimizer, _ = common_parts(bundled, world=16, ranks_per_node=8)
    assert optimizer == pytest.approx(8.03e9 * 30 / 3.35e12, rel=0.01)
    assert reduction > 0


@pytest.mark.parametrize("name", ["cpu-gloo", "cpu-gloo-4proc"])
def test_measured_cpu_step_leaves_plans_alone(name: str) -> None:
    """The CPU profiles' measured step (AdamW and the all-reduce, the profiler's) prices no
    per-token embedding or head: every plan is the one the step-less profile makes, digest for
    digest, and only the whole step grows, by the common parts."""
    new = load_profile(name)
    assert new.schema_version == 2 and new.step is not None and new.step.parameters > 0
    assert new.step.embedding_seconds_per_token == new.step.head_loss_seconds_per_token == 0
    data = json.loads(new.to_json())
    data["schema_version"], data["step"] = 1, None
    old = Profile.model_validate({k: v for k, v in data.items() if k != "step"})
    for seed, policy in ((5, "dyncp"), (6, "megatron"), (7, "static")):
        batch = np.random.default_rng(seed).integers(16, 2048, 24)
        a = plan(CostModel(old, 8), policy, batch, world=2, capacity=1024)
        b = plan(CostModel(new, 8), policy, batch, world=2, capacity=1024)
        assert plan_digest(a) == plan_digest(b)
        extra = b.stats["step_parts"]["total"] - a.stats["step_parts"]["total"]
        assert extra == pytest.approx(sum(common_parts(new, world=2, ranks_per_node=8)), rel=1e-9)
        assert extra > 0
