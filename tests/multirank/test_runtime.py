"""End-to-end runtime tests on 4 spawned gloo ranks: dynamic CP trains exactly the same model.

For several global batches planned with mixed CP sizes (1, 2 and 4 in one step), with a static
plan, and with a hand-written plan, the gradients summed over the ranks equal the gradients of
the same batch on one process in fp64 (within 1e-9), and so does the loss (1e-12 relative).
Wrong plans are refused before any collective; a failing step_fn fails every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dyncp.cost_model import CostModel
from dyncp.plan import Group, MicroBatch, PlanError, StepPlan, Topology, Wave
from dyncp.plan.slice import own_slice
from dyncp.planner import Planner
from dyncp.ring_attention import make_ring_layout, zigzag_positions
from dyncp.runtime import GroupPool, StepFailed, execute, reduce_gradients, reduce_loss
from dyncp.testing import TinyConfig, TinyDecoder, microbatch_loss, next_token_labels
from dyncp.testing.distributed import SpawnError, run_gloo

CFG = TinyConfig()
WORLD = 4


def make_model() -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(CFG).double()


def tokens_for(lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (s,), generator=gen) for s in lengths]


def hand_plan() -> StepPlan:
    """CP 4, then a ring of 2 beside two single ranks, in one step."""
    lengths = (37, 150, 9, 64, 23, 1, 2, 88)
    topo = Topology(WORLD, 2, 256)
    mb = MicroBatch
    waves = (
        Wave((Group(0, 4, (mb((1,)), mb((7,)))),)),
        Wave(
            (
                Group(0, 2, (mb((3, 4)),)),
                Group(2, 1, (mb((0,)), mb((2,)))),
                Group(3, 1, (mb((5, 6)),)),
            )
        ),
    )
    return StepPlan(topo, lengths, waves, policy="hand")


def planned(policy: str, seed: int) -> StepPlan:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 150, size=int(rng.integers(6, 14)))
    lengths[0] = 150  # needs a ring at capacity 48
    model = CostModel.load("h100-reference", ranks_per_node=2)
    planner = Planner(
        model,
        world=WORLD,
        ranks_per_node=2,
        capacity=48,
        policy=policy,
        max_length=150,
        deterministic=True,
        cpsat=None,
    )
    return planner.plan(lengths)


def reference(plan: StepPlan, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole global batch on one process (CP 1)."""
    model = make_model()
    lengths = list(plan.lengths)
    tokens = torch.cat(tokens_for(lengths, seed))
    labels = next_token_labels(tokens, lengths)
    layout = make_ring_layout(seqlens=lengths, cp=1)
    positions = zigzag_positions(seqlens=lengths, cp=1, rank=0)
    total = sum(s - 1 for s in lengths)
    loss = model.loss_sum(tokens, labels, positions, layout) / total
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _train_worker(rank: int, world: int, cases: list[tuple[str, int, bool]]) -> list:
    pool = GroupPool()
    out = []
    for plan_json, seed, sliced in cases:
        plan = StepPlan.from_json(plan_json)
        tokens = tokens_for(list(plan.lengths), seed)
        if sliced:  # what a rank reads from a plan service publishing slices
            plan = own_slice(plan, rank)
        model = make_model()
        losses = []

        def step_fn(ctx, model=model, tokens=tokens, losses=losses) -> None:
            loss = microbatch_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
            loss.backward()
            losses.append(loss.detach())

        report = execute(plan, pool, step_fn)
        grads = reduce_gradients(model)
        loss = reduce_loss(losses, dtype=torch.float64)
        out.append(
            (
                loss.item(),
                grads,
                len(report.microbatches),
                sorted({c for _, c, _ in report.microbatches}),
            )
        )
    return out


@pytest.mark.timeout(270)
def test_gradients_equal_single_process() -> None:
    plans = [(hand_plan(), 1)]
    plans += [(planned("dyncp", seed), seed) for seed in (2, 3, 4)]
    plans += [(planned("static", 5), 5)]
    mixed = [sorted({g.size for w in p.waves for g in w.groups}) for p, _ in plans]
    assert any({1, 2, 4} <= set(m) for m in mixed), mixed  # CP 1, 2 and 4 in one step
    assert len(mixed[-1]) == 1 and mixed[-1][0] > 1  # static: one ring size for everything
    plans.append((hand_plan(), 1))  # again, each rank running its slice of it
    cases = [(p.to_json(), seed, c == len(plans) - 1) for c, (p, seed) in enumerate(plans)]
    results = run_gloo(_train_worker, world=WORLD, args=(cases,), timeout=240)
    for c, (plan, seed) in enumerate(plans):
        ref_loss, ref_grads = reference(plan, seed)
        for rank in range(WORLD):
            loss, grads, _, _ = results[rank][c]
            assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0)
            for name, ref in ref_grads.items():
                err = (grads[name] - ref).abs().max().item()
                assert err <= 1e-9 * max(1.0, ref.abs().max().item()), (plan.policy, name, err)
        # every micro-batch was run by every rank of its group
        expected = sum(len(g.microbatches) * g.size for w in plan.waves for g in w.groups)
        assert sum(results[r][c][2] for r in range(WORLD)) == expected


def _refuse_worker(rank: int, world: int, plans: list[str], sizes: tuple[int, ...]) -> list[str]:
    pool = GroupPool(group_sizes=sizes)
    called = []
    messages = []
    for plan_json in plans:
        plan = StepPlan.from_json(plan_json)
        try:
            execute(plan, pool, lambda ctx: called.append(ctx))
        except PlanError as exc:
            messages.append(f"{exc.rule}: {exc}")
    assert not called
    dist.barrier()  # still in step: nobody hung in a collective
    return messages


@pytest.mark.timeout(150)
def test_wrong_plans_refused_before_any_collective() -> None:
    good = hand_plan()
    missing = StepPlan(good.topology, (*good.lengths, 5), good.waves)  # sequence 8 never runs
    results = run_gloo(
        _refuse_worker, world=WORLD, args=([missing.to_json(), good.to_json()], (1, 2)), timeout=120
    )
    for messages in results:
        assert messages[0].startswith("exactly-once") and "[8]" in messages[0]
        assert messages[1].startswith("group-pool") and "[0, 1, 2, 3]" in messages[1]


def _fail_worker(
    rank: int, world: int, plan_json: str, bad_rank: int, bad_wave: int
) -> tuple[str, list]:
    pool = GroupPool()
    plan = StepPlan.from_json(plan_json)

    def step_fn(ctx) -> None:
        if rank == bad_rank and ctx.step_wave == bad_wave:
            raise ValueError("boom from the user's step")
        model = make_model()
        tokens = torch.zeros(sum(ctx.seqlens), dtype=torch.long)
        model.loss_sum(
            ctx.shard(tokens), ctx.shard(tokens, pad_value=-100), ctx.positions(), ctx.layout
        ).backward()

    try:
        execute(plan, pool, step_fn)
        reduce_loss([torch.zeros((), dtype=torch.float64)], pool=pool)  # where every rank meets
    except StepFailed as exc:
        return str(exc), list(exc.ranks)
    return "no error", []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("bad_rank,bad_wave", [(3, 1), (1, 1)], ids=["single-rank", "ring-peer"])
def test_failing_step_fails_every_rank(bad_rank: int, bad_wave: int) -> None:
    # (1, 1): rank 1's ring peer (rank 0) blocks on it and is released by the gloo timeout.
    results = run_gloo(
        _fail_worker,
        world=WORLD,
        args=(hand_plan().to_json(), bad_rank, bad_wave),
        timeout=120,
        pg_timeout=8,
    )
    # Every rank raised StepFailed (anything else fails run_gloo) naming the failing rank and
    # carrying its error: the ring peer blocked on it in execute, the others (dataflow: no
    # barrier between waves) at the reduction after it.
    for message, ranks in results:
        assert f"rank {bad_rank} failed in wave {bad_wave}" in message, message
        assert "ValueError: boom from the user's step" in message, message
        assert ranks == [bad_rank]


@pytest.mark.timeout(90)
def test_spawn_error_reports_the_rank() -> None:
    with pytest.raises(SpawnError, match="rank 1 raised"):
        run_gloo(_raise_on_one, world=2, timeout=60)


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("deliberate")


def _subset_pool(rank: int, world: int) -> tuple:
    pool = GroupPool(ranks=[0, 1])  # every rank of the job builds it; ranks 2 and 3 are off it
    return pool.position, pool.store is not None


@pytest.mark.timeout(150)
def test_a_pool_over_part_of_the_job_builds_on_every_rank() -> None:
    results = run_gloo(_subset_pool, world=WORLD, timeout=120)
    assert results == [(0, True), (1, True), (None, False), (None, False)]
