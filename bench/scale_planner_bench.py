"""Planner latency at scale: ``plan()`` at 4,096 and 16,384 ranks, its parts, and its gap.

    python bench/scale_planner_bench.py [--worlds 4096 16384] [--time-limits 1 4 8] [--steps 1]
                                        [--profile h100-reference] [--data ../shared/datasets]
                                        [--digests FILE] [--digest-steps 5]

Per world (8 ranks per node, capacity 8192, 8 sequences per rank drawn from the Wikipedia
length file: 32,768 sequences on 4,096 ranks, 131,072 on 16,384) and ``time_limit``, for
``--steps`` batches, it prints the wall time of the whole ``plan()`` call against its
``time_limit`` (ratio), its CPU time (``time.process_time``: what the machine's load does not
inflate), the breakdown of ``stats["timings"]`` (construction, pricing, validation, the bound
when it ran inside the call), whether the tight bound was deferred (``Planner``'s
``defer_bound``: computed after the plan is handed out), the gap to that bound (waited for off
the clock), and the time ``plan.validate()`` and ``evaluate_plan`` take on the plan alone.
The load average is printed before and after: timings on a loaded machine are inflated, CPU
times much less.

``--digests FILE`` checks that the constructor builds the same plans as before a change: the
digests (``plan_digest``) of deterministic-mode dyncp plans of the seven ``planner_bench``
scenarios at 64 ranks (``--digest-steps`` batches each) are written to FILE when it does not
exist, else compared with it (run once on the old code, once on the new).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import plan_digest
from dyncp.planner import Planner
from dyncp.sim.replay import admit, draw_batches

MAX_LENGTH = 131072
RANKS_PER_NODE = 8
SEQUENCES_PER_RANK = 8


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def wikipedia(data: Path) -> np.ndarray:
    path = data / "wikipedia_flexsp.parquet"
    source = path if path.exists() else resolve_dataset("wikipedia")
    lengths, _ = admit(load_lengths(source), MAX_LENGTH, "truncate")
    return lengths


def run_scale(model: CostModel, args: argparse.Namespace) -> None:
    lengths = wikipedia(args.data)
    print(
        f"{'ranks':>6}{'seqs':>8}{'limit':>6}{'plan s':>8}{'/limit':>7}{'cpu s':>7}"
        f"{'construct':>10}{'price':>7}{'valid':>7}{'bound':>7}{'deferred':>9}{'bound s':>8}"
        f"{'gap':>7}{'cands':>6}{'validate':>9}{'evaluate':>9}  load"
    )
    for world in args.worlds:
        n = world * SEQUENCES_PER_RANK
        batches = list(draw_batches(lengths, steps=args.steps, seed=args.seed, global_batch_size=n))
        for limit in args.time_limits:
            planner = Planner(
                model,
                world=world,
                ranks_per_node=RANKS_PER_NODE,
                capacity=8192,
                time_limit=limit,
            )
            for batch in batches:
                before = load()
                t0, c0 = time.perf_counter(), time.process_time()
                plan = planner.plan(batch)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                deferred = bool(plan.stats["bound"].get("deferred"))
                if deferred:
                    planner.wait_bound(plan)  # off the clock
                t = plan.stats["timings"]
                v0 = time.perf_counter()
                plan.validate()
                v1 = time.perf_counter()
                evaluate_plan(plan, model)
                v2 = time.perf_counter()
                bound_in_call = 0.0 if deferred else t["bound_seconds"]
                print(
                    f"{world:>6}{n:>8}{limit:>6.1f}{wall:>8.2f}{wall / limit:>7.2f}{cpu:>7.2f}"
                    f"{t['construct_seconds']:>10.2f}{t.get('price_seconds', float('nan')):>7.2f}"
                    f"{t['validate_seconds']:>7.2f}{bound_in_call:>7.2f}{str(deferred):>9}"
                    f"{t['bound_seconds']:>8.2f}{plan.stats['gap_to_lower_bound']:>7.1%}"
                    f"{t['candidates']:>6}{v1 - v0:>9.3f}{v2 - v1:>9.3f}  {before} -> {load()}",
                    flush=True,
                )


def run_digests(model: CostModel, args: argparse.Namespace) -> None:
    """Deterministic plans of planner_bench's seven scenarios: written, or compared."""
    import planner_bench  # the scenarios are planner_bench's, one definition

    ns = argparse.Namespace(data=args.data, steps=args.digest_steps, seed=args.seed)
    digests: dict[str, list[int]] = {}
    for name, capacity, batches in planner_bench.scenarios(ns):
        p = planner_bench.planner(model, capacity, deterministic=True)
        digests[f"{name} {capacity}"] = [plan_digest(p.plan(b)) for b in batches]
    path: Path = args.digests
    if not path.exists():
        path.write_text(json.dumps(digests, indent=1))
        print(f"wrote {sum(map(len, digests.values()))} plan digests to {path}")
        return
    old = json.loads(path.read_text())
    same = total = 0
    for key, new in digests.items():
        ref = old.get(key, [])
        k = sum(a == b for a, b in zip(ref, new))
        print(f"{key:<45} {k}/{len(new)} plans identical")
        same, total = same + k, total + len(new)
    print(f"all scenarios: {same}/{total} plans identical to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--time-limits", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--steps", type=int, default=1, help="batches per world and limit")
    parser.add_argument("--profile", default="h100-reference")
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digests", type=Path, help="write or compare 64-rank plan digests")
    parser.add_argument("--digest-steps", type=int, default=5)
    args = parser.parse_args()
    model = CostModel.load(args.profile, ranks_per_node=RANKS_PER_NODE)
    print(f"profile {args.profile}; {os.cpu_count()} CPUs; load {load()}", flush=True)
    if args.digests is not None:
        run_digests(model, args)
        return
    run_scale(model, args)


if __name__ == "__main__":
    main()
