"""Fine-tune a Llama-like model on real text under FSDP2 with dynamic CP, all offline.

    torchrun --nproc-per-node 2 examples/sft.py                       # CPU, gloo, < 3 minutes
    torchrun --nproc-per-node 8 examples/sft.py --steps 200 --hidden 1024 --layers 16 \\
        --capacity 16384 --max-length 65536                         # GPUs: NCCL, same script

The text is the Python standard library's own source, on every machine with Python: each top-level
definition (a function, a class, or the module code between them) of each module is one document,
so lengths run from a few tokens to thousands, the long tail dyncp schedules for. A byte-level BPE
tokenizer is trained on it locally with ``tokenizers`` (rank 0 trains, the others receive it).
``DynamicCPSampler`` cuts the documents into global batches of ``--global-batch-tokens`` and plans
each step (the same deterministic planner on every rank); a transformers Llama built from a config
(dyncp's ring attention registered as its attention) is sharded with ``fully_shard`` per decoder
layer and at the root, and :class:`dyncp.integrations.fsdp.FSDPRunner` runs each step's plan: one
all-gather and one reduce-scatter per unit however many micro-batches each rank runs. The loss is
the mean token loss of the global batch (every label token weighted once, whatever the CP size).

Rank 0 prints each step's loss, the CP sizes used, the measured step time and the predicted
whole step, calibrated online by default (``dyncp.runtime.whole_step.WholeStepCalibration``:
the micro-batches refitted from their measured times, the part outside them -- FSDP2's
collectives, the optimizer -- from the wall clock minus the busiest rank's busy time; each step
predicted before it is learnt from; ``--no-calibrate`` keeps the starting profile, to compare);
it names the profile it started from and, at the end, what calibration changed. Prometheus metrics
(dyncp's step, balance and CP-size metrics) are recorded every step, served with
``--metrics-port``, and a summary of them is printed at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dyncp.cost_model import CostModel
from dyncp.cost_model.schema import load_profile
from dyncp.integrations.fsdp import FSDPRunner
from dyncp.integrations.hf import causal_lm_loss, register_ring_attention
from dyncp.observability import Metrics
from dyncp.planner import Planner
from dyncp.runtime import GroupPool, reduce_loss
from dyncp.runtime.whole_step import WholeStepCalibration
from dyncp.sampler import DynamicCPSampler

#: A top-level definition starts a new document (decorators stay with what they decorate).
_TOP_LEVEL = re.compile(r"^(?=(?:@|def |async def |class ))", re.MULTILINE)


def documents(root: Path, *, limit: int | None) -> list[str]:
    """Top-level pieces of the standard library's modules, in a fixed order."""
    files = sorted(root.glob("*.py"))[:limit]
    docs = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        pieces = _TOP_LEVEL.split(text)
        merged: list[str] = []
        for piece in pieces:  # a decorator line joins the definition below it
            if merged and merged[-1].lstrip().startswith("@") and "\ndef " not in merged[-1]:
                merged[-1] += piece
            else:
                merged.append(piece)
        docs += [p for p in merged if p.strip()]
    return docs


def train_tokenizer(docs: list[str], vocab: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer


def shared_tokenizer(docs: list[str], vocab: int, rank: int) -> Tokenizer:
    """Rank 0 trains; every rank gets the same tokenizer (its JSON, broadcast)."""
    box = [train_tokenizer(docs, vocab).to_str() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Tokenizer.from_str(box[0])


def build_model(args, vocab: int, attn: str, device: torch.device) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.max_length,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device).train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--files", type=int, default=None, help="first N stdlib modules (default all)")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-length", type=int, default=2048, help="longer documents are truncated")
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--global-batch-tokens", type=int, default=8192)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=5, help="steps of linear learning-rate warm-up")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction (GPU)")
    p.add_argument("--profile", default=None, help="cost model (default cpu-gloo / h100-reference)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="predict with the starting profile only (default: calibrate online)",
    )
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    device = device or torch.device("cpu")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    profile = args.profile or ("h100-reference" if cuda else "cpu-gloo")

    start = time.perf_counter()
    docs = documents(Path(sysconfig.get_paths()["stdlib"]), limit=args.files)
    tokenizer = shared_tokenizer(docs, args.vocab, rank)
    tokens = [
        torch.tensor(e.ids[: args.max_length], dtype=torch.long)
        for e in tokenizer.encode_batch(docs)
    ]
    keep = [i for i, t in enumerate(tokens) if t.numel() >= 2]  # a label needs two tokens
    tokens = [tokens[i] for i in keep]
    lengths = np.array([t.numel() for t in tokens])
    if rank == 0:
        q = np.percentile(lengths, [50, 90, 99])
        print(
            f"{len(tokens)} documents from the stdlib in {time.perf_counter() - start:.1f} s, "
            f"{int(lengths.sum())} tokens (BPE vocab {tokenizer.get_vocab_size()}); lengths "
            f"min {lengths.min()} p50 {q[0]:.0f} p90 {q[1]:.0f} p99 {q[2]:.0f} max {lengths.max()}"
        )

    planner = Planner(
        CostModel(load_profile(profile), ranks_per_node=per_node),
        world=world,
        ranks_per_node=per_node,
        capacity=args.capacity,
        max_length=args.max_length,
        deterministic=True,
        cpsat=None,
        step_parts=True,  # the whole step's parts, printed below
    )  # identical on every rank
    metrics = Metrics(cp_sizes=planner.topology.group_sizes) if rank == 0 else None
    if metrics is not None and args.metrics_port is not None:
        print(f"metrics at {metrics.serve(port=args.metrics_port).url}")
    plans: dict[tuple[int, int], object] = {}
    sampler = DynamicCPSampler(
        lengths,
        world_size=world,
        rank=rank,
        capacity=args.capacity,
        planner=planner,
        global_batch_tokens=args.global_batch_tokens,
        seed=args.seed,
        on_step=lambda plan, info: plans.__setitem__((info.epoch, info.step), plan),
    )

    attn = register_ring_attention()
    model = build_model(args, tokenizer.get_vocab_size(), attn, device)
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard = {"mesh": mesh, "mp_policy": mp} if args.bf16 else {"mesh": mesh}
    for layer in model.model.layers:
        fully_shard(layer, **shard)
    fully_shard(model, **shard)
    runner = FSDPRunner(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / args.warmup)
    )  # a short linear warm-up: AdamW's first steps on a fresh model are its largest
    pool = GroupPool()
    sync = torch.cuda.synchronize if cuda else None
    calib = None
    if args.calibrate:  # the plans stay the sampler's; the predictions follow the measurements
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # global
        calib = WholeStepCalibration(
            pool,
            planner.model.profile,
            ranks_per_node=per_node,
            integration="fsdp2-once",  # FSDPRunner: one gather, one scatter a step
            parameters=trained,
        )
    if rank == 0:
        how = "calibrating online (--no-calibrate to compare)" if calib else "not calibrating"
        source = planner.model.profile.provenance.source
        print(f"cost model: profile {profile} ({source}); {how}")

    curve = []
    step = 0
    for mb in sampler:  # this rank's micro-batches; the runner runs them, they mark the steps
        if not mb.meta.last_in_step:
            continue
        plan = plans.pop((mb.meta.epoch, mb.meta.step))
        losses: list[torch.Tensor] = []

        def step_fn(ctx, losses=losses) -> None:
            packed = torch.cat([tokens[i] for i in ctx.sample_ids]).to(device)
            loss = causal_lm_loss(model, ctx, packed)  # summed token loss * ctx.loss_scale
            loss.backward()
            losses.append(loss.detach().float())

        t0 = time.perf_counter()
        report = runner.step(plan, pool, step_fn, synchronize=sync)
        optim.step()
        warmup.step()
        optim.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        loss = reduce_loss(losses, device=device).item()
        busy = torch.tensor([report.busy_seconds], device=device)
        gathered = [torch.zeros_like(busy) for _ in range(world)]
        dist.all_gather(gathered, busy)
        busy_all = np.array([b.item() for b in gathered])
        seen = None
        if calib is not None:  # collective: every rank, every step
            seen = calib.step(plan, report, step_seconds=seconds, busiest_seconds=busy_all.max())
        if rank == 0:
            metrics.observe_step(plan)
            metrics.observe_measured_step(
                policy=plan.policy,
                step_seconds=seconds,
                rank_busy_seconds=busy_all,
                predicted_step_seconds=plan.stats["predicted_step_seconds"],
            )
            curve.append(loss)
            sizes = sorted(set(plan.cp_of_sequences().values()))
            st = plan.stats
            predicted = st["step_parts"]["total"] if seen is None else seen.predicted_seconds
            version = "" if calib is None else f" v{calib.current.version}"
            mbs = "" if seen is None else f", predicted {seen.predicted_busy_seconds:.2f} s"
            print(
                f"step {step:3d}: loss {loss:.4f}  docs {len(plan.lengths):3d} (longest "
                f"{max(plan.lengths)})  cp sizes {sizes}  waves {st['waves']}  measured "
                f"{seconds:.2f} s (micro-batches {busy_all.max():.2f} s{mbs})  predicted "
                f"{predicted:.2f} s ({profile}{version}, whole step)  "
                f"error {abs(predicted - seconds) / seconds:.1%}",
                flush=True,
            )
        step += 1
        if step == args.steps:
            break
    sampler.close()
    if rank == 0:
        k = max(1, len(curve) // 5)
        print(
            f"loss: first {k} steps {np.mean(curve[:k]):.4f} -> last {k} steps "
            f"{np.mean(curve[-k:]):.4f}; {time.perf_counter() - start:.1f} s in all"
        )
        if calib is not None:
            print(calib.summary())
        wanted = ("dyncp_last_step", "dyncp_tokens_total", "dyncp_microbatches_total")
        print("metrics (Prometheus exposition, excerpt):")
        for line in metrics.exposition().decode().splitlines():
            if line.startswith(wanted) and f'policy="{planner.policy}"' in line:
                print("  " + line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
