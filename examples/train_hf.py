"""Train a Hugging Face causal LM (transformers) under dynamic CP.

    torchrun --nproc-per-node 2 examples/train_hf.py --steps 5                 # tiny Llama, CPU
    torchrun --nproc-per-node 4 examples/train_hf.py --family qwen3 --max-length 2048  # CP 1, 2, 4
    torchrun --nproc-per-node 8 examples/train_hf.py --backend nccl --config /path/to/model_dir
    torchrun --nproc-per-node 2 examples/train_hf.py --sampler --steps 5       # DynamicCPSampler

The model is built from a config, without downloading weights: a tiny Llama or Qwen3 config
(``--family``), or the ``config.json`` in a local directory (``--config``). Its attention
implementation is dyncp's ring attention (``dyncp.integrations.hf``); everything else is the
model's own code. Every rank plans each step with the same deterministic dyncp planner,
executes its share with ``runtime.execute`` (``causal_lm_loss`` shards tokens, position ids and
shifted labels with the zigzag layout), reduces the gradients over the DP x CP axis and steps
the optimiser. Rank 0 prints the loss, the CP sizes used, the measured and predicted step time;
``--metrics-port`` serves the Prometheus metrics from rank 0. Document lengths come from a
bundled real distribution (truncated to ``--max-length``; each step's line says how many of its
documents were), tokens are random.

``--sampler``: the steps come from ``DynamicCPSampler`` instead (seeded global batches of the
dataset, every sample exactly once per epoch, plans from its lookahead thread; the same
deterministic planner on every rank). Each step's plan reaches the loop through ``on_step`` and
runs with ``runtime.execute``; the sampler's own micro-batches mark the step boundaries, and
``ctx.sample_ids`` name the dataset rows each micro-batch packs.

The prediction is of the whole step, calibrated online by default
(``dyncp.runtime.whole_step.WholeStepCalibration``): the micro-batches' cost model is refitted
from their measured times (the same model version on every rank; without ``--sampler`` the
planner moves to it) and the part of the step outside micro-batches (gradient reduction,
optimizer, the rest) is fitted from the step's wall clock minus the busiest rank's busy time.
Each step is predicted before it is learnt from. Rank 0 names the profile it started from,
prints each step's error and, at the end, what calibration changed. ``--no-calibrate`` keeps
the starting profile, to compare.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import transformers

from dyncp.cost_model import CostModel
from dyncp.cost_model.schema import load_profile
from dyncp.data import load_lengths, resolve_dataset
from dyncp.integrations.hf import causal_lm_loss, plan_check, register_ring_attention
from dyncp.observability import Metrics
from dyncp.planner import Planner, VersionedPlanner
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.runtime.whole_step import WholeStepCalibration
from dyncp.sampler import DynamicCPSampler
from dyncp.sim.replay import admit, draw_batch_indices
from dyncp.testing.hf_models import FAMILIES, tiny_config


def build_config(args: argparse.Namespace) -> transformers.PretrainedConfig:
    if args.config is not None:
        return transformers.AutoConfig.from_pretrained(args.config)  # a local directory
    return tiny_config(
        args.family, vocab=256, hidden=64, max_positions=max(2048, 2 * args.max_length)
    )


def steps(args, planner, lengths, config, world: int, rank: int):
    """``(plan, tokens, rows)`` per step: ``tokens(i)`` is sequence i of the plan (or dataset
    row i); ``rows`` are the dataset rows of the plan's sequences, in order.

    Tokens are random but a pure function of the row (or step and sequence), so every rank
    sees the same data without communication.
    """

    def row_tokens(i: int, salt: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + salt * 7_919 + int(i))
        return torch.randint(0, config.vocab_size, (int(lengths[i]),), generator=gen)

    if not args.sampler:
        batches = draw_batch_indices(
            lengths, steps=args.steps, seed=args.seed, global_batch_tokens=args.global_batch_tokens
        )
        for step, rows in enumerate(batches):
            batch = lengths[rows]
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            tokens = [torch.randint(0, config.vocab_size, (int(s),), generator=gen) for s in batch]
            yield planner.plan(batch), tokens.__getitem__, rows
        return
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
    done = 0
    for mb in sampler:  # this rank's micro-batches; execute runs them, they mark the steps
        if mb.meta.last_in_step:
            plan = plans.pop((mb.meta.epoch, mb.meta.step))
            yield plan, row_tokens, np.asarray(plan.sample_ids, dtype=np.int64)
            done += 1
            if done == args.steps:
                break
    sampler.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--config", default=None, help="local directory with a model's config.json")
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--capacity", type=int, default=512, help="tokens per rank per micro-batch")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--global-batch-tokens", type=int, default=4096)
    p.add_argument(
        "--profile",
        default=None,
        help="cost-model profile; default on gloo: cpu-gloo (2 processes) or cpu-gloo-4proc (4)",
    )
    p.add_argument("--backend", default="gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics")
    p.add_argument("--sampler", action="store_true", help="take the steps from DynamicCPSampler")
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="predict with the starting profile only (default: calibrate online)",
    )
    args = p.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.profile is None:
        cpu = "cpu-gloo-4proc" if world == 4 else "cpu-gloo"
        args.profile = cpu if args.backend == "gloo" else "h100-reference"
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if args.backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    pool = GroupPool()
    profile = load_profile(args.profile)
    planner = Planner(
        CostModel(profile, ranks_per_node=per_node),
        world=world,
        ranks_per_node=per_node,
        capacity=args.capacity,
        deterministic=True,
        cpsat=None,
        step_parts=True,  # the whole step's parts, printed below
    )  # identical on every rank
    metrics = None
    if rank == 0 and args.metrics_port is not None:  # step metrics once per job, from rank 0
        metrics = Metrics(cp_sizes=planner.topology.group_sizes)
        print(f"metrics at {metrics.serve(port=args.metrics_port).url}")

    # The lines a user changes: register the ring, build the model with it.
    attn = register_ring_attention()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = build_config(args)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model = model.to(device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calib = None
    if args.calibrate:  # the reduction and AdamW priced for this model's parameters
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        calib = WholeStepCalibration(
            pool, profile, ranks_per_node=per_node, integration="ddp", parameters=trained
        )
        if not args.sampler:  # the sampler's lookahead thread keeps its own planner
            planner = VersionedPlanner(planner, calib.current)
    if rank == 0:
        how = "calibrating online (--no-calibrate to compare)" if calib else "not calibrating"
        print(f"cost model: profile {args.profile} ({profile.provenance.source}); {how}")

    raw = load_lengths(resolve_dataset(args.dataset))
    lengths, admission = admit(raw, args.max_length, "truncate")
    if rank == 0:
        print(
            f"{type(model).__name__} ({attn}), {world} ranks, {pool}; dataset {args.dataset}: "
            f"{len(raw)} documents, {admission.overlong_documents} of them longer than "
            f"--max-length {args.max_length} (truncated to it when a step draws them)"
        )
    check = plan_check(model)  # e.g. head splits with sliding-window layers: refused up front
    for step, (plan, tokens, rows) in enumerate(steps(args, planner, lengths, config, world, rank)):
        batch = plan.lengths
        truncated = int((raw[rows] > args.max_length).sum())
        losses = []

        def step_fn(ctx, tokens=tokens, losses=losses) -> None:
            ids = ctx.seq_ids if ctx.sample_ids is None else ctx.sample_ids
            packed = torch.cat([tokens(i) for i in ids]).to(device)
            loss = causal_lm_loss(model, ctx, packed)  # summed token loss * ctx.loss_scale
            loss.backward()
            losses.append(loss.detach())

        start = time.perf_counter()
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        report = execute(plan, pool, step_fn, synchronize=sync, plan_check=check)
        reduce_gradients(model, pool=pool)  # SUM over the DP x CP axis; names a failed rank
        optim.step()
        optim.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        loss = reduce_loss(losses, device=device)
        busy = torch.tensor([report.busy_seconds], device=device)
        all_busy = [torch.zeros_like(busy) for _ in range(world)]
        dist.all_gather(all_busy, busy)
        busy_all = np.array([b.item() for b in all_busy])
        seen = None
        if calib is not None:  # collective: every rank, every step
            seen = calib.step(plan, report, step_seconds=seconds, busiest_seconds=busy_all.max())
            if seen.new_version is not None and not args.sampler:
                planner = VersionedPlanner.rebuild(planner, seen.new_version)
        if metrics is not None:
            metrics.observe_step(plan)
            metrics.observe_measured_step(
                policy=plan.policy,
                step_seconds=seconds,
                rank_busy_seconds=busy_all,
                predicted_step_seconds=plan.stats["predicted_step_seconds"],
            )
        if rank == 0:
            st = plan.stats
            sizes = sorted(set(plan.cp_of_sequences().values()))
            predicted = st["step_parts"]["total"] if seen is None else seen.predicted_seconds
            version = "" if calib is None else f" v{calib.current.version}"
            mbs = "" if seen is None else f" predicted {seen.predicted_busy_seconds:.3f} s"
            print(
                f"step {step}: loss {loss.item():.4f}  docs {len(batch)} ({truncated} truncated)  "
                f"waves {st['waves']}  "
                f"cp sizes {sizes}  measured {seconds:.3f} s (busiest rank in micro-batches "
                f"{busy_all.max():.3f} s{mbs})  predicted "
                f"{predicted:.3f} s ({args.profile}{version}, whole step)  error "
                f"{abs(predicted - seconds) / seconds:.1%}  imbalance measured "
                f"{busy_all.max() / busy_all.mean():.3f} predicted {st['imbalance']:.3f}"
            )
    if rank == 0 and calib is not None:
        print(calib.summary())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
