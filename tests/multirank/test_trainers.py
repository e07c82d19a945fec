"""dyncp under FSDP2 and DDP: uneven micro-batch counts, exact gradients, never a hang.

One spawn of 4 gloo ranks runs every case. Plans mix CP 1, 2 and 4 and give the ranks different
micro-batch counts: in plan ``idle-wave`` rank 3 has nothing to do in the second wave (counts
3, 3, 5, 2); in plan ``idle-step`` rank 3 runs no micro-batch at all. Models: the tiny decoder
and a Hugging Face Llama, each under FSDP2 (``fully_shard`` per block and root; with and without
activation checkpointing) and under DDP, in fp64. Reference: the same model on one process, the
whole global batch in one CP-1 micro-batch. Loss within 1e-12 (relative) and gradients within
1e-9 (relative to the largest gradient of each parameter); FSDP2 issues exactly one all-gather
and one reduce-scatter per unit on every rank; 10 AdamW steps leave the parameters within 1e-9
of one process. A bf16 mixed-precision policy (fp32 reduction) gives fp32 gradients close to the
fp32 reference.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

from contexts import whole_batch_context  # noqa: E402
from torch.distributed._composable.checkpoint_activation import checkpoint  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from dyncp.integrations.ddp import DDPRunner  # noqa: E402
from dyncp.integrations.fsdp import FSDPRunner  # noqa: E402
from dyncp.integrations.hf import causal_lm_loss, register_ring_attention  # noqa: E402
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave  # noqa: E402
from dyncp.runtime import GroupPool, MicroBatchContext, reduce_loss  # noqa: E402
from dyncp.testing import (  # noqa: E402
    LossSum,
    ThroughDDP,
    TinyConfig,
    TinyDecoder,
    microbatch_loss,
)
from dyncp.testing.distributed import run_gloo  # noqa: E402
from dyncp.testing.hf_models import tiny_causal_lm, tiny_config  # noqa: E402

WORLD = 4
VOCAB = 61
LENGTHS = (37, 150, 9, 64, 23, 1, 2, 88)
ADAM_STEPS = 10


def _plans() -> dict[str, StepPlan]:
    mb, topo = MicroBatch, Topology(WORLD, 2, 256)
    idle_wave = (
        Wave((Group(0, 4, (mb((1,)), mb((7,)))),)),
        Wave((Group(0, 2, (mb((3, 4)),)), Group(2, 1, (mb((0,)), mb((2,)), mb((5, 6)))))),
    )
    idle_step = (
        Wave((Group(0, 2, (mb((1,)), mb((7, 5)))), Group(2, 1, (mb((0,)), mb((2, 6)), mb((4,)))))),
        Wave((Group(0, 2, (mb((3,)),)),)),
    )
    return {
        "idle-wave": StepPlan(topo, LENGTHS, idle_wave, policy="hand"),
        "idle-step": StepPlan(topo, LENGTHS, idle_step, policy="hand"),
    }


PLANS = _plans()
#: (model, wrapping, plan): the tiny decoder on both plans, Llama on the one with CP 1, 2 and 4.
CASES = [
    (model, wrap, plan)
    for model, plans in (("tiny", tuple(PLANS)), ("llama", ("idle-wave",)))
    for wrap in ("fsdp", "fsdp-ac", "ddp")
    for plan in plans
] + [("tiny", "fsdp-bf16", "idle-wave"), ("tiny", "fsdp-frozen", "idle-step")]


def freeze_first_block(model: nn.Module) -> None:
    """A unit with no trainable parameter: still gathered once, never reduced."""
    for param in blocks_of(model)[0].parameters():
        param.requires_grad_(False)


def make_model(kind: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The same weights on every call and in every process."""
    if kind == "tiny":
        torch.manual_seed(0)
        return TinyDecoder(TinyConfig(vocab=VOCAB)).to(dtype)
    return tiny_causal_lm(tiny_config("llama", vocab=VOCAB), register_ring_attention(), dtype=dtype)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return model.blocks if isinstance(model, TinyDecoder) else model.model.layers


def tokens_for(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (s,), generator=gen) for s in LENGTHS]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP wrapping (and the test's loss adapter)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return model.inner if isinstance(model, LossSum) else model


def loss_of(model: nn.Module, ctx: MicroBatchContext, packed: torch.Tensor) -> torch.Tensor:
    """``ctx.loss_scale`` times the summed token loss, for either model kind, through DDP too."""
    if isinstance(unwrap(model), TinyDecoder):
        return microbatch_loss(
            ThroughDDP(model) if model is not unwrap(model) else model, ctx, packed
        )
    return causal_lm_loss(model, ctx, packed, kernel="math")


def wrap(kind: str, how: str, mesh) -> tuple[nn.Module, object]:
    """The model wrapped for ``how`` on this rank, and its runner."""
    if how == "ddp":
        model = make_model(kind)
        ddp = DistributedDataParallel(LossSum(model) if kind == "tiny" else model)
        return ddp, DDPRunner(ddp)
    mp = None
    model = make_model(kind, torch.float32 if how == "fsdp-bf16" else torch.float64)
    if how == "fsdp-frozen":
        freeze_first_block(model)
    if how == "fsdp-bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if how == "fsdp-ac":
        if kind == "tiny":
            for block in blocks_of(model):
                checkpoint(block)  # torch's composable activation checkpointing, per block
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for block in blocks_of(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, FSDPRunner(model)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (collective for FSDP: same order on every rank)."""
    out = {}
    for name, param in unwrap(model).named_parameters():
        grad = param.grad
        if grad is None:  # a frozen parameter
            continue
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in unwrap(model).named_parameters()
    }


class _Counter:
    """Counts FSDP-style collectives (all-gather / reduce-scatter of one flat tensor)."""

    def __init__(self) -> None:
        self.calls = {"all_gather_single": 0, "reduce_scatter_single": 0}

    def __enter__(self) -> _Counter:
        self.saved = {name: getattr(dist, name) for name in self.calls}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))
        return self

    def _counting(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def run_step(model, runner, pool, plan: StepPlan, tokens: list[torch.Tensor]):
    losses = []

    def step_fn(ctx: MicroBatchContext) -> None:
        loss = loss_of(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
        loss.backward()
        losses.append(loss.detach().double())

    with _Counter() as counter:
        report = runner.step(plan, pool, step_fn)
    loss = reduce_loss(losses, dtype=torch.float64)
    return loss.item(), len(report.microbatches), counter.calls


def _worker(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    register_ring_attention()
    pool = GroupPool()
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"cases": []}
    for c, (kind, how, plan_name) in enumerate(cases):
        model, runner = wrap(kind, how, mesh)
        loss, count, calls = run_step(model, runner, pool, PLANS[plan_name], tokens_for(c))
        units = getattr(runner, "units", 0)
        out["cases"].append((loss, full_grads(model), count, calls, units))
    # A runner refuses a pool on other ranks than its FSDP mesh, before any collective (only the
    # pool's ranks are read before the check).
    model, runner = wrap("tiny", "fsdp", mesh)
    try:
        runner.step(PLANS["idle-wave"], SimpleNamespace(ranks=(0, 1)), lambda ctx: None)
    except ValueError as exc:
        out["refused"] = str(exc)
    # Ten AdamW steps under each wrapping, alternating the plans.
    out["adam"] = {}
    for how in ("fsdp", "ddp"):
        model, runner = wrap("tiny", how, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(ADAM_STEPS):
            plan = PLANS[("idle-wave", "idle-step")[step % 2]]
            run_step(model, runner, pool, plan, tokens_for(100 + step))
            opt.step()
            opt.zero_grad()
        out["adam"][how] = full_params(model)
    return out


def reference_step(model: nn.Module, tokens: list[torch.Tensor]) -> torch.Tensor:
    """The global batch's mean token loss on one process (one CP-1 micro-batch), backwarded."""
    ctx = whole_batch_context([t.numel() for t in tokens])
    loss = loss_of(model, ctx, torch.cat(tokens))
    loss.backward()
    return loss.detach()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_gloo(_worker, world=WORLD, args=(CASES,), timeout=240, pg_timeout=60)


def test_plans_are_uneven_and_mix_cp_sizes() -> None:
    for name, plan in PLANS.items():
        plan.validate()
        counts = [0] * WORLD
        for wave in plan.waves:
            for g in wave.groups:
                for r in range(g.start, g.start + g.size):
                    counts[r] += len(g.microbatches)
        assert len(set(counts)) > 1, (name, counts)
        assert any(not any(g.start <= 3 < g.start + g.size for g in w.groups) for w in plan.waves)
    assert {g.size for w in PLANS["idle-wave"].waves for g in w.groups} == {1, 2, 4}
    assert all(g.start + g.size <= 3 for w in PLANS["idle-step"].waves for g in w.groups)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_one_step_equals_single_process(results: list[dict], case: int) -> None:
    kind, how, plan_name = CASES[case]
    plan = PLANS[plan_name]
    dtype = torch.float32 if how == "fsdp-bf16" else torch.float64
    model = make_model(kind, dtype)
    if how == "fsdp-frozen":
        freeze_first_block(model)
    ref_loss = reference_step(model, tokens_for(case)).item()
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    tol_loss, tol_grad = (1e-12, 1e-9) if dtype == torch.float64 else (2e-2, 5e-2)
    expected_counts = [0] * WORLD
    for wave in plan.waves:
        for g in wave.groups:
            for r in range(g.start, g.start + g.size):
                expected_counts[r] += len(g.microbatches)
    for rank in range(WORLD):
        loss, grads, count, calls, units = results[rank]["cases"][case]
        assert count == expected_counts[rank]
        assert loss == pytest.approx(ref_loss, rel=tol_loss, abs=0), (rank, loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for name, ref in ref_grads.items():
            assert grads[name].dtype == dtype, name
            scale = ref.abs().max().item()
            assert scale > 0, name  # every parameter is trained
            err = (grads[name].to(dtype) - ref).abs().max().item()
            assert err <= tol_grad * scale, (CASES[case], rank, name, err, scale)
        if how.startswith("fsdp"):  # whatever the micro-batch count: one of each per unit
            assert units == len(blocks_of(model)) + 1
            reduced = units - (how == "fsdp-frozen")
            assert calls == {"all_gather_single": units, "reduce_scatter_single": reduced}
        else:
            assert calls == {"all_gather_single": 0, "reduce_scatter_single": 0}


@pytest.mark.timeout(300)
def test_pool_on_other_ranks_is_refused(results: list[dict]) -> None:
    for rank in range(WORLD):
        assert "FSDP mesh spans ranks [0, 1, 2, 3]" in results[rank]["refused"]


def assert_adamw_steps_match(
    got: list[dict], kind: str, *, tokens=tokens_for, label: tuple = ()
) -> None:
    """``ADAM_STEPS`` AdamW steps (lr 1e-2, weight decay 0.1) of ``make_model(kind)`` on one
    process, on ``tokens(100 + step)``: every parameter moved, and each rank's parameters in
    ``got`` (one dict per rank) are within 1e-9 of them."""
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(ADAM_STEPS):
        reference_step(model, tokens(100 + step))
        opt.step()
        opt.zero_grad()
    for name, param in model.named_parameters():
        assert (param - start[name]).abs().max() > 1e-3, name  # the steps moved it
        for rank, params in enumerate(got):
            err = (params[name] - param).abs().max().item()
            assert err <= 1e-9, (*label, rank, name, err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["fsdp", "ddp"])
def test_adamw_steps_equal_single_process(results: list[dict], how: str) -> None:
    assert len(results) == WORLD
    assert_adamw_steps_match([r["adam"][how] for r in results], "tiny", label=(how,))


def test_bad_models_are_refused() -> None:
    with pytest.raises(ValueError, match="not an FSDPModule"):
        FSDPRunner(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        DDPRunner(nn.Linear(2, 2))
