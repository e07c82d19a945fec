"""TRL's ``SFTTrainer`` with dynamic CP: ``DynCPSFTTrainer`` runs every optimizer step as one plan.

    from trl import SFTConfig
    from dyncp.integrations.hf import register_ring_attention
    from dyncp.integrations.trl import DynCPSFTTrainer

    attn = register_ring_attention()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    trainer = DynCPSFTTrainer(
        model=model, args=SFTConfig(output_dir="out", max_steps=1000, packing=True),
        train_dataset=prompt_completion, processing_class=tokenizer,
        planner=planner, global_batch_tokens=8 * 8192,
    )
    trainer.train()                       # torchrun / accelerate launch, as SFTTrainer

Why a subclass of ``SFTTrainer`` behind :class:`~dyncp.integrations.trainer.DynCPTrainerMixin`:
TRL's data preparation is what users come for (chat templates, EOS, the completion-only and
assistant-only ``labels``, truncation), and it runs once in ``SFTTrainer.__init__``, producing
rows of ``input_ids`` and ``labels`` (-100 where no loss is taken). Those are exactly the rows the
mixin plans, packs and trains on, so the loss is SFTTrainer's: the mean over the global batch's
label tokens. The mixin replaces the two methods that decide how many forwards and backwards a
step runs (``get_train_dataloader``, ``training_step``); TRL's collator and ``compute_loss`` are
not used for training (dyncp packs with per-sequence boundaries and computes the loss on zigzag
shards itself, see ``dyncp.integrations.hf``).

Packing (``packing=True``): TRL's ``"bfd"`` and ``"bfd_split"`` strategies pack documents into
rows of ``max_length`` tokens and record each row's document lengths (``seq_lengths``), which
TRL's padding-free training uses to restart positions and keep attention inside each document.
This class cuts every packed row back into those documents (a 1-token piece has no label to
predict once positions restart and is dropped, as it adds nothing to TRL's loss), so dyncp plans
and packs the same documents with no attention across them: the same tokens, labels and
attention as TRL's packed run, cut into dyncp's own micro-batches. ``"wrapped"`` cuts documents
at row boundaries and keeps no lengths (its rows attend across documents), so there are no
documents to recover: it is refused.

Not supported: an ``IterableDataset`` (dyncp plans each step from every document's length) and
evaluation through the ring attention (the model needs ``ring_layout`` in every forward).
Needs the ``trl`` extra (``pip install 'dyncp[trl]'``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dyncp.integrations.trainer import DynCPTrainerMixin

try:
    import datasets
    from trl import SFTTrainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dyncp.integrations.trl needs trl: pip install 'dyncp[trl]'") from exc

__all__ = ["DynCPSFTTrainer", "unpack_documents"]

#: TRL packing strategies whose rows keep each document's length (``seq_lengths``).
_BOUNDED = ("bfd", "bfd_split")


class DynCPSFTTrainer(DynCPTrainerMixin, SFTTrainer):
    """TRL ``SFTTrainer`` whose every optimizer step is one dyncp step plan.

    Takes ``SFTTrainer``'s arguments (a ``processing_class`` is needed unless the model's
    tokenizer can be loaded) plus the mixin's ``planner``, ``global_batch_tokens`` /
    ``global_batch_size`` and ``kernel``. ``gradient_accumulation_steps`` must be 1.

    Raises:
        ValueError: ``packing_strategy="wrapped"`` with ``packing=True``, or an
            ``IterableDataset`` (besides the mixin's own checks).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.train_dataset, datasets.Dataset):
            raise ValueError(
                f"DynCPSFTTrainer needs a map-style datasets.Dataset (dyncp plans every step from "
                f"all document lengths), got a {type(self.train_dataset).__name__}"
            )
        if self.args.packing:
            if self.args.packing_strategy not in _BOUNDED:
                raise ValueError(
                    f"packing_strategy={self.args.packing_strategy!r} keeps no document "
                    f"boundaries, so its rows attend across documents; use packing_strategy="
                    f"'bfd' or 'bfd_split' (dyncp recovers each document), or packing=False "
                    f"(dyncp packs the documents itself)"
                )
            self.train_dataset = unpack_documents(self.train_dataset)

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The mixin's step inside TRL's activation-offloading context, as SFTTrainer's is."""
        with self.maybe_activation_offload_context:
            return DynCPTrainerMixin.training_step(self, model, inputs, num_items_in_batch)


def unpack_documents(packed: datasets.Dataset) -> datasets.Dataset:
    """The documents of a TRL-packed dataset: each row cut at its ``seq_lengths``.

    Returns a dataset of ``input_ids`` and ``labels`` (one document per row, in the packed
    order). A piece shorter than 2 tokens is dropped: TRL masks the label where positions
    restart, so such a piece contributes no loss.

    Raises:
        ValueError: a row without ``seq_lengths``, or lengths that do not sum to the row's.
    """
    if "seq_lengths" not in packed.column_names:
        raise ValueError(
            f"a packed dataset needs a seq_lengths column (TRL's 'bfd' packing writes one); "
            f"got columns {packed.column_names}"
        )
    ids_out: list[list[int]] = []
    labels_out: list[list[int]] = []
    for i, row in enumerate(packed):
        ids, lengths = row["input_ids"], row["seq_lengths"]
        labels = row.get("labels") or ids
        if sum(lengths) != len(ids) or len(labels) != len(ids):
            raise ValueError(
                f"packed row {i}: seq_lengths {lengths} sum to {sum(lengths)}, but the row has "
                f"{len(ids)} input_ids and {len(labels)} labels"
            )
        start = 0
        for n in lengths:
            if n >= 2:
                ids_out.append(ids[start : start + n])
                labels_out.append(labels[start : start + n])
            start += n
    return datasets.Dataset.from_dict({"input_ids": ids_out, "labels": labels_out})
