"""DynCPTrainer on one process, without torchrun: it trains exactly what the same steps train.

``python train.py`` with a planner for one rank and no ``torch.distributed``: three optimizer
steps of ``DynCPTrainer`` on a tiny Llama in fp64 (documents of mixed lengths, some with a
prompt masked out of the loss), AdamW with gradient clipping. The parameters after the steps
equal those of the same global batches on one process by hand (unpacked SDPA, the mean token
loss over unmasked labels, the same clipping and AdamW) within 1e-9, the losses the Trainer
logs are those batches' mean token losses, and training initialised no process group. With
``bf16=True`` (fp32 weights, CPU bf16 autocast) the steps track the same steps through SDPA
under the same autocast within bf16 tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainer_data import VOCAB, masked_documents  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.integrations.hf import register_ring_attention  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.testing.hf_models import tiny_causal_lm, tiny_config  # noqa: E402

STEPS = 3
LR = 1e-2
CLIP = 0.5


def dataset() -> list[dict]:
    return masked_documents(16)


def train(out_dir: str, *, bf16: bool = False) -> tuple[list, list[float], dict[str, torch.Tensor]]:
    """Train ``STEPS`` steps (fp64 and AdamW; with ``bf16``: fp32 weights under the Trainer's
    bf16 autocast and SGD, whose update is linear in the gradient); returns each step's
    (dataset rows, micro-batch count), the logged losses and the final parameters."""
    from transformers import TrainerCallback, TrainingArguments

    from dyncp.integrations.trainer import PLAN_KEY, DynCPTrainer

    seen: list = []
    logged: list[float] = []

    class Recording(DynCPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            plan = inputs[PLAN_KEY]
            counts = [len(g.microbatches) for w in plan.waves for g in w.groups]
            seen.append((list(plan.sample_ids), sum(counts)))
            return super().training_step(model, inputs, num_items_in_batch)

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="sgd" if bf16 else "adamw_torch",
        max_grad_norm=CLIP,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=bf16,
    )
    planner = Planner(
        CostModel.load("cpu-gloo", ranks_per_node=1),
        world=1,
        ranks_per_node=1,
        capacity=160,
        max_length=160,
        deterministic=True,
        cpsat=None,
    )
    dtype = torch.float32 if bf16 else torch.float64
    model = tiny_causal_lm(
        tiny_config("llama", vocab=VOCAB), register_ring_attention(), dtype=dtype
    )
    trainer = Recording(
        model=model,
        args=args,
        train_dataset=dataset(),
        planner=planner,
        global_batch_tokens=400,
        callbacks=[Logs()],
    )
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return seen, logged, params


def reference(
    steps: list[list[int]], *, bf16: bool = False
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same global batches by hand: unpacked SDPA, mean over unmasked labels (with
    ``bf16``: fp32 weights, forwards under CPU bf16 autocast, as the Trainer's)."""
    dtype = torch.float32 if bf16 else torch.float64
    model = tiny_causal_lm(tiny_config("llama", vocab=VOCAB), "sdpa", dtype=dtype)
    if bf16:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows = dataset()
    losses = []
    for sample_ids in steps:
        docs = [rows[i] for i in sample_ids]
        labels = [torch.tensor(r.get("labels", r["input_ids"])) for r in docs]
        total = sum(int((lab[1:] != -100).sum()) for lab in labels)
        loss = 0
        for row, lab in zip(docs, labels):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                ids = torch.tensor(row["input_ids"])[None]
                logits = model(input_ids=ids, use_cache=False).logits.to(dtype)
            loss = (
                loss
                + torch.nn.functional.cross_entropy(
                    logits[0, :-1], lab[1:], ignore_index=-100, reduction="sum"
                )
                / total
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


@pytest.mark.timeout(300)
def test_one_process_trainer_steps_equal_the_same_steps_by_hand(tmp_path) -> None:
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ  # a plain `python`
    steps, logged, params = train(str(tmp_path))
    assert not dist.is_initialized()  # nothing was initialised behind the user's back
    assert len(steps) == STEPS and all(ids for ids, _ in steps)
    assert any(count > 1 for _, count in steps), steps  # steps of several micro-batches
    ref, losses = reference([ids for ids, _ in steps])
    assert logged == pytest.approx(losses, rel=1e-6)  # the Trainer logs floats
    for name, want in ref.items():
        err = (params[name] - want).abs().max().item()
        assert err <= 1e-9, (name, err)


@pytest.mark.timeout(300)
def test_one_process_trainer_trains_under_bf16_autocast(tmp_path) -> None:
    """``bf16=True``: the model's RoPE hands ring attention float32 queries and keys and
    bfloat16 values; attention runs in bf16 as SDPA does, and the steps track the same steps
    with SDPA under the same autocast. bf16 keeps 8 significant bits (2 ** -8 = 3.9e-3), and
    the two attentions round in different orders: gradients differ by about 1 % (7e-3 in
    test_hf_autocast.py), so SGD's parameters by about 1 % of how far they moved. Measured:
    losses 3.8e-6 relative, parameters 1.3e-6 against a movement of 5.6e-4 (0.24 %).
    Asserted: losses within 1e-4 relative, parameters within 3 % of the largest movement."""
    steps, logged, params = train(str(tmp_path), bf16=True)
    ref, losses = reference([ids for ids, _ in steps], bf16=True)
    start = dict(tiny_causal_lm(tiny_config("llama", vocab=VOCAB), "sdpa", dtype=torch.float32)
                 .named_parameters())  # fmt: skip
    moved = max((want - start[name]).abs().max().item() for name, want in ref.items())
    assert moved > 1e-4  # it trained
    assert logged == pytest.approx(losses, rel=1e-4)
    for name, want in ref.items():
        err = (params[name] - want).abs().max().item()
        assert err <= 0.03 * moved, (name, err, moved)


def test_execute_local_refuses_a_plan_for_more_ranks() -> None:
    from dyncp.integrations.local import execute_local
    from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave

    plan = StepPlan(
        Topology(2, 2, 64), (5, 7), (Wave((Group(0, 2, (MicroBatch((0, 1)),)),)),), policy="hand"
    )
    with pytest.raises(ValueError, match=r"one rank \(topology.world == 1\), got 2"):
        execute_local(plan, lambda ctx: None)
