"""DynCPTrainer on one process, without torchrun: it trains exactly what the same steps train.

``python train.py`` with a planner for one rank and no ``torch.distributed``: three optimizer
steps of ``DynCPTrainer`` on a tiny Llama in fp64 (documents of mixed lengths, some with a
prompt masked out of the loss), AdamW with gradient clipping. The parameters after the steps
equal those of the same global batches on one process by hand (unpacked SDPA, the mean token
loss over unmasked labels, the same clipping and AdamW) within 1e-9, the losses the Trainer
logs are those batches' mean token losses, and training initialised no process group.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.integrations.hf import register_ring_attention  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.testing.hf_models import tiny_causal_lm, tiny_config  # noqa: E402

VOCAB = 61
STEPS = 3
LR = 1e-2
CLIP = 0.5


def dataset() -> list[dict]:
    """16 documents of 2..150 tokens; every third has its first half masked (a 'prompt')."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 150, (16,), generator=gen).tolist()
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        row = {"input_ids": ids}
        if i % 3 == 0:
            row["labels"] = [-100] * (n // 2) + ids[n // 2 :]
        rows.append(row)
    return rows


def train(out_dir: str) -> tuple[list, list[float], dict[str, torch.Tensor]]:
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
        optim="adamw_torch",
        max_grad_norm=CLIP,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
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
    model = tiny_causal_lm(tiny_config("llama", vocab=VOCAB), register_ring_attention())
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


def reference(steps: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same global batches by hand: unpacked SDPA, mean over unmasked labels."""
    model = tiny_causal_lm(tiny_config("llama", vocab=VOCAB), "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows = dataset()
    losses = []
    for sample_ids in steps:
        docs = [rows[i] for i in sample_ids]
        labels = [torch.tensor(r.get("labels", r["input_ids"])) for r in docs]
        total = sum(int((lab[1:] != -100).sum()) for lab in labels)
        loss = 0
        for row, lab in zip(docs, labels):
            logits = model(input_ids=torch.tensor(row["input_ids"])[None], use_cache=False).logits
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


def test_execute_local_refuses_a_plan_for_more_ranks() -> None:
    from dyncp.integrations.local import execute_local
    from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave

    plan = StepPlan(
        Topology(2, 2, 64), (5, 7), (Wave((Group(0, 2, (MicroBatch((0, 1)),)),)),), policy="hand"
    )
    with pytest.raises(ValueError, match=r"one rank \(topology.world == 1\), got 2"):
        execute_local(plan, lambda ctx: None)
