"""Full-sharding FSDP2 under dynamic CP on 2-D meshes: HSDP and FSDP2 + tensor parallel.

One spawn of 4 gloo ranks runs every case, in fp64, against one process holding the whole model
and the whole global batch (``test_trainers``' reference), on plans with empty passes (the
lengths of ``test_fsdp_sharded``: the filler sequence has a label, so a filler that did not
weigh zero would show):

- HSDP: ``fully_shard(mesh=2 x 2 mesh)`` (replicate x shard) on the tiny decoder; the pool and
  the plan span all 4 ranks (``test_fsdp_sharded``'s plans: CP 1, 2 and 4, an idle wave, an idle
  step). FSDP2 reduce-scatters over the shard dim and all-reduces over the replicate dim, in
  every pass (``reduce="every-pass"``) or once (``"once"``); counted per rank, as are the
  all-gathers.
- FSDP2 + TP: ``test_fsdp_mesh``'s ("dp_cp", "tp") 2 x 2 mesh and TP plan on a Llama (heads and
  MLP split over TP), ``fully_shard`` on the "dp_cp" sub-mesh; a pool per TP index over its
  2 DP x CP ranks, plans of world 2 (``test_fsdp_mesh``'s, on these lengths): an idle CP-1
  wave, an idle step, so rank 1 of each pool runs empty passes while its TP partner does too.

Asserted: loss within 1e-12 and gradients within 1e-9 of one process; every rank runs its
micro-batches plus the schedule's empty passes; FSDP2's collectives per rank; 10 AdamW steps
within 1e-9 in both reduce modes; ``FSDPSizes`` (what ``choose_fsdp_mode`` prices) counts one
rank's share: the shard dim's world, one TP rank's parameter parts. Refused with a clear
error: HSDP + TP (a 3-D mesh), and a TP model stepped with the whole job's pool instead of its
TP index's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from dyncp.integrations.fsdp_mode import FSDPSizes  # noqa: E402
from dyncp.integrations.fsdp_sharded import ShardedFSDPRunner  # noqa: E402
from dyncp.integrations.hf import register_ring_attention  # noqa: E402
from dyncp.plan import StepPlan, pass_schedule  # noqa: E402
from dyncp.runtime import GroupPool  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402
from tests.multirank.test_fsdp_mesh import TP, TP_PLAN, assert_grads_close, wrap_2d  # noqa: E402
from tests.multirank.test_fsdp_mesh import TP_PLANS as MESH_TP_PLANS  # noqa: E402
from tests.multirank.test_fsdp_sharded import LENGTHS, PLANS, run_step, tokens_for  # noqa: E402
from tests.multirank.test_trainers import (  # noqa: E402
    ADAM_STEPS,
    WORLD,
    assert_adamw_steps_match,
    blocks_of,
    full_grads,
    full_params,
    make_model,
    reference_step,
)

#: test_fsdp_mesh's DP x CP plans of world 2, on the lengths whose filler has a label.
TP_PLANS = {
    name: StepPlan(plan.topology, LENGTHS, plan.waves, policy="hand")
    for name, plan in MESH_TP_PLANS.items()
}
REDUCES = ("every-pass", "once")
#: (mesh, model, reduce, plan) of the one-step gradient cases.
CASES = [("hsdp", "tiny", r, p) for r in REDUCES for p in ("idle-wave", "idle-step")] + [
    ("tp", "llama", r, p) for r in REDUCES for p in TP_PLANS
]
KIND = {"hsdp": "tiny", "tp": "llama"}


def seed_of(case: int) -> int:
    return 500 + case


def plans_of(how: str) -> dict[str, StepPlan]:
    return PLANS if how == "hsdp" else TP_PLANS


class _AllReduces:
    """Counts ``dist.all_reduce`` calls on one process group (FSDP2's HSDP all-reduce)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.calls = group, 0

    def __enter__(self) -> _AllReduces:
        self.saved = dist.all_reduce

        @functools.wraps(self.saved)
        def counted(*args, **kwargs):
            if kwargs.get("group") is self.group:
                self.calls += 1
            return self.saved(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.saved


def _worker(rank: int, world: int) -> dict:
    register_ring_attention()
    pool = GroupPool()
    # Every rank builds both TP indices' pools, in the same order (group creation is collective).
    tp_pools = [GroupPool(ranks=list(range(t, world, TP))) for t in range(TP)]
    pools = {"hsdp": pool, "tp": tp_pools[rank % TP]}
    meshes = {
        "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
        "tp": init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp_cp", "tp")),
    }
    replicate = meshes["hsdp"].get_group("replicate")
    out: dict = {"cases": [], "adam": {}}
    for c, (how, kind, reduce, plan_name) in enumerate(CASES):
        model = wrap_2d(how, kind, meshes[how])
        runner = ShardedFSDPRunner(model, reduce=reduce)
        with _AllReduces(replicate) as all_reduces:
            loss, report, calls = run_step(
                model, runner, pools[how], plans_of(how)[plan_name], tokens_for(seed_of(c))
            )
        if how == "tp":  # run_step sums the loss over all 4 ranks: each TP rank holds it once
            loss /= TP
        calls = {**calls, "replicate_all_reduce": all_reduces.calls}
        out["cases"].append(
            (loss, full_grads(model), len(report.microbatches), report.empty_passes, calls)
        )
    for how in ("hsdp", "tp"):
        for reduce in REDUCES:
            model = wrap_2d(how, KIND[how], meshes[how])
            runner = ShardedFSDPRunner(model, reduce=reduce)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            for step in range(ADAM_STEPS):
                plan = plans_of(how)[("idle-wave", "idle-step")[step % 2]]
                run_step(model, runner, pools[how], plan, tokens_for(100 + step))
                opt.step()
                opt.zero_grad()
            out["adam"][how, reduce] = full_params(model)
    out["sizes"] = {how: FSDPSizes.of(wrap_2d(how, KIND[how], meshes[how])) for how in KIND}
    out["refused"] = _refusals(pool, meshes["tp"])
    return out


def _refusals(pool: GroupPool, tp_mesh) -> list[str]:
    """The errors of HSDP + TP (a 3-D mesh) and of a TP model stepped with the whole job's pool."""
    errors = []
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = make_model("llama")
    for block in blocks_of(model):
        parallelize_module(block, mesh3["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh3["replicate", "shard"])
    fully_shard(model, mesh=mesh3["replicate", "shard"])
    try:
        ShardedFSDPRunner(model)
    except ValueError as exc:
        errors.append(str(exc))
    model = wrap_2d("tp", "llama", tp_mesh)
    try:
        ShardedFSDPRunner(model).step(TP_PLANS["idle-wave"], pool, lambda ctx: None)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_gloo(_worker, world=WORLD, timeout=540, pg_timeout=120)


def test_plans_need_empty_passes() -> None:
    for how in ("hsdp", "tp"):
        for plan in plans_of(how).values():
            plan.validate()
            assert not pass_schedule(plan).aligned
            assert min(plan.lengths) >= 2  # the filler sequence has a label


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_one_step_equals_single_process(results: list[dict], case: int) -> None:
    how, kind, reduce, plan_name = CASES[case]
    schedule = pass_schedule(plans_of(how)[plan_name])
    model = make_model(kind)
    ref_loss = reference_step(model, tokens_for(seed_of(case))).item()
    ref = {n: p.grad for n, p in model.named_parameters()}
    units = len(blocks_of(model)) + 1
    for rank in range(WORLD):
        loss, grads, count, empty, calls = results[rank]["cases"][case]
        position = rank if how == "hsdp" else rank // TP  # the rank's place on the DP x CP axis
        assert count + empty == schedule.passes, (rank, count, empty)
        assert empty == schedule.empty_of_rank(position), (rank, empty)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0), (rank, loss, ref_loss)
        assert_grads_close(grads, ref, (CASES[case], rank))
        # FSDP2's own collectives in lockstep: the root stays gathered through backward; a
        # reduce-scatter (and for HSDP an all-reduce over the replicate dim) per unit per pass,
        # or per step with reduce="once".
        reduces = units if reduce == "once" else units * schedule.passes
        assert calls == {
            "all_gather_single": (2 * units - 1) * schedule.passes,
            "reduce_scatter_single": reduces,
            "replicate_all_reduce": reduces if how == "hsdp" else 0,
        }, (CASES[case], rank, calls)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("how", ["hsdp", "tp"])
def test_adamw_steps_equal_single_process(results: list[dict], how: str, reduce: str) -> None:
    assert len(results) == WORLD
    got = [r["adam"][how, reduce] for r in results]
    assert_adamw_steps_match(got, KIND[how], tokens=tokens_for, label=(how, reduce))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["hsdp", "tp"])
def test_sizes_count_what_one_rank_shards(results: list[dict], how: str) -> None:
    """choose_fsdp_mode's sizes on 2-D meshes: W is the shard dim's 2 ranks (HSDP replicates
    over the other 2), and under TP the counts are one TP rank's parts of the parameters."""
    model = make_model(KIND[how])

    def local(name: str, param: torch.Tensor) -> int:
        split = how == "tp" and any(name.endswith(f"{key}.weight") for key in TP_PLAN)
        return param.numel() // TP if split else param.numel()

    total = sum(local(n, p) for n, p in model.named_parameters())
    block = sum(local(n, p) for n, p in blocks_of(model)[0].named_parameters())
    layers = len(blocks_of(model))
    for rank in range(WORLD):
        sizes = results[rank]["sizes"][how]
        assert (sizes.params, sizes.trainable, sizes.world) == (total, total, 2), (how, sizes)
        assert (sizes.root, sizes.block) == (total - layers * block, block), (how, sizes)


@pytest.mark.timeout(600)
def test_unsupported_mesh_and_wrong_pool_are_refused(results: list[dict]) -> None:
    for rank in range(WORLD):
        mesh3d, pool_error = results[rank]["refused"]
        assert "on a 3-D mesh (2-D FSDP mesh)" in mesh3d, mesh3d
        assert "ShardedFSDPRunner supports fully_shard on a 1-D mesh, HSDP" in mesh3d
        dp = sorted(range(rank % TP, WORLD, TP))  # this TP index's DP x CP ranks
        assert f"FSDP mesh spans ranks {dp}" in pool_error, pool_error
        assert "pool's DP x CP axis ranks [0, 1, 2, 3]" in pool_error
        assert "a pool per TP index" in pool_error
