"""Trainer-side fixes pinned on real gloo ranks: the step's loss, and frozen weights under DDP.

- ``reduce_loss`` with a rank that ran no micro-batch: every rank sends the same buffer whatever
  its losses' dtype (an fp64 loss against an idle rank's default used to abort the job in gloo,
  8 bytes against 4), and every rank returns the same value in the same dtype.
- ``DDPRunner`` and frozen parameters: a parameter with ``requires_grad=False`` keeps
  ``.grad is None`` (a zero gradient would let AdamW's decoupled weight decay move it), stays
  bitwise unchanged over AdamW steps with weight decay, also when a rank ran nothing, while the
  trainable parameters end within 1e-9 of the same steps on one process.
- ``execute_local`` (a one-rank plan on a process without torch.distributed, what
  ``DynCPTrainer`` runs under plain ``python``) calls ``step_fn`` with exactly the contexts
  ``execute`` gives the same plan on a one-rank gloo pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from contexts import whole_batch_context

from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.runtime import GroupPool, MicroBatchContext, reduce_gradients, reduce_loss
from dyncp.testing import LossSum, ThroughDDP, TinyConfig, TinyDecoder, microbatch_loss
from dyncp.testing.distributed import run_gloo

WORLD = 2
VOCAB = 61
LENGTHS = (37, 64, 9, 23, 2)
ADAM_STEPS = 4
FROZEN = ("embed.", "blocks.0.")  # the input embedding and a whole block between trainable ones


# --- reduce_loss: the same buffer on every rank ------------------------------------------------

#: (rank 0's losses, rank 1's losses, dtype=, the dtype every rank must return).
LOSS_CASES = [
    ("fp64, idle rank", [[0.25, 0.5]], [], None, torch.float64),
    ("fp64 vs fp32", [[0.25]], [[0.5]], None, torch.float64),
    ("bf16 vs fp16", [[0.25]], [[0.5]], None, torch.float32),
    ("all idle", [], [], None, torch.float32),
    ("fp64, idle, dtype given", [[0.25, 0.5]], [], torch.float32, torch.float32),
]
LOSS_DTYPES = {
    "fp64, idle rank": (torch.float64, None),
    "fp64 vs fp32": (torch.float64, torch.float32),
    "bf16 vs fp16": (torch.bfloat16, torch.float16),
    "all idle": (None, None),
    "fp64, idle, dtype given": (torch.float64, None),
}


def _loss_worker(rank: int, world: int) -> dict:
    out = {}
    for name, mine0, mine1, dtype, _ in LOSS_CASES:
        values = (mine0, mine1)[rank]
        loss_dtype = LOSS_DTYPES[name][rank]
        losses = [torch.tensor(v, dtype=loss_dtype) for v in values]
        kwargs = {} if dtype is None else {"dtype": dtype}
        total = reduce_loss(losses, **kwargs)
        out[name] = (total.dtype, total.item())
    # A loss reduce_loss cannot sum (an integer count) on one rank: every rank raises the same
    # ValueError after the all-reduce, none waits for a peer that left.
    try:
        reduce_loss([torch.tensor(3)] if rank == 0 else [torch.tensor(0.5)])
    except ValueError as exc:
        out["refused"] = str(exc)
    # ...and the group still works afterwards (nobody is stuck in a collective).
    out["after"] = reduce_loss([torch.tensor(1.0, dtype=torch.float64)]).item()
    return out


@pytest.mark.timeout(120)
def test_reduce_loss_agrees_on_one_buffer_whatever_the_dtypes() -> None:
    results = run_gloo(_loss_worker, world=WORLD, timeout=90, pg_timeout=20)
    for name, mine0, mine1, _, want in LOSS_CASES:
        exact = sum(sum(v) for v in mine0) + sum(sum(v) for v in mine1)
        for rank, r in enumerate(results):
            got_dtype, value = r[name]
            assert got_dtype == want, (name, rank, got_dtype)
            assert value == pytest.approx(exact, rel=1e-12, abs=0), (name, rank, value)
    assert "1 loss(es)" in results[0]["refused"] and "torch.int64" in results[0]["refused"]
    assert "1 loss(es)" in results[1]["refused"]
    assert all(r["after"] == pytest.approx(2.0) for r in results)


def test_reduce_loss_refuses_a_non_float_dtype_argument() -> None:
    with pytest.raises(ValueError, match="floating-point torch.dtype"):
        reduce_loss([], dtype=torch.int64)


# --- DDPRunner: frozen parameters stay frozen ---------------------------------------------------


def _plans() -> list[StepPlan]:
    mb, topo = MicroBatch, Topology(WORLD, WORLD, 256)
    idle_step = (Wave((Group(0, 1, (mb((0, 1)), mb((2,)), mb((3, 4)))),)),)  # rank 1 runs nothing
    mixed = (
        Wave((Group(0, 2, (mb((1,)), mb((0, 4)))),)),
        Wave((Group(0, 1, (mb((2,)),)), Group(1, 1, (mb((3,)),)))),
    )
    return [
        StepPlan(topo, LENGTHS, idle_step, policy="hand"),
        StepPlan(topo, LENGTHS, mixed, policy="hand"),
    ]


def make_model() -> TinyDecoder:
    """The same weights in every process, fp64, with ``FROZEN`` frozen."""
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab=VOCAB)).to(torch.float64)
    for name, param in model.named_parameters():
        if name.startswith(FROZEN):
            param.requires_grad_(False)
    return model


def tokens_for(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randint(0, VOCAB, (s,), generator=gen) for s in LENGTHS]


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # Every parameter handed over, frozen ones too (what ``AdamW(model.parameters())`` does):
    # decoupled weight decay would move any of them that has a gradient, zero or not.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _ddp_worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from dyncp.integrations.ddp import DDPRunner

    pool = GroupPool()
    model = make_model()
    ddp = DistributedDataParallel(LossSum(model))
    runner = DDPRunner(ddp)
    opt = adamw(ddp)
    plans = _plans()
    frozen_grads = []
    for step in range(ADAM_STEPS):
        tokens = tokens_for(step)

        def step_fn(ctx: MicroBatchContext, tokens=tokens) -> None:
            packed = torch.cat([tokens[i] for i in ctx.seq_ids])
            microbatch_loss(ThroughDDP(ddp), ctx, packed).backward()

        runner.step(plans[step % len(plans)], pool, step_fn)
        frozen_grads.append(
            [n for n, p in model.named_parameters() if n.startswith(FROZEN) and p.grad is not None]
        )
        opt.step()
        opt.zero_grad()
    # reduce_gradients itself, on a bare model: frozen parameters are neither zero-filled nor
    # reduced, trainable ones without a gradient (this idle rank) are.
    bare = make_model()
    grads = reduce_gradients(bare)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "frozen_grads": frozen_grads,
        "reduced": sorted(grads),
        "bare_frozen_grads": [
            n for n, p in bare.named_parameters() if p.grad is not None and n.startswith(FROZEN)
        ],  # fmt: skip
        "world": dist.get_world_size(),
    }


def reference() -> dict[str, torch.Tensor]:
    """The same steps on one process: each global batch in one CP-1 micro-batch."""
    model = make_model()
    opt = adamw(model)
    for step in range(ADAM_STEPS):
        tokens = tokens_for(step)
        ctx = whole_batch_context(LENGTHS)
        microbatch_loss(model, ctx, torch.cat(tokens)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(180)
def test_ddp_runner_leaves_frozen_parameters_untouched_and_trainable_ones_exact() -> None:
    for plan in _plans():
        plan.validate()
    results = run_gloo(_ddp_worker, world=WORLD, timeout=150, pg_timeout=30)
    initial = dict(make_model().named_parameters())
    ref = reference()
    frozen = [n for n in initial if n.startswith(FROZEN)]
    assert frozen and len(frozen) < len(initial)
    for rank, r in enumerate(results):
        assert r["frozen_grads"] == [[]] * ADAM_STEPS, (rank, r["frozen_grads"])
        for name in frozen:  # bitwise: not one ulp of weight decay
            assert torch.equal(r["params"][name], initial[name].detach()), (rank, name)
        for name, want in ref.items():
            if name in frozen:
                continue
            moved = (want - initial[name]).abs().max().item()
            assert moved > 1e-4, name  # AdamW did move the trainable ones
            err = (r["params"][name] - want).abs().max().item()
            assert err <= 1e-9, (rank, name, err)
        assert r["reduced"] == sorted(n for n in initial if n not in frozen)
        assert r["bare_frozen_grads"] == []


# --- execute_local: what execute gives a one-rank pool, without torch.distributed -------------


def _one_rank_plan() -> StepPlan:
    from dyncp.cost_model import CostModel
    from dyncp.planner import Planner

    planner = Planner(
        CostModel.load("cpu-gloo", ranks_per_node=1),
        world=1,
        ranks_per_node=1,
        capacity=64,
        max_length=64,
        deterministic=True,
        cpsat=None,
    )
    plan = planner.plan([37, 64, 9, 23, 2, 50, 11])
    plan.sample_ids = (16, 10, 15, 11, 14, 12, 13)  # dataset rows, as the sampler sets them
    return plan


LABELS = [36, 10, 8, 22, 1, 0, 5]  # e.g. prompts masked out of the loss


def _contexts_worker(rank: int, world: int, plan_json: str) -> list:
    from dyncp.runtime import execute

    seen: list[MicroBatchContext] = []
    execute(StepPlan.from_json(plan_json), GroupPool(), seen.append, labels_per_sequence=LABELS)
    return seen


@pytest.mark.timeout(120)
def test_execute_local_gives_step_fn_what_execute_gives_on_one_rank() -> None:
    from dyncp.integrations.local import execute_local

    plan = _one_rank_plan()
    assert sum(len(g.microbatches) for w in plan.waves for g in w.groups) > 1
    (want,) = run_gloo(_contexts_worker, world=1, args=(plan.to_json(),), timeout=90)
    got: list[MicroBatchContext] = []
    report = execute_local(plan, got.append, labels_per_sequence=LABELS)
    assert got == want  # every field, the layout and the loss scale 1 / sum(LABELS) included
    assert got[0].loss_scale == 1.0 / sum(LABELS)
    assert len(report.timings) == len(got) and len(report.wave_seconds) == len(plan.waves)
