"""Supervised fine-tuning with TRL's SFTTrainer under dynamic CP, offline, completion-only loss.

    torchrun --nproc-per-node 2 examples/sft_trl.py             # CPU, gloo
    torchrun --nproc-per-node 2 examples/sft_trl.py --packing   # TRL's bfd packing

The task is sorting: the prompt is ``sort 7 3 9 :`` and the completion `` 3 7 9`` followed by the
EOS token, with lists of 1 to ``--max-items`` numbers, so documents run from 4 to about
``2 * max-items`` tokens and the long ones need a CP ring of 2 at ``--capacity``. The tokenizer is
a word-level ``tokenizers`` vocabulary built here (no download); the model is a small
transformers Llama built from a config with dyncp's ring attention. TRL prepares the dataset
(EOS, tokenization, completion-only ``labels``: the prompt's are -100; with ``--packing`` it
packs with ``bfd``, and dyncp cuts the packed rows back into their documents);
``DynCPSFTTrainer`` then plans and runs every optimizer step with dyncp. Rank 0 prints each
step's loss (the mean over the global batch's completion tokens) and the CP sizes it used.
"""

from __future__ import annotations

import argparse
import os
import random

import datasets
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig

from dyncp.cost_model import CostModel
from dyncp.integrations.hf import register_ring_attention
from dyncp.integrations.trainer import PLAN_KEY
from dyncp.integrations.trl import DynCPSFTTrainer
from dyncp.planner import Planner

NUMBERS = [str(i) for i in range(50)]
SPECIAL = ["<pad>", "</s>", "<unk>", "sort", ":"]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Word-level: each number, ``sort`` and ``:`` one token; pad and EOS special."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + NUMBERS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def sorting(n: int, max_items: int, seed: int) -> datasets.Dataset:
    """``n`` prompt/completion pairs: a list of numbers, then the same list sorted."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        items = [rng.randrange(len(NUMBERS)) for _ in range(rng.randint(1, max_items))]
        rows.append(
            {
                "prompt": "sort " + " ".join(map(str, items)) + " :",
                "completion": " " + " ".join(map(str, sorted(items))),
            }
        )
    return datasets.Dataset.from_list(rows)


class Printing(DynCPSFTTrainer):
    """Prints each step's loss and CP sizes on rank 0."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        plan = inputs[PLAN_KEY]
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.process_index == 0:
            sizes = sorted({g.size for wave in plan.waves for g in wave.groups})
            print(
                f"step {self.state.global_step:3d}: loss {float(loss):.4f}  "
                f"docs {len(plan.sample_ids):3d}  cp sizes {sizes}",
                flush=True,
            )
        return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--max-items", type=int, default=60, help="longest list to sort")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--capacity", type=int, default=64, help="tokens per rank per micro-batch")
    p.add_argument("--global-batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--packing", action="store_true", help="TRL's bfd packing (dyncp unpacks)")
    p.add_argument("--out", default="out/sft_trl")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    max_length = 2 * a.max_items + 4  # sort, the items, :, the sorted items, EOS

    tok = tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
    )
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=register_ring_attention()
    )
    planner = Planner(
        CostModel.load("cpu-gloo", ranks_per_node=world),
        world=world,
        ranks_per_node=world,
        capacity=a.capacity,
        max_length=max_length,
        deterministic=True,  # every rank plans the same steps
    )
    args = SFTConfig(
        output_dir=a.out,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        gradient_accumulation_steps=1,  # a dyncp step is the whole global batch
        max_length=max_length,
        packing=a.packing,
        bf16=False,  # fp32 on CPU
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
    )
    trainer = Printing(
        model=model,
        args=args,
        train_dataset=sorting(a.examples, a.max_items, seed=0),
        processing_class=tok,
        planner=planner,
        global_batch_tokens=a.global_batch_tokens,
    )
    trainer.train()


if __name__ == "__main__":
    main()
