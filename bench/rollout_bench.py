"""Rollout benchmark: dynamic CP against static CP on GRPO rollout batches, and plan latency.

    python bench/rollout_bench.py [--steps 3] [--world 32] [--time-limit 0.1] [--deterministic]
    python bench/rollout_bench.py --overlap [--overlap-steps 10]     # 2 gloo ranks, CPU

Part 1 (cost model only; h100-reference, 8 ranks per node, capacity 8192 tokens per rank): for
rollout-length scenarios (``dyncp.testing.rollouts.RolloutLengths``: prompt groups of correlated,
log-normal response lengths capped at ``--max-response``; medians from short early-training
responses to long reasoning ones, two intra-group spreads) it plans ``--steps`` batches with
static CP (one CP size for every sequence: the smallest that holds the longest possible rollout)
and with dyncp (the anytime planner, ``--time-limit``), and prints the predicted step times, their
ratio, and the planner's wall time against the dyncp step time. ``--deterministic`` adds the
deterministic planner's time (what every rank would spend when each plans alone).

Part 2 (``--overlap``): runs ``examples/grpo_rollouts.py`` on 2 gloo ranks twice, planning after
the previous step trains (``--serial``) and overlapped with it, and prints the exposed wait for
the plan against the planning time in both runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.planner import Planner
from dyncp.testing.rollouts import RolloutLengths

CAPACITY = 8192
SCENARIOS = {  # name: (median response, within-group sigma)
    "early  (median 1k)": (1024, 0.5),
    "mid    (median 4k)": (4096, 0.5),
    "late   (median 8k)": (8192, 0.5),
    "mid, wide groups  ": (4096, 0.9),
}


def predicted(args: argparse.Namespace) -> None:
    model = CostModel.load("h100-reference", ranks_per_node=8)
    common = dict(world=args.world, ranks_per_node=8, capacity=CAPACITY)
    print(
        f"{args.world} ranks (8 per node), capacity {CAPACITY} tokens per rank, h100-reference; "
        f"{args.prompts} prompts x {args.group_size} rollouts, responses capped at "
        f"{args.max_response}; {args.steps} steps per scenario; dyncp time limit "
        f"{args.time_limit} s"
    )
    print(
        f"{'scenario':20} {'tokens':>9} {'p50':>6} {'p99':>6} {'at cap':>7} {'static s':>9} "
        f"{'dyncp s':>8} {'gain':>6} {'plan ms':>8} {'plan/step':>9}"
        + (f" {'determ. s':>9}" if args.deterministic else "")
    )
    for name, (median, sigma) in SCENARIOS.items():
        gen = RolloutLengths(
            prompts=args.prompts,
            group_size=args.group_size,
            median_response=median,
            within_sigma=sigma,
            max_response=args.max_response,
        )
        static = Planner(model, **common, policy="static", max_length=gen.max_length)
        dyn = Planner(model, **common, time_limit=args.time_limit)
        det = Planner(model, **common, deterministic=True, cpsat=None)
        rng = np.random.default_rng(args.seed)
        rows = []
        for _ in range(args.steps):
            _, prompt, response = gen.draw_parts(rng)
            lengths = prompt + response
            base = static.plan(lengths).stats["predicted_step_seconds"]
            start = time.perf_counter()
            plan = dyn.plan(lengths)
            wall = time.perf_counter() - start
            det_wall = np.nan
            if args.deterministic:
                start = time.perf_counter()
                det.plan(lengths)
                det_wall = time.perf_counter() - start
            capped = np.mean(response == args.max_response)
            rows.append(
                (lengths, base, plan.stats["predicted_step_seconds"], wall, det_wall, capped)
            )
        lengths = np.concatenate([r[0] for r in rows])
        base, dyn_s, wall, det_wall, capped = (np.array([r[k] for r in rows]) for k in range(1, 6))
        print(
            f"{name:20} {lengths.sum() / args.steps:9.0f} {np.percentile(lengths, 50):6.0f} "
            f"{np.percentile(lengths, 99):6.0f} {capped.mean():7.1%} {base.mean():9.3f} "
            f"{dyn_s.mean():8.3f} {base.sum() / dyn_s.sum():5.3f}x {np.median(wall) * 1e3:8.1f} "
            f"{(wall / dyn_s).max():9.4f}"
            + (f" {np.median(det_wall):9.2f}" if args.deterministic else "")
        )
    print(
        "gain = static CP predicted step time / dyncp predicted step time (sum over steps); "
        "plan/step = the planner's wall time / the dyncp step time (worst step); at cap = share "
        "of rollouts cut at the response cap"
    )


SUMMARY = re.compile(
    r"planning over steps 1..: plan ([\d.]+) ms, exposed wait ([\d.]+) ms .* per step of ([\d.]+) s"
)


def overlap(args: argparse.Namespace) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "grpo_rollouts.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = {}
    for mode in ("serial", "overlapped"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(example),
            "--steps",
            str(args.overlap_steps),
        ]
        run = subprocess.run(
            cmd + (["--serial"] if mode == "serial" else []),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        match = SUMMARY.search(run.stdout)
        if match is None:
            raise RuntimeError(f"no summary in the example's output:\n{run.stdout}{run.stderr}")
        out[mode] = tuple(float(g) for g in match.groups())
        plan, wait, step = out[mode]
        print(
            f"{mode:10}: plan {plan:6.1f} ms  exposed wait {wait:6.1f} ms "
            f"({wait / plan:5.1%} of planning)  step {step * 1e3:6.1f} ms"
        )
    s, o = out["serial"], out["overlapped"]
    print(
        f"exposed wait overlapped / serial: {o[1] / s[1]:.3f}; step time overlapped / serial: "
        f"{o[2] / s[2]:.3f} (2 gloo ranks, tiny decoder, {args.overlap_steps} steps)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response", type=int, default=16384)
    p.add_argument("--time-limit", type=float, default=0.1)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--overlap-steps", type=int, default=10)
    args = p.parse_args()
    if args.overlap:
        overlap(args)
    else:
        predicted(args)


if __name__ == "__main__":
    main()
