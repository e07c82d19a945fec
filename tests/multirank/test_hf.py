"""Hugging Face causal LMs under dynamic CP: loss and gradients equal the one-process model's.

Two families with GQA and RoPE (Llama; Qwen3, which adds per-head q/k norms, also with its
second layer in a sliding window), built from tiny configs in fp64, train one step on 4 gloo
ranks with dyncp's ring attention registered as their attention implementation, under plans
that mix CP 1, 2 and 4 in one step. The reference is the same model (same weights) on one
process with transformers' own SDPA attention, each document run on its own as an unpacked
batch of one, with left-to-right labels: loss within 1e-12 and gradients within 1e-9 (relative
to the largest gradient of each parameter).

Transformers' *eager* attention is not the reference because it computes the softmax in fp32
(``softmax(..., dtype=torch.float32)``) even for fp64 inputs: it differs from exact attention by
~1e-7 relative in the gradients, which docs/guides/huggingface.md reports beside the SDPA
figures.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.integrations.hf import (  # noqa: E402
    causal_lm_loss,
    plan_check,
    register_ring_attention,
    shard_inputs,
    windowed_layers,
)
from dyncp.plan import Group, MicroBatch, PlanError, StepPlan, Topology, Wave  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.ring_attention import make_ring_layout  # noqa: E402
from dyncp.runtime import (  # noqa: E402
    GroupPool,
    MicroBatchContext,
    StepFailed,
    execute,
    reduce_gradients,
    reduce_loss,
)
from dyncp.testing import next_token_labels  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402
from dyncp.testing.hf_models import FAMILIES, tiny_causal_lm, tiny_config  # noqa: E402

WORLD = 4
VOCAB = 61


#: Qwen3 with its second layer attending within a sliding window shorter than most documents.
WINDOWED = "qwen3-window"
WINDOW = 16


def make_model(family: str, attn: str) -> torch.nn.Module:
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 8), same weights every call."""
    if family == WINDOWED:
        return tiny_causal_lm(tiny_config("qwen3", vocab=VOCAB, sliding_window=WINDOW), attn)
    return tiny_causal_lm(tiny_config(family, vocab=VOCAB), attn)


def tokens_for(lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (s,), generator=gen) for s in lengths]


def hand_plan() -> StepPlan:
    """CP 4, then a ring of 2 beside two single ranks, in one step."""
    lengths = (37, 90, 9, 44, 23, 1, 2, 51)
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
    return StepPlan(Topology(WORLD, 2, 256), lengths, waves, policy="hand")


def planned(seed: int) -> StepPlan:
    """A dyncp plan of a random batch whose longest sequence needs a ring (capacity 32)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, size=9)
    lengths[0] = 100
    model = CostModel.load("h100-reference", ranks_per_node=2)
    planner = Planner(
        model,
        world=WORLD,
        ranks_per_node=2,
        capacity=32,
        max_length=100,
        deterministic=True,
        cpsat=None,
    )
    return planner.plan(lengths)


PLANS = {"hand": (hand_plan(), 1), "planned": (planned(3), 3)}
CASES = [(family, plan) for family in FAMILIES for plan in PLANS] + [(WINDOWED, "hand")]


def _train_worker(rank: int, world: int, cases: list[tuple[str, str, int]]) -> list:
    name = register_ring_attention()
    pool = GroupPool()
    out = []
    for family, plan_json, seed in cases:
        plan = StepPlan.from_json(plan_json)
        model = make_model(family, name)
        tokens = tokens_for(plan.lengths, seed)
        losses = []

        def step_fn(ctx, model=model, tokens=tokens, losses=losses) -> None:
            packed = torch.cat([tokens[i] for i in ctx.seq_ids])
            loss = causal_lm_loss(model, ctx, packed, kernel="math")
            loss.backward()
            losses.append(loss.detach())

        report = execute(plan, pool, step_fn)
        grads = reduce_gradients(model)
        loss = reduce_loss(losses, dtype=torch.float64)
        out.append((loss.item(), grads, sorted({c for _, c, _ in report.microbatches})))
    return out


def document_loss_sum(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one document run alone (batch of one, no packing), in fp64.

    (The model's ``labels=`` loss would shift the same way but casts the logits to fp32.)
    """
    logits = model(input_ids=tokens[None], use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum")


def reference(family: str, plan: StepPlan, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean token loss and gradients with transformers' SDPA, one unpacked document at a time."""
    model = make_model(family, "sdpa")
    total = sum(s - 1 for s in plan.lengths)
    loss = sum(document_loss_sum(model, t) for t in tokens_for(plan.lengths, seed)) / total
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ring_results() -> dict[tuple[str, str], tuple]:
    cases = [(f, PLANS[p][0].to_json(), PLANS[p][1]) for f, p in CASES]
    results = run_gloo(_train_worker, world=WORLD, args=(cases,), timeout=240)
    return {case: [results[r][c] for r in range(WORLD)] for c, case in enumerate(CASES)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,plan_name", CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_loss_and_gradients_equal_single_process(
    ring_results: dict, family: str, plan_name: str
) -> None:
    plan, seed = PLANS[plan_name]
    sizes = {g.size for w in plan.waves for g in w.groups}
    assert sizes == {1, 2, 4}, sizes  # CP 1, 2 and 4 in one step
    ref_loss, ref_grads = reference(family, plan, seed)
    if family == WINDOWED:  # the window changes the model: the reference is not full attention
        assert max(plan.lengths) > WINDOW
        assert ref_loss != pytest.approx(reference("qwen3", plan, seed)[0], rel=1e-6)
    for loss, grads, ran in ring_results[(family, plan_name)]:
        assert ran  # every rank ran micro-batches
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0)
        for name, ref in ref_grads.items():
            assert ref.abs().max() > 0, name  # every parameter is trained
            err = (grads[name] - ref).abs().max().item()
            assert err <= 1e-9 * ref.abs().max().item(), (family, plan_name, name, err)


def _context(lengths: tuple[int, ...]) -> MicroBatchContext:
    layout = make_ring_layout(seqlens=lengths, cp=1)
    return MicroBatchContext(0, 0, 1, 0, tuple(range(len(lengths))), None, lengths, layout, 1.0)


def test_cp1_matches_and_shifted_labels_stay_in_their_sequence() -> None:
    """One process, CP 1: the packed ring forward equals per-document SDPA, and the shifted
    labels never cross a document boundary (the last token of each document has none)."""
    lengths = (5, 1, 7)
    ctx = _context(lengths)
    packed = torch.cat(tokens_for(lengths, 0))
    inputs = shard_inputs(ctx, packed)
    assert inputs["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]
    assert inputs["labels"][0].tolist() == next_token_labels(packed, lengths).tolist()
    assert inputs["labels"][0, [4, 5, 12]].tolist() == [-100, -100, -100]
    model = make_model("llama", register_ring_attention())
    loss = causal_lm_loss(model, ctx, packed, kernel="math")
    ref = make_model("llama", "sdpa")
    expected = sum(document_loss_sum(ref, t) for t in tokens_for(lengths, 0))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_bad_use_is_refused_with_a_clear_error() -> None:
    lengths = (4, 3)
    ctx = _context(lengths)
    packed = torch.cat(tokens_for(lengths, 0))
    name = register_ring_attention()
    ring = make_model("llama", name)
    with pytest.raises(ValueError, match="ring_layout=ctx.layout"):
        ring(input_ids=packed[None], use_cache=False)
    with pytest.raises(ValueError, match="batch dim 1"):
        ring(input_ids=packed.view(1, -1).repeat(2, 1), use_cache=False, ring_layout=ctx.layout)
    with pytest.raises(ValueError, match="attention implementation is 'sdpa'"):
        causal_lm_loss(make_model("llama", "sdpa"), ctx, packed)
    with pytest.raises(ValueError, match="7 tokens"):
        causal_lm_loss(ring, ctx, packed[:5])
    with pytest.raises(ValueError, match="already registered"):
        register_ring_attention("sdpa")


@pytest.mark.parametrize("family", ["llama", WINDOWED])
def test_a_padding_mask_is_refused_before_any_layer(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transformers builds no mask for an attention it has no mask function for, so a padding
    mask would be dropped (logits as without it); dyncp registers one that refuses it, before
    the first layer attends. An all-ones mask masks nothing and gives the unmasked logits."""
    lengths = (4, 3)
    ctx = _context(lengths)
    inputs = shard_inputs(ctx, torch.cat(tokens_for(lengths, 0)))
    del inputs["labels"]
    ring = make_model(family, register_ring_attention())
    plain = ring(**inputs, use_cache=False, ring_layout=ctx.layout).logits
    ones = torch.ones_like(inputs["input_ids"])
    same = ring(**inputs, attention_mask=ones, use_cache=False, ring_layout=ctx.layout).logits
    assert torch.equal(same, plain)
    padded = ones.clone()
    padded[0, -2:] = 0

    def no_layer(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a layer attended before the mask was refused")

    monkeypatch.setattr("dyncp.integrations.hf.ring_attention", no_layer)
    with pytest.raises(ValueError, match=r"no padding mask.*masks out 2 position"):
        ring(**inputs, attention_mask=padded, use_cache=False, ring_layout=ctx.layout)


def split_plan() -> StepPlan:
    """One wave: all 4 ranks as heads 2 x ring 2 (the tiny models have 4 query, 2 KV heads)."""
    topo = Topology(WORLD, 2, 256, (1, 2, 4), (1, 2), 4, 2)
    return StepPlan(topo, (37, 90), (Wave((Group(0, 4, (MicroBatch((0, 1)),), heads=2),)),))


def _split_window_worker(rank: int, world: int, plan_json: str) -> dict:
    plan = StepPlan.from_json(plan_json)
    pool = GroupPool(head_sizes=(1, 2))
    model = make_model(WINDOWED, register_ring_attention())
    tokens = tokens_for(plan.lengths, 0)
    calls = {"step_fn": 0, "forward": 0}
    model.register_forward_pre_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))

    def step_fn(ctx) -> None:
        calls["step_fn"] += 1
        causal_lm_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]), kernel="math")

    out = {}
    try:
        execute(plan, pool, step_fn, plan_check=plan_check(model))
    except PlanError as exc:
        out["checked"] = (exc.rule, str(exc), dict(calls))
    try:  # without the check, causal_lm_loss refuses before the model's forward
        execute(plan, pool, step_fn)
    except StepFailed as exc:
        out["unchecked"] = (str(exc), dict(calls))
    return out


@pytest.mark.timeout(200)
def test_head_split_with_a_windowed_layer_is_refused_before_any_collective() -> None:
    """Ring attention's windowed path runs on plain rings only. Given ``plan_check(model)``,
    ``execute`` refuses a head-split plan on every rank before any micro-batch runs; without
    it, ``causal_lm_loss`` refuses it on every rank of the group before the model's forward
    (so before the first layer's all-to-all), and the step fails on every rank."""
    plan = split_plan()
    plan.validate()
    assert windowed_layers(make_model(WINDOWED, "sdpa")) == ["model.layers.1.self_attn"]
    assert windowed_layers(make_model("qwen3", "sdpa")) == []
    plan_check(make_model("llama", "sdpa"))(plan)  # no window: head splits are fine
    results = run_gloo(_split_window_worker, world=WORLD, args=(plan.to_json(),), timeout=150)
    for r in range(WORLD):
        rule, message, calls = results[r]["checked"]
        assert rule == "head-split-window" and "heads 2 x ring 2" in message, message
        assert calls == {"step_fn": 0, "forward": 0}
        message, calls = results[r]["unchecked"]
        assert "sliding-window layers" in message, message
        assert calls == {"step_fn": 1, "forward": 0}
