"""FSDPRunner on 2-D meshes (HSDP; FSDP2 + tensor parallel), trainable sets changed after the
runner is built, and a unit passed instead of the root.

One spawn of 4 gloo ranks runs every case, in fp64, against one process holding the whole model
and the whole global batch (``tests/multirank/test_trainers.py``'s reference and helpers):

- HSDP: ``fully_shard(mesh=2 x 2 mesh)``, placements ``(Replicate(), Shard(0))``; every rank is
  one DP x CP rank of the plan (a pool over all 4), the plans of test_trainers (CP 1, 2 and 4;
  an idle wave, an idle step). Gradients within 1e-9 and 10 AdamW steps within 1e-9; one
  all-gather and one reduce-scatter per unit.
- FSDP2 + TP: a ("dp_cp", "tp") 2 x 2 mesh; each Llama block's attention and MLP projections
  split over TP (``parallelize_module``, heads split: 2 query and 1 KV head per TP rank), then
  ``fully_shard`` on the "dp_cp" sub-mesh. Each TP index has its own GroupPool over the 2 ranks
  with that index: the plan's world is 2 (a CP-2 wave and a CP-1 wave with rank 1 idle; a step
  with rank 1 idle). Gradients within 1e-9 and 10 AdamW steps within 1e-9.
- A parameter unfrozen after the runner is built gets its gradient; one frozen after it is
  built gets none and the step runs (the model resharded after it).
- ``FSDPRunner(block)`` is refused, before any forward and after one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dyncp.integrations.fsdp import FSDPRunner  # noqa: E402
from dyncp.integrations.hf import register_ring_attention  # noqa: E402
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave  # noqa: E402
from dyncp.runtime import GroupPool  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402
from tests.multirank.test_trainers import (  # noqa: E402
    ADAM_STEPS,
    LENGTHS,
    PLANS,
    assert_adamw_steps_match,
    blocks_of,
    full_grads,
    full_params,
    make_model,
    reference_step,
    run_step,
    tokens_for,
)

WORLD = 4
TP = 2
#: The tensor-parallel plan of one Llama block: heads and the MLP's hidden split over TP ranks.
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def _tp_plans() -> dict[str, StepPlan]:
    """Plans of the DP x CP axis of 2 ranks (each TP index runs one)."""
    mb, topo = MicroBatch, Topology(2, 2, 256)
    idle_wave = (
        Wave((Group(0, 2, (mb((1,)), mb((7,)))),)),
        Wave((Group(0, 1, (mb((3, 4)), mb((0,)), mb((2, 5, 6)))),)),
    )
    idle_step = (Wave((Group(0, 1, (mb((1,)), mb((0, 3, 4)), mb((2, 5, 6, 7)))),)),)
    return {
        "idle-wave": StepPlan(topo, LENGTHS, idle_wave, policy="hand"),
        "idle-step": StepPlan(topo, LENGTHS, idle_step, policy="hand"),
    }


TP_PLANS = _tp_plans()
#: (mesh, model, plan) of the one-step gradient cases.
CASES = [("hsdp", "tiny", p) for p in PLANS] + [("tp", "llama", p) for p in TP_PLANS]


def seed_of(case: int) -> int:
    return 300 + case


def wrap_2d(how: str, kind: str, mesh) -> nn.Module:
    """``kind`` under HSDP (``mesh``: replicate x shard) or TP + FSDP2 (``mesh``: dp_cp x tp)."""
    model = make_model(kind)
    dp = mesh if how == "hsdp" else mesh["dp_cp"]
    for block in blocks_of(model):
        if how == "tp":
            parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _worker(rank: int, world: int) -> dict:
    register_ring_attention()
    pool = GroupPool()
    # Every rank builds both TP indices' pools, in the same order (group creation is collective).
    tp_pools = [GroupPool(ranks=list(range(t, world, TP))) for t in range(TP)]
    tp_pool = tp_pools[rank % TP]
    meshes = {
        "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
        "tp": init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp_cp", "tp")),
    }
    out: dict = {"cases": [], "placements": set()}
    for c, (how, kind, plan_name) in enumerate(CASES):
        model = wrap_2d(how, kind, meshes[how])
        out["placements"] |= {(how, str(p.placements)) for p in model.parameters()}
        plan, p = (PLANS, pool) if how == "hsdp" else (TP_PLANS, tp_pool)
        runner = FSDPRunner(model)
        loss, count, calls = run_step(model, runner, p, plan[plan_name], tokens_for(seed_of(c)))
        if how == "tp":  # run_step sums the loss over all 4 ranks: each TP rank holds it once
            loss /= TP
        out["cases"].append((loss, full_grads(model), count, calls, runner.units))
    out["adam"] = {}
    for how, kind in (("hsdp", "tiny"), ("tp", "llama")):
        model = wrap_2d(how, kind, meshes[how])
        runner = FSDPRunner(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        plans, p = (PLANS, pool) if how == "hsdp" else (TP_PLANS, tp_pool)
        for step in range(ADAM_STEPS):
            plan = plans[("idle-wave", "idle-step")[step % 2]]
            run_step(model, runner, p, plan, tokens_for(100 + step))
            opt.step()
            opt.zero_grad()
        out["adam"][how] = full_params(model)
    out["refused"] = _refusals(pool, meshes["tp"], init_device_mesh("cpu", (world,)))
    out["frozen"] = _freeze_after_build(pool, init_device_mesh("cpu", (world,)))
    out["unit"] = _unit_refused(pool, init_device_mesh("cpu", (world,)))
    return out


def _refusals(pool: GroupPool, tp_mesh, mesh) -> list[str]:
    """The errors of a TP model stepped with the whole job's pool (not its TP index's) and of a
    model sharded along dim 1 (``shard_placement_fn``)."""
    errors = []
    model = wrap_2d("tp", "llama", tp_mesh)
    try:
        FSDPRunner(model).step(TP_PLANS["idle-wave"], pool, lambda ctx: None)
    except ValueError as exc:
        errors.append(str(exc))
    model = make_model("tiny")
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    try:
        FSDPRunner(model)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def _freeze_after_build(pool: GroupPool, mesh) -> dict:
    """Unfreeze block 0 after building the runner, then freeze block 1 after building one."""
    out = {}
    for name, frozen_at_build, frozen_at_step in (("unfreeze", 0, None), ("freeze", None, 1)):
        model = make_model("tiny")
        if frozen_at_build is not None:
            blocks_of(model)[frozen_at_build].requires_grad_(False)
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runner = FSDPRunner(model)
        if frozen_at_build is not None:
            blocks_of(model)[frozen_at_build].requires_grad_(True)
        if frozen_at_step is not None:
            blocks_of(model)[frozen_at_step].requires_grad_(False)
        plan = PLANS["idle-wave" if name == "unfreeze" else "idle-step"]
        _, _, calls = run_step(model, runner, pool, plan, tokens_for(200 + len(out)))
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        out[name] = (full_grads(model), calls, sharded)
    return out


def _unit_refused(pool: GroupPool, mesh) -> list[str]:
    """The errors of ``FSDPRunner(block)`` before the model ran a forward and after a step."""
    model = make_model("tiny")
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    errors = []
    for _ in range(2):
        try:
            FSDPRunner(blocks_of(model)[1])
        except ValueError as exc:
            errors.append(str(exc))
        run_step(model, FSDPRunner(model), pool, PLANS["idle-wave"], tokens_for(250))
    return errors


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_gloo(_worker, world=WORLD, timeout=420, pg_timeout=120)


def counts_of(plan: StepPlan, world: int) -> list[int]:
    counts = [0] * world
    for wave in plan.waves:
        for g in wave.groups:
            for r in range(g.start, g.start + g.size):
                counts[r] += len(g.microbatches)
    return counts


def assert_grads_close(grads: dict, ref: dict[str, torch.Tensor], what: object) -> None:
    assert set(grads) == set(ref), what
    for name, g in ref.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        err = (grads[name] - g).abs().max().item()
        assert err <= 1e-9 * scale, (what, name, err, scale)


def test_tp_plans_are_uneven_and_leave_a_rank_idle() -> None:
    for plan in TP_PLANS.values():
        plan.validate()
        assert min(counts_of(plan, 2)) < max(counts_of(plan, 2))
    assert {g.size for w in TP_PLANS["idle-wave"].waves for g in w.groups} == {1, 2}
    assert counts_of(TP_PLANS["idle-step"], 2)[1] == 0


@pytest.mark.timeout(480)
def test_meshes_place_parameters_as_hsdp_and_tensor_parallel(results: list[dict]) -> None:
    for rank in range(WORLD):
        seen = results[rank]["placements"]
        assert {p for how, p in seen if how == "hsdp"} == {"(Replicate(), Shard(dim=0))"}
        tp = {p for how, p in seen if how == "tp"}
        assert "(Shard(dim=0), Shard(dim=1))" in tp  # row-wise: o_proj, down_proj
        assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in tp  # column-wise: q, k, v, up
        assert "(Shard(dim=0),)" in tp  # norms, embedding, head: on the dp_cp sub-mesh


@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_one_step_equals_single_process(results: list[dict], case: int) -> None:
    how, kind, plan_name = CASES[case]
    plan = (PLANS if how == "hsdp" else TP_PLANS)[plan_name]
    model = make_model(kind)
    ref_loss = reference_step(model, tokens_for(seed_of(case))).item()
    ref = {n: p.grad for n, p in model.named_parameters()}
    counts = counts_of(plan, plan.topology.world)
    for rank in range(WORLD):
        loss, grads, count, calls, units = results[rank]["cases"][case]
        position = rank if how == "hsdp" else rank // TP  # the rank's place on the DP x CP axis
        assert count == counts[position], (rank, count, counts)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0), (rank, loss, ref_loss)
        assert_grads_close(grads, ref, (CASES[case], rank))
        assert units == len(blocks_of(model)) + 1
        assert calls == {"all_gather_single": units, "reduce_scatter_single": units}, calls


@pytest.mark.timeout(480)
@pytest.mark.parametrize("how", ["hsdp", "tp"])
def test_adamw_steps_equal_single_process(results: list[dict], how: str) -> None:
    assert len(results) == WORLD
    got = [r["adam"][how] for r in results]
    assert_adamw_steps_match(got, "tiny" if how == "hsdp" else "llama", label=(how,))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["unfreeze", "freeze"])
def test_trainable_set_changed_after_build(results: list[dict], name: str) -> None:
    model = make_model("tiny")
    if name == "freeze":
        blocks_of(model)[1].requires_grad_(False)
    reference_step(model, tokens_for(200 + (name == "freeze")))
    ref = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    units = len(blocks_of(model)) + 1
    for rank in range(WORLD):
        grads, calls, sharded = results[rank]["frozen"][name]
        assert_grads_close(grads, ref, (name, rank))  # also: no gradient on a frozen parameter
        assert sharded, rank  # the step resharded the model
        reduced = units - (name == "freeze")  # a unit with nothing trainable is not reduced
        assert calls == {"all_gather_single": units, "reduce_scatter_single": reduced}


@pytest.mark.timeout(480)
def test_a_unit_is_refused_as_the_runner_model(results: list[dict]) -> None:
    for rank in range(WORLD):
        errors = results[rank]["unit"]
        assert len(errors) == 2, (rank, errors)  # before any forward, and after a step
        for error in errors:
            assert "FSDPRunner needs the FSDP2 root module" in error
            assert "unit inside" in error
        assert "TinyDecoder" in errors[0]  # found by walking up the module tree


@pytest.mark.timeout(480)
def test_wrong_pool_and_unsupported_sharding_are_refused(results: list[dict]) -> None:
    for rank in range(WORLD):
        pool_error, dim1_error = results[rank]["refused"]
        dp = sorted(range(rank % TP, WORLD, TP))  # this TP index's DP x CP ranks
        assert f"FSDP mesh spans ranks {dp}" in pool_error, pool_error
        assert "pool's DP x CP axis ranks [0, 1, 2, 3]" in pool_error
        assert "is placed (Shard(dim=1),)" in dim1_error, dim1_error
        assert "FSDPRunner supports fully_shard's dim-0 sharding" in dim1_error
