"""How exactly a transformers causal LM trains under dynamic CP: measured loss and gradient errors.

    python bench/hf_exactness.py            # 4 gloo processes on CPU, fp64, about a minute

For each model family (tiny Llama and Qwen3, GQA + RoPE; Qwen3 also with its second layer in a
16-token sliding window) and each plan (a hand-written one and
dyncp plans of random batches, each mixing CP sizes in one step, and a static CP 4 plan), the
step runs on 4 gloo ranks with dyncp's ring attention as the model's attention implementation
(``dyncp.integrations.hf``); the gradients are summed over the ranks. The reference is the same
model on one process, each document run alone, with transformers' SDPA attention and with its
eager attention. Printed per case: the largest relative gradient error (max over parameters of
max |g - g_ref| / max |g_ref|) and the relative loss error, against both references. Eager
computes its softmax in fp32 even for fp64 inputs, so it is itself only ~1e-8 exact.
"""

from __future__ import annotations

import numpy as np
import torch

from dyncp.cost_model import CostModel
from dyncp.integrations.hf import causal_lm_loss, register_ring_attention
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner import Planner
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.testing.distributed import run_gloo
from dyncp.testing.hf_models import FAMILIES, tiny_causal_lm, tiny_config

WORLD = 4
VOCAB = 61


def tokens_for(lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (s,), generator=gen) for s in lengths]


def plans() -> dict[str, StepPlan]:
    mb = MicroBatch
    hand = StepPlan(
        Topology(WORLD, 2, 256),
        (37, 90, 9, 44, 23, 1, 2, 51),
        (
            Wave((Group(0, 4, (mb((1,)), mb((7,)))),)),
            Wave(
                (
                    Group(0, 2, (mb((3, 4)),)),
                    Group(2, 1, (mb((0,)), mb((2,)))),
                    Group(3, 1, (mb((5, 6)),)),
                )
            ),
        ),
        policy="hand",
    )
    out = {"hand": hand}
    model = CostModel.load("h100-reference", ranks_per_node=2)
    for policy, seeds in (("dyncp", (2, 3, 4, 5)), ("static", (6,))):
        planner = Planner(
            model,
            world=WORLD,
            ranks_per_node=2,
            capacity=32,
            max_length=100,
            policy=policy,
            deterministic=True,
            cpsat=None,
        )
        for seed in seeds:
            rng = np.random.default_rng(seed)
            lengths = rng.integers(1, 100, size=int(rng.integers(6, 14)))
            lengths[0] = 100
            out[f"{policy}-{seed}"] = planner.plan(lengths)
    return out


#: Qwen3 with its second layer attending within a window shorter than most documents.
WINDOWED = "qwen3-w16"


def make_model(family: str, attn: str) -> torch.nn.Module:
    if family == WINDOWED:
        return tiny_causal_lm(tiny_config("qwen3", vocab=VOCAB, sliding_window=16), attn)
    return tiny_causal_lm(tiny_config(family, vocab=VOCAB), attn)


def _worker(rank: int, world: int, cases: list[tuple[str, str, int]]) -> list:
    attn = register_ring_attention()
    pool = GroupPool()
    out = []
    for family, plan_json, seed in cases:
        plan = StepPlan.from_json(plan_json)
        model = make_model(family, attn)
        tokens = tokens_for(plan.lengths, seed)
        losses = []

        def step_fn(ctx, model=model, tokens=tokens, losses=losses) -> None:
            loss = causal_lm_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
            loss.backward()
            losses.append(loss.detach())

        execute(plan, pool, step_fn)
        grads = reduce_gradients(model)
        loss = reduce_loss(losses, dtype=torch.float64)
        out.append((loss.item(), grads))
    return out


def reference(family: str, attn: str, plan: StepPlan, seed: int) -> tuple[float, dict]:
    model = make_model(family, attn)
    total = sum(s - 1 for s in plan.lengths)
    loss = torch.zeros((), dtype=torch.float64)
    for t in tokens_for(plan.lengths, seed):
        logits = model(input_ids=t[None], use_cache=False).logits[0]
        loss = loss + torch.nn.functional.cross_entropy(logits[:-1], t[1:], reduction="sum")
    loss = loss / total
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def main() -> None:
    batch = plans()
    cases = [(f, name) for f in (*FAMILIES, WINDOWED) for name in batch]
    seeds = {name: i + 1 for i, name in enumerate(batch)}
    results = run_gloo(
        _worker,
        world=WORLD,
        args=([(f, batch[n].to_json(), seeds[n]) for f, n in cases],),
        timeout=600,
    )
    print(
        f"{'family':9} {'plan':10} {'cp sizes':10} {'grad err sdpa':>14} {'loss err sdpa':>14} "
        f"{'grad err eager':>15} {'loss err eager':>15}"
    )
    worst = {"sdpa": 0.0, "eager": 0.0}
    for c, (family, name) in enumerate(cases):
        plan = batch[name]
        loss, grads = results[0][c]
        row = []
        for attn in ("sdpa", "eager"):
            ref_loss, ref_grads = reference(family, attn, plan, seeds[name])
            g_err = max(
                ((grads[n] - r).abs().max() / r.abs().max()).item() for n, r in ref_grads.items()
            )
            worst[attn] = max(worst[attn], g_err)
            row += [g_err, abs(loss - ref_loss) / abs(ref_loss)]
        sizes = sorted({g.size for w in plan.waves for g in w.groups})
        print(
            f"{family:9} {name:10} {str(sizes):10} {row[0]:14.2e} {row[1]:14.2e} "
            f"{row[2]:15.2e} {row[3]:15.2e}"
        )
    print(
        f"largest relative gradient error: vs SDPA {worst['sdpa']:.2e}, "
        f"vs eager {worst['eager']:.2e}"
    )


if __name__ == "__main__":
    main()
