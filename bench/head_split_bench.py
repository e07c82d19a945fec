"""Head x ring splits per group: ring-only dyncp vs dyncp-hybrid vs static, predicted.

    python bench/head_split_bench.py [--steps 20] [--profile h100-reference]

Scenarios: the policy tables' four (bundled Wikipedia and WLB-LLM samples, 64 ranks, 8 per node,
capacities 8192 and 16384, max length 131072, 2 x world x capacity tokens per step) and two where
more groups cross nodes (4 ranks per node; capacity 4096). Per scenario and policy: mean
predicted step seconds, speedup over static, mean and max gap to the tight lower bound (the bound
counts the head splits, so it is the same for every policy), plan latency p50/p99 of the whole
``plan()`` call, and for dyncp-hybrid the per-step ratio to ring-only dyncp (min / mean / max;
below 1 is faster) and the split mix.

Then one table explains the result: a single sequence at each CP size, priced as a ring and at
each split, inside a node and across nodes.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.data import load_lengths, resolve_dataset
from dyncp.planner import Planner
from dyncp.planner.improvement.head_split import layout_histogram
from dyncp.sim.replay import admit, draw_batches

MAX_LENGTH = 131072
WORLD = 64
HEAD_SIZES = (1, 2, 4, 8)
SCENARIOS = (  # dataset, capacity, ranks per node
    ("wikipedia", 8192, 8),
    ("wlbllm", 8192, 8),
    ("wikipedia", 16384, 8),
    ("wlbllm", 16384, 8),
    ("wikipedia", 8192, 4),
    ("wikipedia", 4096, 8),
)
POLICIES = ("static", "dyncp", "dyncp-hybrid")


def run_scenario(profile: str, dataset: str, capacity: int, per_node: int, steps: int) -> None:
    model = CostModel.load(profile, per_node)
    lengths, _ = admit(load_lengths(resolve_dataset(dataset)), MAX_LENGTH, "truncate")
    batches = list(
        draw_batches(lengths, steps=steps, seed=0, global_batch_tokens=2 * WORLD * capacity)
    )
    planners = {
        p: Planner(
            model,
            world=WORLD,
            ranks_per_node=per_node,
            capacity=capacity,
            policy=p,
            max_length=MAX_LENGTH,
            head_sizes=HEAD_SIZES,
        )
        for p in POLICIES
    }
    seconds: dict[str, list[float]] = {p: [] for p in POLICIES}
    gaps: dict[str, list[float]] = {p: [] for p in POLICIES}
    latency: dict[str, list[float]] = {p: [] for p in POLICIES}
    mix: Counter = Counter()
    for batch in batches:
        for p, planner in planners.items():
            plan = planner.plan(batch)
            seconds[p].append(plan.stats["predicted_step_seconds"])
            gaps[p].append(plan.stats["gap_to_lower_bound"])
            latency[p].append(plan.stats["timings"]["plan_seconds"])
            if p == "dyncp-hybrid":
                mix.update(layout_histogram(plan))
    print(f"\n{dataset}, capacity {capacity}, {WORLD} ranks ({per_node}/node), {profile}, "
          f"{steps} steps")  # fmt: skip
    print(f"{'policy':<13} {'step s':>8} {'vs static':>9} {'gap mean':>9} {'gap max':>8} "
          f"{'p50':>8} {'p99':>8}")  # fmt: skip
    static = float(np.mean(seconds["static"]))
    for p in POLICIES:
        mean = float(np.mean(seconds[p]))
        print(
            f"{p:<13} {mean:8.3f} {static / mean:8.3f}x {np.mean(gaps[p]):9.1%} "
            f"{np.max(gaps[p]):8.1%} {np.percentile(latency[p], 50) * 1e3:6.1f}ms "
            f"{np.percentile(latency[p], 99) * 1e3:6.1f}ms"
        )
    ratio = np.asarray(seconds["dyncp-hybrid"]) / np.asarray(seconds["dyncp"])
    slower = int(np.sum(ratio > 1 + 1e-12))
    print(
        f"hybrid / ring-only per step: min {ratio.min():.3f} mean {ratio.mean():.3f} max "
        f"{ratio.max():.3f}; steps where hybrid is slower: {slower} of {len(ratio)}"
    )
    total = sum(mix.values())
    print("hybrid layouts (share of sequences): " + " ".join(
        f"{name}:{n / total:.1%}" for name, n in sorted(mix.items(), key=lambda kv: -kv[1])
    ))  # fmt: skip


def explain(profile: str) -> None:
    """One sequence per CP size: ring vs every split, inside one node and across nodes."""
    print(f"\nOne sequence alone, {profile}: predicted ms per split (best marked *)")
    for per_node in (8, 4):
        model = CostModel.load(profile, per_node)
        print(f"-- {per_node} ranks per node")
        for cp, length in ((4, 16384), (8, 32768), (16, 65536), (32, 131072), (64, 131072)):
            splits = [u for u in HEAD_SIZES if cp % u == 0]
            cost = {u: model.microbatch_seconds(cp, [length], heads=u) for u in splits}
            best = min(cost, key=cost.get)
            cells = " ".join(
                f"{'ring' if u == 1 else f'a2a{u}'}{'*' if u == best else ' '}{cost[u] * 1e3:8.2f}"
                for u in splits
            )
            cross = "crosses nodes" if cp > per_node else "in one node"
            print(f"  CP {cp:>2} ({cross:<13}) L={length:>6}: {cells}  "
                  f"best/ring {cost[best] / cost[1]:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", default="h100-reference")
    args = parser.parse_args()
    t0 = time.perf_counter()
    for dataset, capacity, per_node in SCENARIOS:
        run_scenario(args.profile, dataset, capacity, per_node, args.steps)
    explain(args.profile)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
