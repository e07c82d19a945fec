"""DynCPSFTTrainer: TRL's SFTTrainer under dyncp trains what plain SFTTrainer trains (1, 2 ranks).

A prompt/completion dataset (TRL's completion-only loss: prompt labels -100) is tokenized by TRL
with a tiny local WordLevel tokenizer and trained on a tiny fp64 Llama with AdamW, gradient
clipping and TRL's default activation checkpointing. dyncp's sampler cuts and plans the global
batches (on 2 gloo ranks under accelerate's DDP, with CP 1 and CP 2 rings). Two references:

- plain ``SFTTrainer`` on one process, fed the same global batches through its own collator
  (padded, SDPA with its attention mask) and its own loss: the per-step losses agree within
  1e-6 relative. Both are fp32 at the end: TRL computes token log-probabilities in fp32 and
  dyncp's ``reduce_loss`` sums the micro-batch losses in fp32 (unit roundoff 6e-8, a sum of a
  few hundred token terms); a wrong mask or count moves the loss by 1/(label tokens) >= 1e-3.
- the same batches in fp64 throughout (one SDPA forward per document, the mean over unmasked
  labels, the same clipping and AdamW): parameters within 1e-9. Plain SFTTrainer's parameters
  are not compared at 1e-9, because of its fp32 log-probabilities.

``packing=True`` (TRL's ``bfd``) gives the same documents, so with one global batch holding the
whole dataset (one step per epoch, the document order then does not matter) the packed run's
losses and parameters equal the unpacked run's; ``"wrapped"`` packing is refused at construction.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tokenizers")
pytest.importorskip("trl")

from trainer_data import torchrun_env  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "</s>", "<unk>"]
VOCAB = len(SPECIAL) + len(WORDS)
STEPS = 3
LR = 1e-2
CLIP = 0.5
MAX_LENGTH = 160  # the planner's longest document; every document here is shorter


def tokenizer():
    """A WordLevel tokenizer over WORDS (whitespace split), with pad and EOS: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def dataset():
    """20 prompt/completion pairs, prompts of 1..60 words and completions of 1..80."""
    import datasets

    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(20):
        p = int(torch.randint(1, 61, (1,), generator=gen))
        c = int(torch.randint(1, 81, (1,), generator=gen))
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (p + c,), generator=gen)]
        rows.append({"prompt": " ".join(words[:p]), "completion": " " + " ".join(words[p:])})
    return datasets.Dataset.from_list(rows)


def planner(world: int, capacity: int) -> Planner:
    return Planner(
        CostModel.load("cpu-gloo", ranks_per_node=world),
        world=world,
        ranks_per_node=world,
        capacity=capacity,
        max_length=MAX_LENGTH,
        deterministic=True,
        cpsat=None,
    )


def config(out_dir: str, **overrides):
    from trl import SFTConfig

    kwargs = dict(
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
        max_length=MAX_LENGTH,
        bf16=False,  # SFTConfig defaults to bf16 autocast; the exactness check is fp64
    )
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


def model(attn: str):
    from dyncp.testing.hf_models import tiny_causal_lm, tiny_config

    return tiny_causal_lm(tiny_config("llama", vocab=VOCAB), attn)


def _worker(
    rank: int, world: int, out_dir: str, capacity: int, batch_tokens: int, cfg: dict | None = None
) -> dict:
    torchrun_env(rank, world, 29556)
    from dyncp.integrations.hf import register_ring_attention
    from dyncp.integrations.trainer import PLAN_KEY
    from dyncp.integrations.trl import DynCPSFTTrainer

    seen: list = []
    losses: list = []

    class Recording(DynCPSFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            plan = inputs[PLAN_KEY]
            seen.append(
                (list(plan.sample_ids), sorted({g.size for w in plan.waves for g in w.groups}))
            )
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    trainer = Recording(
        model=model(register_ring_attention()),
        args=config(out_dir, **(cfg or {})),
        train_dataset=dataset(),
        processing_class=tokenizer(),
        planner=planner(world, capacity),
        global_batch_tokens=batch_tokens,
    )
    trainer.train()
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset]
    return {
        "steps": seen,
        "losses": losses,
        "rows": rows,
        "wrapped": type(trainer.model_wrapped).__name__,
        "checkpointing": trainer.model.is_gradient_checkpointing,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
    }


def plain_sft(out_dir: str, steps: list[list[int]]) -> tuple[list[float], list[dict]]:
    """Plain SFTTrainer on one process, its global batches those dyncp planned (same rows)."""
    from trl import SFTTrainer

    losses: list = []

    class Batches(SFTTrainer):
        def get_train_dataloader(self):
            rows = self.train_dataset
            return [
                self.data_collator([{k: rows[i][k] for k in ("input_ids", "labels")} for i in ids])
                for ids in steps
            ]

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    trainer = Batches(
        model=model("sdpa"),
        args=config(out_dir, per_device_train_batch_size=len(dataset())),
        train_dataset=dataset(),
        processing_class=tokenizer(),
    )
    trainer.train()
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset]
    return losses, rows


def fp64_reference(rows: list[dict], steps: list[list[int]]) -> dict[str, torch.Tensor]:
    """The parameters after the same global batches, in fp64 throughout: each row of TRL's
    prepared dataset its own SDPA forward, the mean over the batch's unmasked (shifted) labels,
    the same clipping and AdamW. (Plain SFTTrainer's parameters are no fp64 reference: TRL
    computes the token log-probabilities in fp32.)"""
    net = model("sdpa")
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    for ids in steps:
        labels = [torch.tensor(rows[i]["labels"]) for i in ids]
        total = sum(int((lab[1:] != -100).sum()) for lab in labels)
        loss = 0
        for i, lab in zip(ids, labels):
            logits = net(input_ids=torch.tensor(rows[i]["input_ids"])[None], use_cache=False)
            loss = (
                loss
                + torch.nn.functional.cross_entropy(
                    logits.logits[0, :-1], lab[1:], ignore_index=-100, reduction="sum"
                )
                / total
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


def assert_params_close(got: dict, want: dict) -> None:
    for name, param in want.items():
        err = (got[name] - param).abs().max().item()
        assert err <= 1e-9, (name, err)


@pytest.mark.timeout(300)
def test_one_process_equals_plain_sft(tmp_path) -> None:
    [run] = run_gloo(_worker, world=1, args=(str(tmp_path / "dyncp"), 200, 700), timeout=240)
    assert run["checkpointing"]  # TRL's default: activation checkpointing on
    steps = [ids for ids, _ in run["steps"]]
    assert len(steps) == STEPS and all(len(ids) > 1 for ids in steps)
    losses, rows = plain_sft(str(tmp_path / "plain"), steps)
    assert run["rows"] == rows  # TRL prepared the same documents for both
    # completion-only: every document's prompt is masked, and every document has a completion
    assert all(r["labels"][0] == -100 and r["labels"][-1] != -100 for r in rows)
    assert run["losses"] == pytest.approx(losses, rel=1e-6)
    assert_params_close(run["params"], fp64_reference(rows, steps))


@pytest.mark.timeout(300)
def test_two_ranks_equal_plain_sft(tmp_path) -> None:
    results = run_gloo(_worker, world=2, args=(str(tmp_path / "dyncp"), 80, 700), timeout=240)
    assert all(r["wrapped"] == "DistributedDataParallel" and r["checkpointing"] for r in results)
    steps = results[0]["steps"]
    assert len(steps) == STEPS and all(r["steps"] == steps for r in results)
    assert any(len(sizes) > 1 for _, sizes in steps), steps  # CP 1 and CP 2 within a step
    steps = [ids for ids, _ in steps]
    losses, rows = plain_sft(str(tmp_path / "plain"), steps)
    assert results[0]["rows"] == rows
    want = fp64_reference(rows, steps)
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=1e-6)
        assert_params_close(r["params"], want)


def _packed_and_unpacked(rank: int, world: int, out_dir: str) -> tuple[dict, dict]:
    """Both runs on the same ranks, one global batch per step holding every document."""
    whole = 10**6  # tokens: more than the dataset holds, so each step is one whole epoch
    unpacked = _worker(rank, world, f"{out_dir}/unpacked", 80, whole)
    packed = _worker(rank, world, f"{out_dir}/packed", 80, whole, {"packing": True})
    return unpacked, packed


@pytest.mark.timeout(400)
def test_packing_trains_what_the_unpacked_run_trains(tmp_path) -> None:
    results = run_gloo(_packed_and_unpacked, world=2, args=(str(tmp_path),), timeout=360)
    for unpacked, packed in results:
        # TRL's bfd rows, cut at their seq_lengths, are the same documents in another order
        assert sorted(map(str, packed["rows"])) == sorted(map(str, unpacked["rows"]))
        assert all(len(ids) == len(packed["rows"]) for ids, _ in packed["steps"])
        assert packed["losses"] == pytest.approx(unpacked["losses"], rel=1e-6)
        assert_params_close(packed["params"], unpacked["params"])


def test_unpack_documents_recovers_each_document() -> None:
    import datasets
    from trl import pack_dataset

    from dyncp.integrations.trl import unpack_documents

    docs = [list(range(10 * i, 10 * i + n)) for i, n in enumerate([5, 2, 7, 3, 1, 6])]
    labels = [[-100] + d[1:] for d in docs]
    ds = datasets.Dataset.from_dict({"input_ids": docs, "labels": labels})
    packed = pack_dataset(ds, 8, "bfd")
    assert len(packed) < len(docs)  # some rows hold several documents
    got = unpack_documents(packed)
    want = [(d, lab) for d, lab in zip(docs, labels) if len(d) >= 2]  # the 1-token one: no label
    assert sorted(zip(got["input_ids"], got["labels"])) == sorted(want)
    # bfd_split cuts a document longer than a row into pieces that TRL trains as documents
    split = unpack_documents(pack_dataset(ds, 4, "bfd_split"))
    pieces = [
        (d[s : s + 4], lab[s : s + 4])
        for d, lab in zip(docs, labels)
        for s in range(0, len(d), 4)
        if len(d[s : s + 4]) >= 2
    ]
    assert sorted(zip(split["input_ids"], split["labels"])) == sorted(pieces)
    with pytest.raises(ValueError, match="seq_lengths"):
        unpack_documents(ds)


def test_wrapped_packing_is_refused(tmp_path) -> None:
    from dyncp.integrations.hf import register_ring_attention
    from dyncp.integrations.trl import DynCPSFTTrainer

    with pytest.raises(ValueError, match="packing_strategy='wrapped'.*packing=False"):
        DynCPSFTTrainer(
            model=model(register_ring_attention()),
            args=config(str(tmp_path), packing=True, packing_strategy="wrapped"),
            train_dataset=dataset(),
            processing_class=tokenizer(),
            planner=planner(1, 200),
            global_batch_tokens=700,
        )


def test_iterable_dataset_is_refused(tmp_path) -> None:
    import datasets

    from dyncp.integrations.hf import register_ring_attention
    from dyncp.integrations.trl import DynCPSFTTrainer

    rows = list(dataset())
    iterable = datasets.IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match="map-style datasets.Dataset"):
        DynCPSFTTrainer(
            model=model(register_ring_attention()),
            args=config(str(tmp_path)),
            train_dataset=iterable,
            processing_class=tokenizer(),
            planner=planner(1, 200),
            global_batch_tokens=700,
        )
