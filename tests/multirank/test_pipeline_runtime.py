"""The pipeline runtime on spawned gloo processes: pipelined dynamic CP trains exactly the model.

Hand-written pipelined plans (slots mixing CP 1, 2 and 4, a column idle in some slots) run on
PP 2 x DP-CP 2 (4 processes) and PP 2 x DP-CP 4 (8 processes), under 1F1B and interleaved 1F1B
with 2 virtual stages (at 8, one slot's CP-4 group split 2 heads x ring 2); the loss equals one
process on the whole batch within 1e-12 and every gradient within 1e-9 of its scale, in fp64.
A stage that raises is named on every process; wrong plans are refused on every process before
any transfer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dyncp.plan import Group, MicroBatch, Pipeline, PlanError, StepPlan, Topology, Wave
from dyncp.ring_attention import make_ring_layout, zigzag_positions
from dyncp.runtime import (
    Activation,
    PipelineGroups,
    PipelineLayout,
    StepFailed,
    execute_pipeline,
    reduce_pipeline_loss,
    reduce_stage_gradients,
)
from dyncp.testing import TinyConfig, TinyDecoder, next_token_labels, tiny_chunks
from dyncp.testing.distributed import run_gloo

CFG = TinyConfig(layers=4)
TIMEOUT = 20.0  # the groups' timeout: a hang becomes an error well inside the test's limit


def make_model() -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(CFG).double()


def tokens_for(lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (s,), generator=gen) for s in lengths]


def _mb(*ids: int) -> tuple[MicroBatch, ...]:
    return (MicroBatch(ids),)


def plan_two_columns(pipeline: Pipeline) -> StepPlan:
    """2 columns, 4 slots: CP 2, two CP 1, CP 1 beside an idle column, CP 2."""
    lengths = (61, 17, 9, 33, 40, 26, 5)
    waves = (
        Wave((Group(0, 2, _mb(0)),)),
        Wave((Group(0, 1, _mb(1, 2)), Group(1, 1, _mb(3)))),
        Wave((Group(0, 1, _mb(4)),)),  # column 1 idle
        Wave((Group(0, 2, _mb(5, 6)),)),
    )
    plan = StepPlan(Topology(2, 2, 64, (1, 2)), lengths, waves, policy="hand", pipeline=pipeline)
    plan.validate()
    return plan


def plan_four_columns(pipeline: Pipeline, slots: int) -> StepPlan:
    """4 columns: CP 4, CP 2 + CP 1 (column 3 idle), CP 1 x 2 + CP 2, two CP 2 [, CP 4]."""
    lengths = (120, 50, 20, 14, 31, 8, 22, 19, 44, 27, 90)
    waves = [
        Wave((Group(0, 4, _mb(0)),)),
        Wave((Group(0, 2, _mb(1)), Group(2, 1, _mb(2, 3)))),
        Wave((Group(0, 1, _mb(4)), Group(1, 1, _mb(5)), Group(2, 2, _mb(6, 7)))),
        Wave((Group(0, 2, _mb(8)), Group(2, 2, _mb(9)))),
        Wave((Group(0, 4, _mb(10)),)),
    ]
    if slots == 4:  # the last sequence joins slot 0's group, split 2 heads x ring 2
        waves[0] = Wave((Group(0, 4, (MicroBatch((0, 10)),), heads=2),))
    plan = StepPlan(
        Topology(4, 4, 64, (1, 2, 4), (1, 2), CFG.heads, CFG.kv_heads),
        lengths,
        tuple(waves[:slots]),
        policy="hand",
        pipeline=pipeline,
    )
    plan.validate()
    return plan


def reference(plan: StepPlan, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole global batch on one process (CP 1, no pipeline)."""
    model = make_model()
    lengths = list(plan.lengths)
    tokens = torch.cat(tokens_for(plan.lengths, seed))
    labels = next_token_labels(tokens, lengths)
    layout = make_ring_layout(seqlens=lengths, cp=1)
    positions = zigzag_positions(seqlens=lengths, cp=1, rank=0)
    loss = model.loss_sum(tokens, labels, positions, layout) / sum(s - 1 for s in lengths)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _train_worker(rank: int, world: int, columns: int, cases: list[tuple[str, int]]) -> list:
    heads = (1, 2) if columns == 4 else (1,)
    groups = PipelineGroups(
        PipelineLayout(stages=2, columns=columns), head_sizes=heads, timeout=TIMEOUT
    )
    out = []
    for plan_json, seed in cases:
        plan = StepPlan.from_json(plan_json)
        tokens = tokens_for(plan.lengths, seed)
        model = make_model()
        names = {id(p): n for n, p in model.named_parameters()}
        chunks = tiny_chunks(
            model,
            plan.pipeline,
            groups.stage,
            lambda ctx, tokens=tokens: torch.cat([tokens[i] for i in ctx.seq_ids]),
        )
        report = execute_pipeline(
            plan, groups, chunks, activation=Activation(hidden=CFG.dim, dtype=torch.float64)
        )
        reduce_stage_gradients(chunks, groups)
        loss = reduce_pipeline_loss(report.losses, groups, dtype=torch.float64)
        grads = {names[id(p)]: p.grad.clone() for c in chunks for p in c.parameters()}
        ops = [(o.kind, o.slot, o.chunk, o.start, o.end) for o in report.ops]
        out.append((groups.stage, groups.column, loss.item(), grads, ops))
    return out


def _check_exact(results: list, plans: list[tuple[StepPlan, int]]) -> None:
    for c, (plan, seed) in enumerate(plans):
        ref_loss, ref_grads = reference(plan, seed)
        covered = set()
        for per_rank in results:
            stage, column, loss, grads, ops = per_rank[c]
            assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0)
            for name, grad in grads.items():
                ref = ref_grads[name]
                err = (grad - ref).abs().max().item()
                assert err <= 1e-9 * max(1.0, ref.abs().max().item()), (plan.pipeline, name, err)
                covered.add(name)
            # the measured timeline: every operation of a busy slot, in order, times increasing
            busy = [j for j, w in enumerate(plan.waves) if any(column in g.ranks for g in w.groups)]
            assert {o[1] for o in ops} == set(busy)
            assert len(ops) == 2 * plan.pipeline.virtual * len(busy)
            assert all(0 <= s <= e for *_, s, e in ops)
            assert all(a[4] <= b[3] for a, b in zip(ops, ops[1:]))
        assert covered == set(ref_grads)  # the stages' chunks hold the whole model


@pytest.mark.timeout(300)
def test_pp2_x_two_columns_1f1b_and_interleaved_equal_one_process() -> None:
    plans = [(plan_two_columns(Pipeline(2)), 1), (plan_two_columns(Pipeline(2, 2)), 2)]
    cases = [(p.to_json(), seed) for p, seed in plans]
    results = run_gloo(_train_worker, world=4, args=(2, cases), timeout=280)
    _check_exact(results, plans)


@pytest.mark.timeout(400)
def test_pp2_x_four_columns_1f1b_and_interleaved_equal_one_process() -> None:
    plans = [(plan_four_columns(Pipeline(2), 5), 3), (plan_four_columns(Pipeline(2, 2), 4), 4)]
    sizes = {(g.size, g.heads) for p, _ in plans for w in p.waves for g in w.groups}
    assert sizes == {(1, 1), (2, 1), (4, 1), (4, 2)}
    cases = [(p.to_json(), seed) for p, seed in plans]
    results = run_gloo(_train_worker, world=8, args=(4, cases), timeout=380)
    _check_exact(results, plans)


def _fail_worker(rank: int, world: int, plan_json: str, bad: tuple[int, str, int]) -> tuple:
    groups = PipelineGroups(PipelineLayout(stages=2, columns=2), timeout=5.0)
    plan = StepPlan.from_json(plan_json)
    tokens = tokens_for(plan.lengths, 0)
    packed = lambda ctx: torch.cat([tokens[i] for i in ctx.seq_ids])  # noqa: E731
    chunks = tiny_chunks(make_model(), plan.pipeline, groups.stage, packed)
    bad_rank, kind, bad_slot = bad
    real = chunks[0].forward

    def forward(x, ctx):
        if rank == bad_rank and ctx.step_wave == bad_slot:
            raise ValueError("boom from the user's stage")
        return real(x, ctx)

    chunks[0].forward = forward  # type: ignore[method-assign]
    try:
        execute_pipeline(
            plan, groups, chunks, activation=Activation(hidden=CFG.dim, dtype=torch.float64)
        )
        reduce_stage_gradients(chunks, groups)
    except StepFailed as exc:
        return str(exc), list(exc.ranks)
    return "no error", []


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("bad_rank", "slot", "where"),
    [(2, 1, "stage 1 column 0, forward of slot 1"), (1, 3, "stage 0 column 1, forward of slot 3")],
    ids=["next-stage", "ring-peer"],
)
def test_a_failing_stage_is_named_by_every_process(bad_rank: int, slot: int, where: str) -> None:
    # next-stage: rank 2 (stage 1, column 0) fails at CP 1; stage 0 waits for its gradient.
    # ring-peer: rank 1 (stage 0, column 1) fails before slot 3's CP-2 ring with rank 0.
    plan = plan_two_columns(Pipeline(2))
    results = run_gloo(
        _fail_worker, world=4, args=(plan.to_json(), (bad_rank, "F", slot)), timeout=180
    )
    for message, ranks in results:
        assert ranks == [bad_rank], message
        assert where in message and "boom" in message, message


def _refuse_worker(rank: int, world: int, plans: list[str]) -> list[str]:
    groups = PipelineGroups(PipelineLayout(stages=2, columns=2), group_sizes=(1,), timeout=10.0)
    messages = []
    for i, plan_json in enumerate(plans):
        plan = StepPlan.from_json(plan_json)
        pipe = plan.pipeline or Pipeline(2)
        chunks = [lambda x, ctx: pytest.fail("a refused plan ran a chunk")] * pipe.virtual
        if i == len(plans) - 1:
            chunks = chunks * 2  # one chunk too many
        try:
            execute_pipeline(plan, groups, chunks, activation=Activation(hidden=CFG.dim))
        except (ValueError, PlanError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    torch.distributed.barrier()  # still in step: nobody hung in a collective
    return messages


@pytest.mark.timeout(150)
def test_wrong_plans_are_refused_on_every_process_before_any_transfer() -> None:
    good = plan_two_columns(Pipeline(2))
    unpipelined = dataclasses.replace(good, pipeline=None)
    four = dataclasses.replace(good, pipeline=Pipeline(4))
    three_slots = dataclasses.replace(
        good, lengths=good.lengths[:5], waves=good.waves[:3], pipeline=Pipeline(2, 2)
    )
    plans = [unpipelined, four, good, three_slots, good]
    results = run_gloo(_refuse_worker, world=4, args=([p.to_json() for p in plans],), timeout=120)
    for messages in results:
        assert len(messages) == len(plans), messages
        assert "no pipeline stages: run it with execute()" in messages[0]
        assert "the plan runs 4 stages x 2 columns; the grid is 2 stages x 2 columns" in messages[1]
        assert messages[2].startswith("PlanError") and "did not build (sizes [1]" in messages[2]
        assert "multiple of 2; the plan has 3 slots" in messages[3]
        assert "1 model chunk(s) (virtual stages); 2 given" in messages[4]
