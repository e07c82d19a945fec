"""choose_fsdp_mode: the fastest FSDP2 mode whose per-rank bytes fit, on both sides of each line.

The sizes are those of a bf16 model with fp32 master weights, fp32 reduction and AdamW; the
bytes each mode needs are written out from the module docstring's formulas, so a change of the
formulas or of the order of the modes fails here. The model-reading side (``FSDPSizes.of`` on a
real ``fully_shard`` model) is checked on 4 gloo ranks in ``tests/multirank/test_fsdp_sharded``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")

from dyncp.cost_model.sharding import collective_from_profile  # noqa: E402
from dyncp.integrations.fsdp_mode import FSDPSizes, choose_fsdp_mode, mode_bytes  # noqa: E402

P, T, R, B, W = 8_000, 7_000, 1_000, 800, 4
SIZES = FSDPSizes(
    params=P,
    trainable=T,
    root=R,
    root_trainable=R,
    block=B,
    block_trainable=B,
    world=W,
    compute_bytes=2,
    reduce_bytes=4,
    master_bytes=4,
    optimizer_bytes=8,
)
ACT = 1_000
COMMON = P * 4 / W + T * (4 + 8) / W + ACT  # shards, sharded grads, AdamW moments
NEEDS = {
    "gather-once": round(COMMON + P * 2 + T * 4 * (1 + 1 / W)),
    "sharded-once": round(COMMON + (R + 2 * B) * 2 + T * 4),
    "sharded-every-pass": round(COMMON + (R + 2 * B) * 2 + (R + 2 * B) * 4),
}


def test_bytes_follow_the_formulas() -> None:
    assert mode_bytes(SIZES, activation_bytes=ACT) == NEEDS
    # the order the choice relies on: each later mode needs less
    assert NEEDS["gather-once"] > NEEDS["sharded-once"] > NEEDS["sharded-every-pass"]


@pytest.mark.parametrize(
    ("budget", "mode", "reduce"),
    [
        (NEEDS["gather-once"], "gather-once", None),
        (NEEDS["gather-once"] - 1, "sharded-once", "once"),
        (NEEDS["sharded-once"], "sharded-once", "once"),
        (NEEDS["sharded-once"] - 1, "sharded-every-pass", "every-pass"),
        (NEEDS["sharded-every-pass"], "sharded-every-pass", "every-pass"),
    ],
)
def test_each_side_of_each_threshold(budget: int, mode: str, reduce: str | None) -> None:
    choice = choose_fsdp_mode(SIZES, memory_budget=budget, activation_bytes=ACT)
    assert choice.mode == mode
    assert choice.reduce == reduce
    assert choice.needs == NEEDS
    # the reason names the chosen mode's bytes against the budget, and those of faster modes
    assert choice.reason.startswith(f"{mode} needs {NEEDS[mode]:,} B per rank <= budget")
    if mode != "gather-once":
        assert f"gather-once needs {NEEDS['gather-once']:,} B" in choice.reason


def test_nothing_fits_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no FSDP2 mode fits the budget"):
        choose_fsdp_mode(SIZES, memory_budget=NEEDS["sharded-every-pass"] - 1, activation_bytes=ACT)
    with pytest.raises(ValueError, match="memory_budget must be > 0"):
        choose_fsdp_mode(SIZES, memory_budget=0)
    with pytest.raises(ValueError, match="activation_bytes must be >= 0"):
        mode_bytes(SIZES, activation_bytes=-1)
    with pytest.raises(ValueError, match="must not exceed params"):
        FSDPSizes(
            params=10,
            trainable=11,
            root=1,
            root_trainable=1,
            block=1,
            block_trainable=1,
            world=2,
            compute_bytes=2,
            reduce_bytes=4,
            master_bytes=4,
            optimizer_bytes=8,
        )
    with pytest.raises(ValueError, match="not an FSDPModule"):
        import torch

        choose_fsdp_mode(torch.nn.Linear(2, 2), memory_budget=1)


# ------------------------------------------------------------------ the planner prices the mode
UNITS = (R, *(B,) * 8, P - R - 8 * B)  # the sizes' root, eight blocks, one more unit


def with_units(units: tuple[int, ...] = UNITS) -> FSDPSizes:
    return dataclasses.replace(SIZES, unit_params=units)


def lengths() -> list[int]:
    # 12 documents a rank on 8 ranks, of 200-6000 tokens: the unaligned plans have empty passes.
    return [int(n) for n in np.random.default_rng(0).integers(200, 6000, 96)]


def planned(options: dict) -> tuple:
    from dyncp.cost_model import CostModel
    from dyncp.planner import Planner

    cost = CostModel.load("h100-reference", 8)
    planner = Planner(
        cost, world=8, ranks_per_node=8, capacity=8192, deterministic=True, cpsat=None, **options
    )
    return cost, planner.plan(lengths())


@pytest.mark.parametrize("mode", ["sharded-once", "sharded-every-pass"])
def test_full_sharding_gives_the_aligned_planner_with_the_models_units(mode: str) -> None:
    from dyncp.cost_model import CostModel
    from dyncp.cost_model.pass_timing import price_passes
    from dyncp.plan import pass_schedule

    budget = NEEDS["gather-once"] - 1 if mode == "sharded-once" else NEEDS["sharded-once"] - 1
    choice = choose_fsdp_mode(with_units(), memory_budget=budget, activation_bytes=ACT)
    assert choice.mode == mode
    profile = CostModel.load("h100-reference", 8).profile
    options = choice.planner_options(profile, ranks_per_node=8, world=64)
    assert options["passes"] == "aligned"
    sharding = options["sharding"]
    assert sharding.unit_params == UNITS
    assert (sharding.param_bytes, sharding.grad_bytes) == (2, 4)  # compute and reduce dtypes
    assert sharding.reduce == choice.reduce
    assert sharding.gather == collective_from_profile(profile, world=64, ranks_per_node=8)
    cost, plan = planned(options)
    assert pass_schedule(plan).empty == 0
    assert plan.stats.predicted_step_seconds == pytest.approx(
        price_passes(plan, cost, sharding).step_seconds, rel=1e-12
    )
    # The mesh's own world by default.
    assert choice.planner_options(profile, ranks_per_node=8)["sharding"].gather == (
        collective_from_profile(profile, world=W, ranks_per_node=8)
    )


def test_gather_once_gives_the_default_planner() -> None:
    from dyncp.cost_model import CostModel, evaluate_plan

    choice = choose_fsdp_mode(
        with_units(), memory_budget=NEEDS["gather-once"], activation_bytes=ACT
    )
    options = choice.planner_options(CostModel.load("h100-reference", 8).profile, ranks_per_node=8)
    assert options == {"passes": "free", "sharding": None}
    cost, plan = planned(options)
    _, default = planned({})
    assert plan.waves == default.waves
    assert plan.stats.predicted_step_seconds == evaluate_plan(plan, cost).step_seconds


def test_full_sharding_without_unit_sizes_is_a_clear_error() -> None:
    from dyncp.cost_model import CostModel

    choice = choose_fsdp_mode(SIZES, memory_budget=NEEDS["sharded-once"], activation_bytes=ACT)
    with pytest.raises(ValueError, match="planner_options needs each FSDP unit's parameters"):
        choice.planner_options(CostModel.load("h100-reference", 8).profile, ranks_per_node=8)
    with pytest.raises(ValueError, match="unit_params must be >= 0 each and sum to params"):
        with_units((R, B))


def _read_sizes(rank: int, world: int) -> tuple:
    """One gloo rank: a 3-block TinyDecoder under fully_shard (bf16 gathers, fp32 reduction);
    its sizes as read, and each unit's parameters counted on the module before sharding."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dyncp.testing import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig(layers=3))
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return FSDPSizes.of(model), (root, *blocks)


@pytest.mark.timeout(300)
def test_a_real_fully_shard_model_gives_a_sharding_cost_of_its_units() -> None:
    # One process: FSDPSizes reads the units of a real FSDP2 model; the planner built from the
    # choice prices its plans with those units, exactly as price_passes does.
    from dyncp.cost_model import CostModel
    from dyncp.cost_model.pass_timing import price_passes
    from dyncp.testing.distributed import run_gloo

    [(sizes, units)] = run_gloo(_read_sizes, world=1, timeout=240)
    assert sizes.unit_params == units
    assert (sizes.compute_bytes, sizes.reduce_bytes, sizes.world) == (2, 4, 1)
    needs = mode_bytes(sizes)
    choice = choose_fsdp_mode(sizes, memory_budget=needs["sharded-every-pass"])
    assert choice.mode == "sharded-every-pass"
    options = choice.planner_options(
        CostModel.load("h100-reference", 8).profile, ranks_per_node=8, world=8
    )
    assert options["sharding"].unit_params == units
    assert (options["sharding"].param_bytes, options["sharding"].grad_bytes) == (2, 4)
    cost, plan = planned(options)
    assert plan.stats.predicted_step_seconds == pytest.approx(
        price_passes(plan, cost, options["sharding"]).step_seconds, rel=1e-12
    )
