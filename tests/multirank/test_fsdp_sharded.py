"""Full-sharding FSDP2 under dynamic CP: lockstep passes, exact gradients, memory per block.

One spawn of 4 gloo ranks runs every case, on the plans of ``test_trainers`` (CP 1, 2 and 4,
several micro-batches per group; ``idle-wave``: rank 3 idle in the second wave; ``idle-step``:
rank 3 runs no micro-batch at all), so every rank runs empty passes somewhere. Models: the tiny
decoder (with and without activation checkpointing, gradients reduced every pass or once) and a
Hugging Face Llama, under ``fully_shard`` per block and root, fp64. Reference: one process, the
whole batch in one CP-1 micro-batch. Asserted: loss within 1e-12 and gradients within 1e-9 of it;
every rank runs the same passes (its micro-batches plus the schedule's empty passes) and issues
the same FSDP2 collectives (one all-gather per unit and one per block's backward re-gather per
pass, one reduce-scatter per unit per pass, or per step with ``reduce="once"``); 10 AdamW steps
within 1e-9 of one process. Memory: on an 8-block decoder the live unsharded parameter storage
(read from FSDP2's own parameter state after each all-gather and each micro-batch) never exceeds
the root unit's plus one block's, while the gather-once runner holds all eight blocks. A
failed step (a plan mismatch) leaves the gradients and FSDP2's settings as they were.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torch.distributed._composable.checkpoint_activation import checkpoint  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402

from dyncp.control.agreement import PlanMismatchError  # noqa: E402
from dyncp.integrations.fsdp import FSDPRunner  # noqa: E402
from dyncp.integrations.fsdp_mode import FSDPSizes  # noqa: E402
from dyncp.integrations.fsdp_sharded import ShardedFSDPRunner  # noqa: E402
from dyncp.integrations.hf import register_ring_attention  # noqa: E402
from dyncp.plan import StepPlan, pass_schedule  # noqa: E402
from dyncp.runtime import GroupPool, MicroBatchContext, reduce_loss  # noqa: E402
from dyncp.testing import TinyConfig, TinyDecoder  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402
from tests.multirank.test_trainers import (  # noqa: E402
    ADAM_STEPS,
    VOCAB,
    WORLD,
    _Counter,
    assert_adamw_steps_match,
    blocks_of,
    full_grads,
    full_params,
    loss_of,
    make_model,
    reference_step,
)
from tests.multirank.test_trainers import PLANS as TRAINER_PLANS  # noqa: E402

#: test_trainers' lengths with the 1-token sequence made 3 long: the filler (the shortest
#: sequence, here 2 tokens) has a label, so a filler that did not weigh zero would show.
LENGTHS = (37, 150, 9, 64, 23, 3, 2, 88)
PLANS = {
    name: StepPlan(plan.topology, LENGTHS, plan.waves, policy="hand")
    for name, plan in TRAINER_PLANS.items()
}


def tokens_for(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (s,), generator=gen) for s in LENGTHS]


#: (model, runner, plan)
CASES = [
    ("tiny", how, plan)
    for how in ("sharded", "sharded-once", "sharded-ac")
    for plan in ("idle-wave", "idle-step")
] + [("llama", "sharded", "idle-wave"), ("llama", "sharded-ac", "idle-step")]

BLOCKS8 = TinyConfig(vocab=VOCAB, layers=8)


def wrap(kind: str, how: str, mesh) -> tuple[nn.Module, ShardedFSDPRunner]:
    model = make_model(kind)
    if how.endswith("-ac"):
        if kind == "tiny":
            for block in blocks_of(model):
                checkpoint(block)
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ShardedFSDPRunner(model, reduce="once" if how == "sharded-once" else "every-pass")


def run_step(model, runner, pool, plan, tokens, probe=None):
    losses = []

    def step_fn(ctx: MicroBatchContext) -> None:
        loss = loss_of(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
        loss.backward()
        losses.append(loss.detach().double())
        if probe is not None:
            probe()

    with _Counter() as counter:
        report = runner.step(plan, pool, step_fn)
    loss = reduce_loss(losses, dtype=torch.float64)
    return loss.item(), report, counter.calls


def _groups(model: nn.Module) -> list:
    return [
        group
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]


def live_unsharded(groups: list) -> int:
    """Bytes of unsharded parameter storage alive now, read from FSDP2's parameter state (a
    freed unsharded parameter keeps its tensor with a storage resized to zero)."""
    storages = {}
    for group in groups:
        for fsdp_param in group.fsdp_params:
            tensors = [
                *fsdp_param.all_gather_outputs,
                getattr(fsdp_param, "_unsharded_param", None),
            ]
            for t in tensors:
                if t is not None and t.untyped_storage().nbytes():
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def padded_bytes(module: nn.Module, world: int, *, own_only: bool = False) -> int:
    """Bytes of ``module``'s parameters unsharded the way FSDP2 gathers them (dim 0 padded to a
    multiple of the world size); ``own_only``: without the blocks (the root unit's own)."""
    total = 0
    for name, p in module.named_parameters():
        if own_only and name.startswith("blocks."):
            continue
        rows = -(-p.shape[0] // world) * world
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def memory_peak(mesh, pool, how: str) -> dict:
    """The largest live unsharded parameter storage of one step on the 8-block decoder."""
    torch.manual_seed(0)
    model = TinyDecoder(BLOCKS8).to(torch.float64)
    world = mesh.size()
    unit = {
        "block": padded_bytes(model.blocks[0], world),
        "root": padded_bytes(model, world, own_only=True),
    }
    if how.endswith("-ac"):
        for block in model.blocks:
            checkpoint(block)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sizes = FSDPSizes.of(model)
    runner = FSDPRunner(model) if how == "gather-once" else ShardedFSDPRunner(model)
    groups, peak = _groups(model), [0]

    def probe() -> None:
        peak[0] = max(peak[0], live_unsharded(groups))

    for group in groups:  # measure right after every all-gather, when the storage just grew
        for name in ("unshard", "wait_for_unshard"):
            inner = getattr(group, name)

            def measured(*args, _inner=inner, **kwargs):
                out = _inner(*args, **kwargs)
                probe()
                return out

            setattr(group, name, measured)
    run_step(model, runner, pool, PLANS["idle-wave"], tokens_for(7), probe)
    return {"peak": peak[0], "after": live_unsharded(groups), "sizes": sizes, **unit}


def _worker(rank: int, world: int, cases: list) -> dict:
    register_ring_attention()
    pool = GroupPool()
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"cases": []}
    for c, (kind, how, plan_name) in enumerate(cases):
        model, runner = wrap(kind, how, mesh)
        loss, report, calls = run_step(model, runner, pool, PLANS[plan_name], tokens_for(c))
        out["cases"].append(
            (loss, full_grads(model), len(report.microbatches), report.empty_passes, calls)
        )
    out["adam"] = {}
    for how in ("sharded", "sharded-once"):
        model, runner = wrap("tiny", how, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(ADAM_STEPS):
            plan = PLANS[("idle-wave", "idle-step")[step % 2]]
            run_step(model, runner, pool, plan, tokens_for(100 + step))
            opt.step()
            opt.zero_grad()
        out["adam"][how] = full_params(model)
    out["memory"] = {
        how: memory_peak(mesh, pool, how) for how in ("sharded", "sharded-ac", "gather-once")
    }
    out["mismatch"] = mismatch(mesh, pool, rank)
    model, _ = wrap("tiny", "sharded", mesh)
    try:
        ShardedFSDPRunner(model, reduce="sometimes")
    except ValueError as exc:
        out["bad_reduce"] = str(exc)
    return out


def mismatch(mesh, pool, rank: int) -> dict:
    """Rank 1 holds another plan: every rank raises PlanMismatchError, the gradients already on
    the parameters stay as they were and FSDP2's settings are restored."""
    model, runner = wrap("tiny", "sharded-once", mesh)
    run_step(model, runner, pool, PLANS["idle-wave"], tokens_for(1))
    before = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    groups = _groups(model)
    settings = [
        (g.reduce_grads, g.gradient_divide_factor, g.force_sum_reduction_for_comms) for g in groups
    ]
    plan = PLANS["idle-step" if rank == 1 else "idle-wave"]
    try:
        run_step(model, runner, pool, plan, tokens_for(2))
        raised = None
    except PlanMismatchError as exc:
        raised = str(exc)
    kept = all(torch.equal(p.grad.to_local(), before[n]) for n, p in model.named_parameters())
    after = [
        (g.reduce_grads, g.gradient_divide_factor, g.force_sum_reduction_for_comms) for g in groups
    ]
    return {"raised": raised, "kept": kept, "settings": (settings, after)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_gloo(_worker, world=WORLD, args=(CASES,), timeout=600, pg_timeout=60)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_one_step_equals_single_process(results: list[dict], case: int) -> None:
    kind, how, plan_name = CASES[case]
    plan = PLANS[plan_name]
    schedule = pass_schedule(plan)
    assert not schedule.aligned  # the plans need empty passes
    assert min(plan.lengths) >= 2  # ... and their filler sequence has a label
    model = make_model(kind)
    ref_loss = reference_step(model, tokens_for(case)).item()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    units = len(blocks_of(model)) + 1
    for rank in range(WORLD):
        loss, grads, count, empty, calls = results[rank]["cases"][case]
        assert count + empty == schedule.passes, (rank, count, empty)
        assert empty == schedule.empty_of_rank(rank)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0), (rank, loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for name, ref in ref_grads.items():
            scale = ref.abs().max().item()
            assert scale > 0, name
            err = (grads[name] - ref).abs().max().item()
            assert err <= 1e-9 * scale, (CASES[case], rank, name, err, scale)
        # lockstep: FSDP2's own collectives, per pass (the root stays gathered through backward)
        reduces = units if how == "sharded-once" else units * schedule.passes
        assert calls == {
            "all_gather_single": (2 * units - 1) * schedule.passes,
            "reduce_scatter_single": reduces,
        }, (rank, calls)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("how", ["sharded", "sharded-once"])
def test_adamw_steps_equal_single_process(results: list[dict], how: str) -> None:
    assert len(results) == WORLD
    got = [r["adam"][how] for r in results]
    assert_adamw_steps_match(got, "tiny", tokens=tokens_for, label=(how,))


@pytest.mark.timeout(700)
@pytest.mark.parametrize("how", ["sharded", "sharded-ac"])
def test_full_sharding_holds_one_block_unsharded(results: list[dict], how: str) -> None:
    for rank in range(WORLD):
        mem = results[rank]["memory"]
        bound = mem[how]["root"] + mem[how]["block"]  # beyond the shards
        assert mem[how]["block"] > 0 and mem[how]["root"] > 0
        assert 0 < mem[how]["peak"] <= bound, (rank, mem[how])
        assert mem[how]["after"] == 0  # resharded at the end of the step
        # the gather-once runner breaks that bound: it holds the root and all eight blocks
        gather = mem["gather-once"]
        assert gather["peak"] == gather["root"] + BLOCKS8.layers * gather["block"], gather
        assert gather["peak"] > bound


@pytest.mark.timeout(700)
def test_sizes_are_read_from_the_sharded_model(results: list[dict]) -> None:
    torch.manual_seed(0)
    model = TinyDecoder(BLOCKS8)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    for rank in range(WORLD):
        sizes = results[rank]["memory"]["sharded"]["sizes"]
        assert (sizes.params, sizes.trainable) == (total, total)
        assert (sizes.root, sizes.block) == (total - BLOCKS8.layers * block, block)
        assert (sizes.world, sizes.compute_bytes, sizes.reduce_bytes) == (WORLD, 8, 8)
        assert (sizes.master_bytes, sizes.optimizer_bytes) == (8, 16.0)


@pytest.mark.timeout(700)
def test_failed_step_keeps_gradients_and_settings(results: list[dict]) -> None:
    for rank in range(WORLD):
        got = results[rank]["mismatch"]
        assert got["raised"] is not None and "plan" in got["raised"].lower(), got
        assert got["kept"], rank
        before, after = got["settings"]
        assert after == before
        assert all(s == (True, None, False) for s in before)  # FSDP2's defaults
        assert "reduce must be one of ('every-pass', 'once')" in results[rank]["bad_reduce"]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="not an FSDPModule"):
        ShardedFSDPRunner(nn.Linear(2, 2))
