"""Pricing pipelined plans: how long stage_costs and price_pipeline take, and the bound's gap.

    python bench/pipeline_pricing_bench.py [--columns 512] [--slots 64] [--repeats 7]

Random pipelined plans (each slot: columns paired into groups of 2 or left single, a few idle,
one to two sequences of 500-6000 tokens per micro-batch) on 8-GPU nodes under
``h100-reference``, for 4 stages with 1 and 2 virtual stages. Prints, per pipeline, the fastest
of ``--repeats`` runs of ``stage_costs`` and of ``price_pipeline`` given those costs (wall
clock of this machine: on a shared machine, expect noise), the step, the bubble fraction, and
``pipeline_lower_bound`` with the step's ratio to it. Random plans are not good plans: the
ratio says how far a random plan is from the bound, not how tight the bound is (the exhaustive
tests of ``tests/unit/planner/test_pipeline_bound.py`` say that).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dyncp.cost_model import CostModel, price_pipeline, stage_costs
from dyncp.plan import Group, MicroBatch, Pipeline, StepPlan, Topology, Wave
from dyncp.planner.bounds.pipeline import pipeline_lower_bound

RANKS_PER_NODE = 8


def random_plan(columns: int, slots: int, pipeline: Pipeline, seed: int) -> StepPlan:
    rng = np.random.default_rng(seed)
    topo = Topology(columns, RANKS_PER_NODE, 1 << 16)
    lengths: list[int] = []
    waves = []
    for _ in range(slots):
        groups, c = [], 0
        while c < columns:
            roll = rng.random()
            if roll < 0.1 and groups:
                c += 1  # idle in this slot
                continue
            size = 2 if c % 2 == 0 and c + 2 <= columns and roll < 0.55 else 1
            ids = tuple(range(len(lengths), len(lengths) + int(rng.integers(1, 3))))
            lengths += [int(x) for x in rng.integers(500, 6000, len(ids))]
            groups.append(Group(c, size, (MicroBatch(ids),)))
            c += size
        waves.append(Wave(tuple(groups)))
    plan = StepPlan(topo, tuple(lengths), tuple(waves), pipeline=pipeline)
    plan.validate()
    return plan


def fastest(fn, *args, repeats: int, **kwargs) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--columns", type=int, default=512)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = CostModel.load("h100-reference", RANKS_PER_NODE)
    print(f"{args.columns} columns x {args.slots} slots, h100-reference")
    print("pipeline     stage_costs  price_pipeline  step s   bubble  bound s  step/bound")
    for pipeline in (Pipeline(4), Pipeline(4, 2)):
        plan = random_plan(args.columns, args.slots, pipeline, seed=0)
        t_costs, costs = fastest(stage_costs, plan, model, repeats=args.repeats)
        t_price, cost = fastest(price_pipeline, plan, model, costs=costs, repeats=args.repeats)
        bound = pipeline_lower_bound(np.asarray(plan.lengths), plan.topology, pipeline, model)
        print(
            f"P{pipeline.stages} V{pipeline.virtual}"
            f"  {t_costs * 1e3:9.1f} ms  {t_price * 1e3:11.1f} ms"
            f"  {cost.step_seconds:7.3f}  {cost.bubble_fraction:6.3f}  {bound.seconds:7.3f}"
            f"  {cost.step_seconds / bound.seconds:9.3f}"
        )


if __name__ == "__main__":
    main()
