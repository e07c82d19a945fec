"""Train a tiny decoder-only transformer (RoPE, GQA, causal) under dynamic CP.

    torchrun --nproc-per-node 2 examples/train_tiny.py --steps 5            # CPU, gloo
    torchrun --nproc-per-node 2 examples/train_tiny.py --steps 40 --calibrate \
        --save-profile /tmp/calibrated.json                                 # online calibration
    torchrun --nproc-per-node 8 examples/train_tiny.py --backend nccl      # GPUs

Every rank plans each step with the same deterministic dyncp planner (identical plans on every
rank, no communication needed), executes its share with the runtime, reduces the gradients over
the DP x CP axis and steps the optimiser. Rank 0 prints the loss, the measured step time, the
cost model's predicted step time and the measured and predicted imbalance. Document lengths are
drawn from a bundled real distribution and truncated to ``--max-length``.

With ``--calibrate``, every step's measured micro-batches are gathered to rank 0, which refits the
cost model now and then (``dyncp.cost_model.calibration.OnlineCalibrator``); an adopted version
reaches every rank in the same collective, so all ranks re-plan with it from the next step on and
keep running one plan. ``--save-profile`` writes the calibrated profile at the end, so the next run
starts calibrated (``--profile PATH``).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model import CostModel
from dyncp.cost_model.calibration import ModelVersion, OnlineCalibrator
from dyncp.data import load_lengths, resolve_dataset
from dyncp.observability import Metrics
from dyncp.planner import Planner, VersionedPlanner
from dyncp.runtime import GroupPool, execute, reduce_gradients, reduce_loss
from dyncp.runtime.measure import CollectiveCalibration
from dyncp.sim.replay import admit, draw_batches
from dyncp.testing import TinyConfig, TinyDecoder, microbatch_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--capacity", type=int, default=512, help="tokens per rank per micro-batch")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--global-batch-tokens", type=int, default=4096)
    p.add_argument(
        "--profile",
        default=None,
        help="default on gloo: cpu-gloo (2 processes) or cpu-gloo-4proc (4), as measured",
    )
    p.add_argument("--backend", default="gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics")
    p.add_argument("--calibrate", action="store_true", help="refit the cost model while training")
    p.add_argument("--refit-every", type=int, default=2, help="steps between refits")
    p.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    p.add_argument(
        "--head-sizes",
        default="1",
        help="head-parallel degrees a group may split into, e.g. 1,2 (policy dyncp-hybrid)",
    )
    args = p.parse_args()
    head_sizes = tuple(int(u) for u in args.head_sizes.split(","))

    dist.init_process_group(args.backend)
    if args.profile is None:
        cpu = "cpu-gloo-4proc" if dist.get_world_size() == 4 else "cpu-gloo"
        args.profile = cpu if args.backend == "gloo" else "h100-reference"
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if args.backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    pool = GroupPool(head_sizes=head_sizes)
    model_cost = CostModel.load(args.profile, ranks_per_node=per_node)
    planner = Planner(
        model_cost,
        world=world,
        ranks_per_node=per_node,
        capacity=args.capacity,
        deterministic=True,
        cpsat=None,
        policy="dyncp" if head_sizes == (1,) else "dyncp-hybrid",
        head_sizes=head_sizes,
    )  # identical on every rank
    calibration = None
    if args.calibrate:
        calibrator = OnlineCalibrator(
            model_cost.profile,
            ranks_per_node=per_node,
            refit_every=args.refit_every,
            min_measurements=16,
        )
        calibration = CollectiveCalibration(pool, calibrator)
        planner = VersionedPlanner(planner, ModelVersion(0, model_cost.profile))
    metrics = None
    if rank == 0 and args.metrics_port is not None:  # step metrics once per job, from rank 0
        metrics = Metrics(policies=(planner.policy,), cp_sizes=planner.topology.group_sizes)
        print(f"metrics at {metrics.serve(port=args.metrics_port).url}")
    torch.manual_seed(args.seed)
    cfg = TinyConfig(vocab=256, dim=64, heads=4, kv_heads=2, layers=2, ffn=128)
    model = TinyDecoder(cfg).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths, admission = admit(
        load_lengths(resolve_dataset(args.dataset)), args.max_length, "truncate"
    )
    if rank == 0:
        print(f"{world} ranks, {pool}; {admission.summary()}")
    batches = draw_batches(
        lengths, steps=args.steps, seed=args.seed, global_batch_tokens=args.global_batch_tokens
    )
    gen = torch.Generator().manual_seed(args.seed)
    seen_refits = 0
    for step, batch in enumerate(batches):
        plan = planner.plan(batch)
        tokens = [torch.randint(0, cfg.vocab, (int(s),), generator=gen) for s in batch]
        losses = []

        def step_fn(ctx, tokens=tokens, losses=losses) -> None:
            packed = torch.cat([tokens[i] for i in ctx.seq_ids])
            loss = microbatch_loss(model, ctx, packed, kernel="auto")
            loss.backward()
            losses.append(loss.detach())

        start = time.perf_counter()
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        report = execute(plan, pool, step_fn, synchronize=sync)
        reduce_gradients(model, pool=pool)  # SUM over the DP x CP axis; names a failed rank
        optim.step()
        optim.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        loss = reduce_loss(losses, device=device)
        busy = torch.tensor([report.busy_seconds], device=device)
        all_busy = [torch.zeros_like(busy) for _ in range(world)]
        dist.all_gather(all_busy, busy)
        busy_all = np.array([b.item() for b in all_busy])
        new = None if calibration is None else calibration.step(plan, report)  # collective
        if new is not None:  # the same version on every rank, from the next step on
            planner = VersionedPlanner.rebuild(planner, new)
        if calibration is not None and calibration.calibrator.refits > seen_refits:
            seen_refits = calibration.calibrator.refits  # rank 0: a refit was tried this step
            result, adopted = calibration.calibrator.history[-1]
            print(
                f"  refit: mean micro-batch error {result.error_before:.1%} -> "
                f"{result.error_after:.1%} on {result.measurements} measurements "
                f"({result.outliers} outliers), {'adopted' if adopted else 'kept the model'}"
            )
            if metrics is not None:
                metrics.observe_calibration(
                    result, adopted=adopted, version=calibration.current.version
                )
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
            sizes = sorted({g.layout_name for _, g, _ in plan.microbatches()})
            print(
                f"step {step}: loss {loss.item():.4f}  docs {len(batch)}  waves {st['waves']}  "
                f"groups {sizes}  measured {seconds:.3f} s  "
                f"predicted {st['predicted_step_seconds']:.3f} s ({args.profile} "
                f"v{st.get('model_version', 0)})  imbalance "
                f"measured {busy_all.max() / busy_all.mean():.3f} predicted {st['imbalance']:.3f}"
            )
    if calibration is not None and calibration.is_fitter and args.save_profile:
        path = calibration.calibrator.save(args.save_profile)
        print(f"calibrated profile (model v{calibration.current.version}) written to {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
