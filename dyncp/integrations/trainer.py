"""Hugging Face ``Trainer`` with dynamic CP: each optimizer step runs one dyncp step plan.

    from dyncp.integrations.hf import register_ring_attention
    from dyncp.integrations.trainer import DynCPTrainer

    attn = register_ring_attention()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    planner = Planner(cost_model, world=world, ranks_per_node=8, capacity=8192, deterministic=True)
    trainer = DynCPTrainer(
        model=model, args=TrainingArguments(..., max_steps=1000), train_dataset=tokenized,
        planner=planner, global_batch_tokens=8 * 8192,
    )
    trainer.train()                       # torchrun / accelerate launch, DDP or FSDP2

Why a subclass and not a callback or a data collator: ``Trainer`` runs exactly
``gradient_accumulation_steps`` forward + backward calls per optimizer step on every process and
synchronises gradients in them (DDP: in the last backward; FSDP2: all-gathers in every forward and
reduce-scatters in every backward). A dyncp plan gives each process its own number of micro-batches
(a CP-1 rank may run eight packs while a CP-4 ring runs one, and a rank may run none), whose rings
and waves must also run in the plan's order. No collator or callback can change how many times
the loop calls forward and backward, so the loop itself is replaced where ``Trainer`` allows it:
``get_train_dataloader`` yields one item per optimizer step (the step's plan, from
``DynamicCPSampler``, the same on every rank), and ``training_step`` runs the whole plan with
:class:`~dyncp.integrations.ddp.DDPRunner` or :class:`~dyncp.integrations.fsdp.FSDPRunner`
(whichever wraps the model accelerate prepared), or ``runtime.execute`` on a single process
started by torchrun. A single process started without torchrun (plain ``python train.py``, a
planner for ``world=1``) has no ``torch.distributed``, and the Trainer initialises nothing: its
plans, all CP 1, run locally with :func:`~dyncp.integrations.local.execute_local` (the same
micro-batches, contexts and loss scale, no collective), and the loss is this process's sum.
Everything after the backward stays the Trainer's: gradient clipping, the optimizer and its
scheduler, logging (the loss logged is the global batch's mean token loss, the same on every
rank), checkpoints, callbacks.

The dataset: rows with ``input_ids`` (a list of token ids: one document, unpadded) and optionally
``labels`` in the Hugging Face convention (same length as ``input_ids``, -100 where no loss is
taken, e.g. a prompt; the model shifts them by one). The loss is the mean over the global batch's
label tokens; ``ctx.loss_scale`` counts exactly those tokens. Set ``gradient_accumulation_steps=1``
(a dyncp step is already the whole global batch; its size is ``global_batch_tokens`` or
``global_batch_size``), and ``max_steps`` or ``num_train_epochs`` as usual.

Tested: accelerate's DDP on CPU. The FSDP2 branch (accelerate with ``fsdp_version: 2`` passes the
root ``fully_shard`` module) needs a GPU to test: on CPU accelerate wrapped the model in DDP even
with FSDP2 configured.

TRL: ``dyncp.integrations.trl.DynCPSFTTrainer`` is this mixin in front of TRL's ``SFTTrainer``
(completion-only loss kept; TRL's ``bfd`` packing cut back into documents), tested against
``SFTTrainer`` alone (``pip install dyncp[trl]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from dyncp.integrations.ddp import DDPRunner
from dyncp.integrations.fsdp import FSDPRunner
from dyncp.integrations.hf import causal_lm_loss
from dyncp.integrations.local import execute_local
from dyncp.plan import StepPlan
from dyncp.planner import Planner
from dyncp.runtime import IGNORE, GroupPool, execute, reduce_loss
from dyncp.sampler import DynamicCPSampler

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dyncp.integrations.trainer needs transformers and accelerate: pip install 'dyncp[trainer]'"
    ) from exc

__all__ = ["PLAN_KEY", "DynCPTrainer", "DynCPTrainerMixin"]

#: The key under which each step's plan travels from the dataloader to ``training_step``.
PLAN_KEY = "dyncp_plan"


class _Steps:
    """One item per optimizer step: ``{PLAN_KEY: plan}``, from the sampler's step boundaries."""

    def __init__(self, sampler: DynamicCPSampler) -> None:
        self.sampler = sampler
        self.plans: dict[tuple[int, int], StepPlan] = {}

    def __len__(self) -> int:
        return self.sampler.num_steps

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, StepPlan]]:
        for mb in self.sampler:  # this rank's micro-batches; the last one closes the step
            if mb.meta.last_in_step:
                yield {PLAN_KEY: self.plans.pop((mb.meta.epoch, mb.meta.step))}


class DynCPTrainerMixin:
    """Put in front of ``transformers.Trainer`` (or a subclass): dyncp plans every step.

    Args:
        planner: the dyncp planner (deterministic: every rank plans the same steps); its world
            is the number of training processes.
        global_batch_tokens, global_batch_size: how global batches are cut (give one).
        kernel: ring attention's block kernel (``"auto"``, ``"flash"``, ``"sdpa"``, ``"math"``).
        *args, **kwargs: the Trainer's own.

    Raises:
        ValueError: gradient accumulation other than 1, or a planner for another world size.
    """

    def __init__(
        self,
        *args: Any,
        planner: Planner,
        global_batch_tokens: int | None = None,
        global_batch_size: int | None = None,
        kernel: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps must be 1 with dyncp (each step is the whole global "
                f"batch of global_batch_tokens / global_batch_size), got "
                f"{self.args.gradient_accumulation_steps}"
            )
        if planner.topology.world != self.args.world_size:
            raise ValueError(
                f"the planner is for {planner.topology.world} ranks, the Trainer runs on "
                f"{self.args.world_size} processes"
            )
        self.dyncp_planner = planner
        self.dyncp_batch = {
            "global_batch_tokens": global_batch_tokens,
            "global_batch_size": global_batch_size,
        }
        self.dyncp_kernel = kernel
        self._dyncp_pool: GroupPool | None = None
        self._dyncp_runners: dict[int, Callable[..., Any]] = {}

    def get_train_dataloader(self) -> _Steps:
        """Each item is one step's plan (the same on every rank), cut and planned by dyncp."""
        if self.train_dataset is None:
            raise ValueError("DynCPTrainer needs a train_dataset")
        lengths = [len(row["input_ids"]) for row in self.train_dataset]
        steps = None

        def on_step(plan: StepPlan, info: Any) -> None:
            steps.plans[(info.epoch, info.step)] = plan

        sampler = DynamicCPSampler(
            lengths,
            world_size=self.args.world_size,
            rank=self.args.process_index,
            capacity=self.dyncp_planner.topology.capacity,
            planner=self.dyncp_planner,
            seed=self.args.seed,
            on_step=on_step,
            **self.dyncp_batch,
        )
        steps = _Steps(sampler)
        return steps

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch this rank runs in the step's plan, then the
        gradient reduction; returns the global batch's mean token loss (detached)."""
        plan = inputs[PLAN_KEY]
        model.train()
        # One process without torch.distributed (no torchrun): nothing to build, nothing to sum.
        local = self.args.world_size == 1 and not dist.is_initialized()
        if self._dyncp_pool is None and not local:
            self._dyncp_pool = GroupPool()  # collective: every rank reaches its first step
        device = self.args.device
        rows = plan.sample_ids if plan.sample_ids is not None else range(len(plan.lengths))
        data = {int(r): _document(self.train_dataset[int(r)]) for r in rows}
        losses: list[torch.Tensor] = []

        def step_fn(ctx) -> None:
            ids, labels = zip(*(data[i] for i in ctx.sample_ids))
            packed = torch.cat(ids).to(device)
            loss = causal_lm_loss(
                model, ctx, packed, torch.cat(labels).to(device), kernel=self.dyncp_kernel
            )
            loss.backward()
            losses.append(loss.detach().float())

        counts = [int((data[int(r)][1] != IGNORE).sum()) for r in rows]
        if local:
            execute_local(plan, step_fn, labels_per_sequence=counts)
            return torch.stack(losses).double().sum().float()  # what reduce_loss gives 1 rank
        self._runner(model)(plan, self._dyncp_pool, step_fn, labels_per_sequence=counts)
        return reduce_loss(losses, device=device)

    def _runner(self, model: nn.Module) -> Callable[..., Any]:
        """The step runner for the model accelerate prepared (cached per model object)."""
        key = id(model)
        if key not in self._dyncp_runners:
            if isinstance(model, DistributedDataParallel):
                self._dyncp_runners[key] = DDPRunner(model).step
            elif isinstance(model, FSDPModule):
                self._dyncp_runners[key] = FSDPRunner(model).step
            elif self.args.world_size == 1:
                self._dyncp_runners[key] = execute
            else:
                raise ValueError(
                    f"with {self.args.world_size} processes the model must be wrapped in "
                    f"DistributedDataParallel or sharded with FSDP2 (fully_shard); got a "
                    f"{type(model).__name__}"
                )
        return self._dyncp_runners[key]


class DynCPTrainer(DynCPTrainerMixin, Trainer):
    """``transformers.Trainer`` whose every optimizer step is one dyncp step plan."""


def _document(row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's token ids and its next-token labels (shifted: label i is what token i predicts)."""
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(
            f"each row's input_ids must be one document of at least 2 tokens, got shape "
            f"{tuple(ids.shape)}"
        )
    shifted = torch.full_like(ids, IGNORE)
    given = row.get("labels")
    if given is None:
        shifted[:-1] = ids[1:]
    else:
        labels = torch.as_tensor(given, dtype=torch.long)
        if labels.shape != ids.shape:
            raise ValueError(
                f"labels must have input_ids' shape {tuple(ids.shape)}, got {tuple(labels.shape)}"
            )
        shifted[:-1] = labels[1:]
    return ids, shifted
