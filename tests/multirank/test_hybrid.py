"""A hybrid decoder (attention + SSM per layer, one sliding-window layer) trained through
``runtime.execute`` on 4 gloo ranks with plans mixing CP sizes 1, 2 and 4, with either SSM
exchange: summed gradients equal one process's in fp64 (within 1e-9 relative) and so does the
loss."""

from __future__ import annotations

import pytest
import torch

from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.ring_attention import make_ring_layout, zigzag_positions
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.testing import microbatch_loss, next_token_labels
from dyncp.testing.distributed import run_gloo
from dyncp.testing.hybrid_model import HybridConfig, HybridDecoder

CFG = HybridConfig()
WORLD = 4


def make_model(exchange: str = "state") -> HybridDecoder:
    torch.manual_seed(0)
    return HybridDecoder(HybridConfig(ssm_exchange=exchange)).double()


def tokens_for(lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (s,), generator=gen) for s in lengths]


def plans() -> list[StepPlan]:
    """CP 4; then a ring of 2 beside two single ranks; and a step of two rings of 2."""
    mb = MicroBatch
    first = StepPlan(
        Topology(WORLD, 2, 256),
        (37, 150, 9, 64, 23, 1, 2, 88),
        (
            Wave((Group(0, 4, (mb((1,)), mb((7,)))),)),
            Wave((Group(0, 2, (mb((3, 4)),)), Group(2, 1, (mb((0,)), mb((2,)))),
                  Group(3, 1, (mb((5, 6)),)))),
        ),
        policy="hand",
    )  # fmt: skip
    second = StepPlan(
        Topology(WORLD, 2, 256),
        (120, 7, 33, 60),
        (Wave((Group(0, 2, (mb((0, 1)),)), Group(2, 2, (mb((2,)), mb((3,)))))),),
        policy="hand",
    )
    return [first, second]


def reference(plan: StepPlan, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = make_model()
    lengths = list(plan.lengths)
    tokens = torch.cat(tokens_for(lengths, seed))
    labels = next_token_labels(tokens, lengths)
    layout = make_ring_layout(seqlens=lengths, cp=1)
    positions = zigzag_positions(seqlens=lengths, cp=1, rank=0)
    loss = model.loss_sum(tokens, labels, positions, layout) / sum(s - 1 for s in lengths)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, cases: list[tuple[str, int, str]]) -> list:
    pool = GroupPool()
    out = []
    for plan_json, seed, exchange in cases:
        plan = StepPlan.from_json(plan_json)
        model = make_model(exchange)
        tokens = tokens_for(list(plan.lengths), seed)
        losses = []

        def step_fn(ctx, model=model, tokens=tokens, losses=losses) -> None:
            loss = microbatch_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
            loss.backward()
            losses.append(loss.detach())

        execute(plan, pool, step_fn)
        grads = reduce_gradients(model)
        loss = reduce_loss(losses, dtype=torch.float64)
        out.append((loss.item(), grads))
    return out


@pytest.mark.timeout(180)
def test_hybrid_gradients_equal_single_process() -> None:
    # Both SSM exchanges; the reference is the same model on one process (no exchange at all).
    runs = [(p, seed, ex) for ex in ("state", "all_to_all")
            for seed, p in enumerate(plans(), start=1)]  # fmt: skip
    cases = [(p.to_json(), seed, ex) for p, seed, ex in runs]
    results = run_gloo(_worker, world=WORLD, args=(cases,), timeout=160)
    for c, (plan, seed, _) in enumerate(runs):
        ref_loss, ref_grads = reference(plan, seed)
        for rank in range(WORLD):
            loss, grads = results[rank][c]
            assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0)
            for name, ref in ref_grads.items():
                err = (grads[name] - ref).abs().max().item()
                assert err <= 1e-9 * max(1.0, ref.abs().max().item()), (c, name, err)


def test_window_changes_the_model() -> None:
    # The windowed layer really is windowed: without it the loss differs.
    lengths = [40, 30]
    tokens = torch.cat(tokens_for(lengths, 0))
    labels = next_token_labels(tokens, lengths)
    layout = make_ring_layout(seqlens=lengths, cp=1)
    positions = zigzag_positions(seqlens=lengths, cp=1, rank=0)
    with_window = make_model().loss_sum(tokens, labels, positions, layout)
    torch.manual_seed(0)
    plain = HybridDecoder(HybridConfig(window_layers=())).double()
    assert plain.loss_sum(tokens, labels, positions, layout).item() != with_window.item()


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="window_layers"):
        HybridConfig(window_layers=(3,))
    with pytest.raises(ValueError, match="ssm_exchange"):
        HybridConfig(ssm_exchange="ring")
