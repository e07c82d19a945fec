"""Planner benchmark: plan quality and latency of every policy on the shared length data.

    python bench/planner_bench.py [--steps 100] [--large-steps 20] [--data ../shared/datasets]

For each dataset (the full shared parquet files when ``--data`` holds them, else the bundled
20,000-document samples) and each size -- 512 sequences on 64 ranks, 4096 sequences on 512
ranks (8 per node, capacity 8192 tokens per rank, h100-reference profile) -- it plans the same
seeded batches with every policy and prints: mean predicted step seconds, mean and max gap to
the lower bound, speedup vs static and vs megatron (ratios of mean step seconds, same batches),
plan latency p50/p99 on this machine. ``dyncp`` is the default pipeline (time_limit 0.1 s: the
greedy constructor; CP-SAT only when time is left); ``dyncp+cpsat`` gives CP-SAT a longer
deadline (1 s at 512 sequences, 2 s at 4096), as the plan service's lookahead allows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.datasets import load_lengths, resolve_dataset
from dyncp.planner import Planner
from dyncp.sim.replay import admit, draw_batches

CAPACITY = 8192
MAX_LENGTH = 131072
SIZES = ((64, 512), (512, 4096))
FILES = {"wikipedia": "wikipedia_flexsp.parquet", "wlbllm": "wlbllm_distca.parquet"}


def planners(model: CostModel, world: int, long_limit: float) -> dict[str, Planner]:
    common = dict(world=world, ranks_per_node=8, capacity=CAPACITY, max_length=MAX_LENGTH)
    out = {p: Planner(model, policy=p, **common) for p in ("static", "batch-adaptive", "megatron")}
    out["dyncp"] = Planner(model, policy="dyncp", time_limit=0.1, **common)
    out["dyncp+cpsat"] = Planner(model, policy="dyncp", time_limit=long_limit, **common)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="batches at 512 sequences")
    parser.add_argument("--large-steps", type=int, default=20, help="batches at 4096 sequences")
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = CostModel.load("h100-reference", ranks_per_node=8)
    for name, file in FILES.items():
        path = args.data / file
        source = path if path.exists() else resolve_dataset(name)
        lengths, admission = admit(load_lengths(source), MAX_LENGTH, "truncate")
        print(f"\n=== {name}: {source} ({len(lengths)} documents; {admission.summary()})")
        for world, n in SIZES:
            steps = args.steps if n == 512 else args.large_steps
            batches = list(draw_batches(lengths, steps=steps, seed=args.seed, global_batch_size=n))
            runs = planners(model, world, 1.0 if n == 512 else 2.0)
            rows = {}
            for policy, planner in runs.items():
                secs, gaps, lat = [], [], []
                t0 = time.perf_counter()
                for batch in batches:
                    plan = planner.plan(batch)
                    secs.append(plan.stats["predicted_step_seconds"])
                    gaps.append(plan.stats["gap_to_lower_bound"])
                    lat.append(plan.stats["timings"]["plan_seconds"])
                rows[policy] = (
                    np.mean(secs),
                    np.mean(gaps),
                    np.max(gaps),
                    lat,
                    time.perf_counter() - t0,
                    dict(planner.solver_status_counts),
                )
            print(f"--- {n} sequences / {world} ranks, {steps} batches")
            print(
                f"{'policy':<15}{'step s':>8}{'gap':>8}{'max gap':>9}{'vs static':>10}"
                f"{'vs megatron':>12}{'p50 ms':>9}{'p99 ms':>9}  solver outcomes"
            )
            for policy, (mean, gap, gmax, lat, _, status) in rows.items():
                print(
                    f"{policy:<15}{mean:>8.3f}{gap:>8.1%}{gmax:>9.1%}"
                    f"{rows['static'][0] / mean:>9.3f}x{rows['megatron'][0] / mean:>11.3f}x"
                    f"{np.percentile(lat, 50) * 1e3:>9.1f}{np.percentile(lat, 99) * 1e3:>9.1f}"
                    f"  {status if status else ''}"
                )


if __name__ == "__main__":
    main()
