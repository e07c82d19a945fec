"""Measured end to end: static, megatron and dyncp training steps of the same batches, run for real.

    python bench/e2e_bench.py                        # whole steps, 2 gloo processes x 1 thread
    python bench/e2e_bench.py --micro-batches-only   # execute() alone (forward + backward)
    python bench/e2e_bench.py --world 4              # oversubscribed on a 2-core machine: labelled

The same seeded global batches of real document lengths (bundled Wikipedia sample, truncated to
``--max-length``) go through the tiny decoder of ``profiles/cpu-gloo``, once per policy, the
policies interleaved run by run so that machine drift hits them alike. A measured step is a
whole training step, as a user's loop runs it: ``runtime.execute`` (forward + backward of every
micro-batch over gloo rings, the waves' synchronisations), ``runtime.reduce_gradients`` (the
gradients SUMmed over the DP x CP ranks) and an AdamW step; its time is the slowest rank's wall
clock, the median of ``--repeats`` runs. Its prediction is the whole step's parts
(``dyncp.cost_model.step_parts``: the planned micro-batches plus the gradient reduction, the
optimizer and the fixed part, from the profile's ``step``). ``--micro-batches-only`` times
``execute`` alone against the planned micro-batches (``predicted_step_seconds``). Three phases:

1. warm-up (not reported; AdamW allocates its moments here);
2. **before**: plans priced (and, for dyncp, chosen) with the profile as shipped; every step
   feeds ``WholeStepCalibration``, the production path: the micro-batch timings go through
   ``CollectiveCalibration`` (gathered to rank 0, refit, the adopted version broadcast to every
   rank at a step boundary) and the step's wall clock minus its busiest rank's micro-batch time
   through ``StepFit`` (the per-step fixed part);
3. **after**: the same batches re-planned with the calibrated model and run again, predicted with
   it and the fitted fixed part (both frozen: the predictions are out of sample).

Printed per phase and policy: mean measured and predicted step seconds, their error, and the
speedups of dyncp over static and megatron, measured next to predicted, with the ratio
predicted / measured of each speedup; and the load average before and after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.calibration import ModelVersion
from dyncp.cost_model.calibration.step_fit import whole_step_seconds
from dyncp.data import load_lengths, resolve_dataset
from dyncp.planner import Planner, VersionedPlanner
from dyncp.runtime import GroupPool, execute, reduce_gradients
from dyncp.runtime.whole_step import WholeStepCalibration
from dyncp.sim.replay import admit, draw_batches
from dyncp.testing import TinyConfig, TinyDecoder, microbatch_loss
from dyncp.testing.distributed import run_gloo

POLICIES = ("static", "megatron", "dyncp")


def _planners(model: CostModel, args: argparse.Namespace, world: int) -> dict[str, Planner]:
    return {
        name: Planner(
            model,
            world=world,
            ranks_per_node=world,
            capacity=args.capacity,
            policy=name,
            max_length=args.max_length,
            deterministic=True,
            cpsat=None,
            step_parts=True,
        )
        for name in POLICIES
    }


def _timed_run(plan, pool, model, optim, tokens, args) -> tuple[float, float, object]:
    """One step: the slowest rank's wall clock, the busiest rank's micro-batch busy time and
    this rank's report. A step is execute() + the gradient all-reduce + AdamW
    (``--micro-batches-only``: execute() alone)."""

    def step_fn(ctx) -> None:
        packed = torch.cat([tokens[i] for i in ctx.seq_ids])
        microbatch_loss(model, ctx, packed, kernel="auto").backward()

    pool.barrier()
    t0 = time.perf_counter()
    report = execute(plan, pool, step_fn)
    if not args.micro_batches_only:
        reduce_gradients(model, pool=pool)  # SUM over the DP x CP axis, as a trainer does
        optim.step()
    optim.zero_grad(set_to_none=True)
    t = torch.tensor([time.perf_counter() - t0, report.busy_seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1]), report


def _timed_batch(plans: dict, pool, model, optim, tokens, args) -> dict:
    """Each policy's medians over ``--repeats`` runs (wall clock, busiest busy time) and last
    report, the policies taken in turn run by run: a burst of load on a shared machine lands
    on every policy alike, not on the one that happened to be running."""
    runs: dict[str, list] = {name: [] for name in plans}
    for _ in range(args.repeats):
        for name, plan in plans.items():
            runs[name].append(_timed_run(plan, pool, model, optim, tokens, args))
    return {
        name: (
            statistics.median(r[0] for r in got),
            statistics.median(r[1] for r in got),
            got[-1][2],
        )
        for name, got in runs.items()
    }


def _predicted(plan, args, fixed: float) -> float:
    """The step's prediction: the planned micro-batches (``--micro-batches-only``), or the
    whole step's parts with the per-step fixed part ``fixed`` in place of the profile's."""
    if args.micro_batches_only:
        return plan.stats["predicted_step_seconds"]
    return whole_step_seconds(plan.stats["step_parts"], fixed)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    pool = GroupPool()
    profile = load_profile(args.profile)
    shape = profile.model
    cfg = TinyConfig(
        vocab=shape.vocab_size,
        dim=shape.hidden_size,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        layers=shape.num_layers,
        ffn=shape.ffn_hidden_size,
    )
    torch.manual_seed(0)
    model = TinyDecoder(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths, _ = admit(load_lengths(resolve_dataset(args.dataset)), args.max_length, "truncate")
    batches = list(
        draw_batches(
            lengths,
            steps=args.warmup + args.steps,
            seed=args.seed,
            global_batch_tokens=args.global_batch_tokens,
        )
    )
    gen = torch.Generator().manual_seed(args.seed)
    tokens = [[torch.randint(0, cfg.vocab, (int(s),), generator=gen) for s in b] for b in batches]
    calib = WholeStepCalibration(
        pool, profile, ranks_per_node=world, refit_every=args.refit_every, min_measurements=16
    )
    calibrator, loop = calib.calibrator, calib.collective
    version = ModelVersion(0, profile)
    fixed = calib.fixed.fixed
    planners = _planners(CostModel(profile, world), args, world)
    rows: list[dict] = []
    for phase in ("warmup", "before", "after"):
        if phase == "after":  # re-plan with the calibrated model, identical on every rank
            version = loop.current
            planners = _planners(version.model(world), args, world)
            fixed = calib.fixed.fixed  # the fitting rank's (rank 0's, whose rows are reported)
        span = range(args.warmup) if phase == "warmup" else range(args.warmup, len(batches))
        for b in span:
            order = POLICIES[b % 3 :] + POLICIES[: b % 3]
            plans = {n: VersionedPlanner(planners[n], version).plan(batches[b]) for n in order}
            timed = _timed_batch(plans, pool, model, optim, tokens[b], args)
            for name, plan in plans.items():
                seconds, busiest, report = timed[name]
                online = None
                if phase == "before":  # collective: measurements -> refits -> version, fixed
                    seen = calib.step(plan, report, step_seconds=seconds, busiest_seconds=busiest)
                    online = seen.predicted_seconds
                parts = plan.stats["step_parts"]
                rows.append(
                    {
                        "phase": phase,
                        "batch": b,
                        "policy": name,
                        "measured": seconds,
                        "busiest": busiest,
                        "predicted": _predicted(plan, args, fixed),
                        "predicted_planned": plan.stats["predicted_step_seconds"],
                        "predicted_online": online,
                        "step_parts": parts,
                        "fitted_fixed": fixed,
                        "model_version": plan.stats["model_version"],
                        "waves": len(plan.waves),
                        "cp": sorted(set(plan.cp_of_sequences().values())),
                    }
                )
    result = {"rows": rows}
    if calibrator.last is not None:
        last = calibrator.last
        first = calibrator.history[0][0]
        result["calibration"] = {
            "first_error_before": first.error_before,
            "first_error_after": first.error_after,
            "first_measurements": first.measurements,
            "version": loop.current.version,
            "refits": calibrator.refits,
            "error_before": last.error_before,
            "error_after": last.error_after,
            "measurements": last.measurements,
            "outliers": last.outliers,
            "coefficients_before": last.coefficients_before,
            "coefficients_after": last.coefficients_after,
        }
        if rank == 0 and args.save_profile:
            calibrator.save(args.save_profile)
    result["step_fit"] = {
        "fixed_before": calib.fixed.initial_fixed,
        "fixed_after": calib.fixed.fixed,
        "adoptions": calib.fixed.adoptions,
        "refused": calib.fixed.refused,
    }
    return result


def _mean(rows: list[dict], phase: str, policy: str, key: str) -> float:
    return float(np.mean([r[key] for r in rows if r["phase"] == phase and r["policy"] == policy]))


def report(result: dict, args: argparse.Namespace, world: int) -> str:
    rows = result["rows"]
    cores = os.cpu_count() or 1
    label = "" if world <= cores else f"  [OVERSUBSCRIBED: {world} processes on {cores} cores]"
    what = (
        "micro-batches only: execute() vs the planned micro-batches"
        if args.micro_batches_only
        else "whole steps: execute() + gradient all-reduce + AdamW vs the whole step's parts"
    )
    out = [
        f"e2e bench: {world} gloo processes x 1 thread, profile {args.profile}, dataset "
        f"{args.dataset}, {args.steps} batches of {args.global_batch_tokens} tokens, capacity "
        f"{args.capacity}, max length {args.max_length}, median of {args.repeats} runs{label}",
        f"{what}; load average {result['load'][0]:.2f} before, {result['load'][1]:.2f} after",
    ]
    cal = result.get("calibration")
    if cal:
        out.append(
            f"calibration: {cal['refits']} refits, model v{cal['version']}; mean micro-batch "
            f"error {cal['first_error_before']:.1%} -> {cal['first_error_after']:.1%} at the "
            f"first refit ({cal['first_measurements']} micro-batches), "
            f"{cal['error_before']:.1%} -> {cal['error_after']:.1%} at the last "
            f"({cal['measurements']}, {cal['outliers']} outliers)"
        )
    fit = result["step_fit"]
    if not args.micro_batches_only:
        out.append(
            f"per-step fixed part (StepFit): {fit['fixed_before'] * 1e3:.2f} ms -> "
            f"{fit['fixed_after'] * 1e3:.2f} ms ({fit['adoptions']} adoptions, "
            f"{fit['refused']} steps refused)"
        )
    for phase in ("before", "after"):
        out.append(f"\n{phase} calibration")
        out.append(f"{'policy':<10}{'measured s':>12}{'predicted s':>13}{'error':>9}")
        for p in POLICIES:
            m, pr = _mean(rows, phase, p, "measured"), _mean(rows, phase, p, "predicted")
            out.append(f"{p:<10}{m:>12.4f}{pr:>13.4f}{pr / m - 1:>+9.1%}")
        for base in ("static", "megatron"):
            m = _mean(rows, phase, base, "measured") / _mean(rows, phase, "dyncp", "measured")
            pr = _mean(rows, phase, base, "predicted") / _mean(rows, phase, "dyncp", "predicted")
            out.append(
                f"dyncp/{base:<9} measured {m:.3f}x  predicted {pr:.3f}x  "
                f"predicted/measured {pr / m:.3f}"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--profile", default="cpu-gloo")
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--steps", type=int, default=12, help="batches per phase")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--global-batch-tokens", type=int, default=8192)
    p.add_argument("--refit-every", type=int, default=2, help="steps between refits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows and calibration here")
    p.add_argument("--save-profile", default=None, help="write the calibrated profile here")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument(
        "--micro-batches-only",
        action="store_true",
        help="time execute() alone against the planned micro-batches (no reduction, optimizer)",
    )
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be >= 2 (a ring needs two ranks)")
    start = time.perf_counter()
    load = os.getloadavg()[0]
    result = run_gloo(
        _worker, world=args.world, args=(args,), timeout=args.timeout, pg_timeout=600
    )[0]
    result["load"] = (load, os.getloadavg()[0])
    print(report(result, args, args.world))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result | {"args": vars(args)}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
