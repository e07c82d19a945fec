"""DynCPTrainer: transformers' Trainer (with accelerate) trains exactly what one process trains.

Two gloo ranks under accelerate's DDP run three optimizer steps of ``DynCPTrainer`` on a tiny
Llama in fp64: documents of mixed lengths (some with a prompt masked out of the loss by -100
labels), batched and planned by dyncp with mixed CP sizes, AdamW with gradient clipping. The
parameters after the steps equal those of the same steps on one process (the same global
batches, the mean token loss over their unmasked labels, the same clipping and AdamW) within
1e-9, and the loss the Trainer logs is the global batch's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainer_data import VOCAB, masked_documents, torchrun_env  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.integrations.hf import register_ring_attention  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402
from dyncp.testing.hf_models import tiny_causal_lm, tiny_config  # noqa: E402

WORLD = 2
STEPS = 3
LR = 1e-2
CLIP = 0.5


def dataset() -> list[dict]:
    return masked_documents(24)


def planner() -> Planner:
    return Planner(
        CostModel.load("cpu-gloo", ranks_per_node=WORLD),
        world=WORLD,
        ranks_per_node=WORLD,
        capacity=80,
        max_length=160,
        deterministic=True,
        cpsat=None,
    )


def _worker(rank: int, world: int, out_dir: str) -> dict:
    torchrun_env(rank, world, 29555)
    from transformers import TrainerCallback, TrainingArguments

    from dyncp.integrations.trainer import PLAN_KEY, DynCPTrainer

    seen: list = []
    logged: list = []

    class Recording(DynCPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            plan = inputs[PLAN_KEY]
            seen.append(
                (list(plan.sample_ids), sorted({g.size for w in plan.waves for g in w.groups}))
            )
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
    model = tiny_causal_lm(tiny_config("llama", vocab=VOCAB), register_ring_attention())
    trainer = Recording(
        model=model,
        args=args,
        train_dataset=dataset(),
        planner=planner(),
        global_batch_tokens=600,
        callbacks=[Logs()],
    )
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"steps": seen, "params": params, "logged": logged, "wrapped": wrapped}


def reference(steps: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same global batches on one process: unpacked SDPA, mean over unmasked labels."""
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
            ids = torch.tensor(row["input_ids"])
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
            loss = (
                loss
                + torch.nn.functional.cross_entropy(
                    logits[:-1], lab[1:], ignore_index=-100, reduction="sum"
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
def test_trainer_steps_equal_single_process(tmp_path) -> None:
    results = run_gloo(_worker, world=WORLD, args=(str(tmp_path),), timeout=240)
    assert all(r["wrapped"] == "DistributedDataParallel" for r in results)
    steps = results[0]["steps"]
    assert len(steps) == STEPS
    assert all(r["steps"] == steps for r in results)  # every rank ran the same plans
    assert any(len(sizes) > 1 for _, sizes in steps), steps  # CP 1 and 2 within a step
    ref, losses = reference([ids for ids, _ in steps])
    for r in results:
        assert r["logged"] == pytest.approx(losses, rel=1e-6)  # logged as float by Trainer
        for name, param in ref.items():
            err = (r["params"][name] - param).abs().max().item()
            assert err <= 1e-9, (name, err)
