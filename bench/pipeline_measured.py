"""Measured against predicted pipelined steps on CPU gloo processes, before and after calibration.

    python bench/pipeline_measured.py                        # PP 2 x DP-CP 2 (4 processes), 1F1B
    python bench/pipeline_measured.py --columns 4            # PP 2 x DP-CP 4 (8 processes)
    python bench/pipeline_measured.py --virtual 2 --layers 4 # interleaved, 2 virtual stages

The real path end to end: the deterministic ``Planner(pipeline=Pipeline(2, V))`` plans batches
of Wikipedia document lengths (``--dataset``, split at ``--max-length``) under the bundled
``cpu-gloo`` profile (measured on this kind of machine, 2 processes, the tiny decoder in fp32);
``execute_pipeline`` runs each plan on ``2 x columns`` spawned gloo processes with the tiny
decoder of that profile's shape (``dyncp.testing.tiny_chunks``, fp32; ``--layers`` other than
the profile's 2 is a model the profile was not measured on, which calibration must learn);
``dyncp.runtime.pipeline_measure`` reads every process's timeline.

Per step it prints the measured step (the grid's wall clock) and bubble fraction, and the
predicted ones (``price_pipeline``) under the profile as bundled (``before``: its ring link
prices the hand-offs) and after calibration (``after``:
``dyncp.cost_model.calibration.pipeline.calibrate_pipeline``, the ordinary refit on the
operations summed per micro-batch, plus the hand-off link fitted to the measured hand-offs).
Two diagnostics say where the error is: ``replay`` prices the step's *measured* operations
through the pricing's schedule (its dependency graph and the fitted hand-offs): the schedule
model's own error, without the cost model's; ``speed`` is the calibrated model's compute over
the measured compute of that step (1 = as predicted): how much the machine's speed moved
from step to step (the other users' load), which no profile can know in advance.

Held out: the refit sees every other measured step (even ones; ``--holdout tail``: the first
half) and ``after`` is judged on the others. Alternating is the default because the machine is
shared: the other engineers' load comes and goes over tens of seconds, and a first-half fit
judged on the second half then also measures how the load moved in between. The summary line
gives mean |predicted / measured - 1| of the step on the held-out steps, before and after,
and the bubble's mean measured and predicted values.

The first ``--warmup`` steps (lazy connections, allocator) are run and not measured. The
processes share the machine's cores: 4 processes on 2 cores run about half as fast as the
profile's 2, which is what calibration is for; the load average is printed with the results.
Nothing here says anything about a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel, Profile, load_profile
from dyncp.cost_model.calibration.pipeline import calibrate_pipeline, predict_step
from dyncp.cost_model.pipeline_schedule import schedule
from dyncp.cost_model.pipeline_timing import stage_costs
from dyncp.data.readers import load_lengths
from dyncp.plan import Pipeline, StepPlan
from dyncp.planner import Planner
from dyncp.sim.replay import admit, draw_batches


def tiny_config(layers: int) -> dict:
    """The shape of the ``cpu-gloo`` profile's model, with ``layers`` layers."""
    return {"vocab": 256, "dim": 64, "heads": 4, "kv_heads": 2, "layers": layers, "ffn": 128}


def bench_profile(layers: int) -> Profile:
    """``cpu-gloo``, its model given ``layers`` layers (its times are still those of its 2: the
    refit learns the rest)."""
    profile = load_profile("cpu-gloo")
    if layers == profile.model.num_layers:
        return profile
    shape = profile.model.model_copy(update={"num_layers": layers})
    return profile.model_copy(update={"model": shape})


def make_plans(args: argparse.Namespace) -> list[StepPlan]:
    lengths = load_lengths(Path(args.datasets) / f"{args.dataset}.parquet")
    lengths, _ = admit(lengths, args.max_length, "split")
    tokens = int(args.step_tokens * args.columns * args.capacity)
    planner = Planner(
        CostModel(bench_profile(args.layers), args.columns),
        world=args.columns,
        ranks_per_node=args.columns,
        capacity=args.capacity,
        max_length=args.max_length,
        pipeline=Pipeline(2, args.virtual),
        bound="simple",
        deterministic=True,
        cpsat=None,
    )
    steps = args.warmup + args.steps
    batches = draw_batches(lengths, steps=steps, seed=args.seed, global_batch_tokens=tokens)
    return [planner.plan([int(x) for x in b]) for b in batches]


def main(argv: list[str] | None = None) -> None:
    from dyncp.testing import measured_steps
    from dyncp.testing.distributed import run_gloo

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--columns", type=int, default=2, help="DP x CP ranks per stage")
    parser.add_argument("--virtual", type=int, default=1, help="virtual stages per process")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (profile's: 2)")
    parser.add_argument("--datasets", default="../shared/datasets")
    parser.add_argument("--dataset", default="wikipedia_flexsp")
    parser.add_argument("--capacity", type=int, default=512, help="tokens a rank a micro-batch")
    parser.add_argument("--max-length", type=int, default=1024, help="longer documents split")
    parser.add_argument("--step-tokens", type=float, default=4.0, help="x columns x capacity")
    parser.add_argument("--steps", type=int, default=16, help="measured steps")
    parser.add_argument("--holdout", choices=("alternate", "tail"), default="alternate")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error(f"--steps must be >= 4 (half of them are held out), got {args.steps}")
    print("python bench/pipeline_measured.py " + " ".join(sys.argv[1:] if argv is None else argv))
    plans = make_plans(args)
    world = 2 * args.columns
    load0 = os.getloadavg()[0]
    measured = run_gloo(
        measured_steps,
        world=world,
        args=([p.to_json() for p in plans], args.columns, tiny_config(args.layers)),
        timeout=900,
        pg_timeout=120.0,
    )[0][0][args.warmup :]
    plans = plans[args.warmup :]
    load1 = os.getloadavg()[0]
    profile = bench_profile(args.layers)
    before = CostModel(profile, args.columns)
    nq = plans[0].pipeline.model_stages
    held = [k % 2 == 1 if args.holdout == "alternate" else k >= args.steps // 2
            for k in range(len(measured))]  # fmt: skip
    seen = [m for m, h in zip(measured, held) if not h]
    cal = calibrate_pipeline(profile, seen, model_stages=nq, ranks_per_node=args.columns)
    after = CostModel(cal.profile, args.columns)
    (lat, bw), _ = cal.p2p
    print(
        f"PP 2 x DP-CP {args.columns} ({world} processes), V={args.virtual}, {args.layers} "
        f"layers; load average {load0:.2f} before, {load1:.2f} after the run ({os.cpu_count()} "
        f"cores); hand-off fitted: latency {lat * 1e6:.0f} us, bandwidth "
        f"{'unresolved (transfers too small)' if bw > 1e15 else f'{bw / 1e9:.2f} GB/s'} "
        f"from {sum(len(m.hops) for m in seen)} hand-offs"
    )
    print(
        f"{'step':>4} {'set':5} {'slots':>5} {'meas ms':>8} {'before':>8} {'after':>8} "
        f"{'replay':>8} {'speed':>6} {'b.meas':>6} {'b.bef':>6} {'b.aft':>6}"
    )
    rows = []
    for k, (plan, m) in enumerate(zip(plans, measured)):
        pb = predict_step(plan, before)
        pa = predict_step(plan, after, cal.p2p)
        costs = stage_costs(plan, after, p2p=cal.p2p)
        replay = schedule(dataclasses.replace(costs, forward=m.forward, backward=m.backward))
        speed = (costs.forward.sum() + costs.backward.sum()) / (m.forward.sum() + m.backward.sum())
        rows.append(
            (held[k], m.step_seconds, pb.step_seconds, pa.step_seconds, m.bubble_fraction,
             pb.bubble_fraction, pa.bubble_fraction, replay.step_seconds, speed)
        )  # fmt: skip
        print(
            f"{k:4d} {'held' if held[k] else 'fit':5} {len(plan.waves):5d} "
            f"{m.step_seconds * 1e3:8.1f} {pb.step_seconds * 1e3:8.1f} "
            f"{pa.step_seconds * 1e3:8.1f} {replay.step_seconds * 1e3:8.1f} {speed:6.2f} "
            f"{m.bubble_fraction:6.3f} {pb.bubble_fraction:6.3f} "
            f"{pa.bubble_fraction:6.3f}"
        )
    a = np.asarray([r[1:] for r in rows if r[0]])
    err_before, err_after = np.abs(a[:, 1] / a[:, 0] - 1), np.abs(a[:, 2] / a[:, 0] - 1)
    err_replay = np.abs(a[:, 6] / a[:, 0] - 1)
    print(
        f"held-out steps ({len(a)}): mean |pred/meas - 1| before {err_before.mean():.3f}, after "
        f"{err_after.mean():.3f} (max {err_after.max():.3f}); bubble measured "
        f"{a[:, 3].mean():.3f}, predicted before {a[:, 4].mean():.3f}, after {a[:, 5].mean():.3f}"
    )
    print(
        f"schedule replay of the measured operations: mean |replay/meas - 1| "
        f"{err_replay.mean():.3f}; speed (predicted / measured compute) over the held-out steps "
        f"{a[:, 7].min():.2f}..{a[:, 7].max():.2f} (spread {a[:, 7].std() / a[:, 7].mean():.3f})"
    )


if __name__ == "__main__":
    main()
