"""The plan service's deterministic fallback at scale: its seconds against the step budget, and
its plans against the normal planner's.

    python bench/fallback_bench.py [--worlds 4096,16384] [--repeats 3] [--search 64,512]

A rank whose step has no usable published plan plans the step itself, inside the step
(``dyncp.service.fallback_planner``), so the fallback must finish within the step budget
(``DEFAULT_STEP_BUDGET``: 0.25 x the step the batch's closed-form bound predicts, within
[0.1 s, 2 s]). Per world N, on one global batch of 2 x N x 8,192 tokens of the bundled Wikipedia
sample (the batches of ``bench/control_plane_bench.py --offline``, same seed and order), capacity
8,192, 8 ranks per node, the ``h100-reference`` profile:

- the fallback: seconds of ``plan()`` (the fastest of ``--repeats``, with its construction,
  pricing and validation; every repeat must give the same plan digest), which constructor ran,
  its predicted step;
- the normal plan: the service's planner with CP-SAT off (``Planner(..., cpsat=None)`` planned
  with ``DEFAULT_STEP_BUDGET``, wall clock), its seconds and predicted step;
- the budget, and the ratios fallback / budget and fallback / normal (predicted step).

``--search WORLDS`` also times the deterministic search itself (``construction="search"``, what
the fallback ran before) at those worlds: the seconds per sequence behind
``dyncp.planner.construction.quick.SEARCH_SECONDS_PER_SEQUENCE`` (minutes at 4,096 ranks).
Wall-clock figures are of this machine (2 shared cores); the ratios come from the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from control_plane_bench import _batch_at, _planner_at

from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import plan_digest
from dyncp.planner import Planner
from dyncp.planner.batch import Batch
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.budget import DEFAULT_STEP_BUDGET
from dyncp.service import fallback_planner


def _timed(planner: Planner, lengths: np.ndarray, repeats: int) -> tuple[float, object]:
    """The fastest of ``repeats`` plans' seconds, and the plan (the same digest every time)."""
    best, plan, digests = float("inf"), None, set()
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = planner.plan(lengths)
        best = min(best, time.perf_counter() - t0)
        digests.add(plan_digest(plan))
    assert len(digests) == 1, f"the fallback planned {len(digests)} different plans"
    return best, plan


def measure(world: int, lengths: np.ndarray, repeats: int) -> dict:
    normal = _planner_at(world)
    predicted = lower_bound(Batch(lengths, normal.topology), normal.topology, normal.model)
    budget = DEFAULT_STEP_BUDGET.seconds(predicted)
    t0 = time.perf_counter()
    plan = normal.plan(lengths, budget=DEFAULT_STEP_BUDGET)
    normal_seconds = time.perf_counter() - t0
    fallback_s, fallback = _timed(fallback_planner(normal), lengths, repeats)
    timings = fallback.stats["timings"]
    row = {
        "world": world,
        "sequences": len(lengths),
        "budget_seconds": budget,
        "fallback_seconds": fallback_s,
        "fallback_over_budget": fallback_s / budget,
        "constructor": fallback.stats.get("constructor"),
        "construct_seconds": timings["construct_seconds"],
        "price_seconds": timings["price_seconds"],
        "validate_seconds": timings["validate_seconds"],
        "fallback_step": fallback.stats.predicted_step_seconds,
        "normal_seconds": normal_seconds,
        "normal_step": plan.stats.predicted_step_seconds,
        "bound": predicted,
    }
    row["step_ratio"] = row["fallback_step"] / row["normal_step"]
    return row


def search_seconds(world: int, lengths: np.ndarray) -> dict:
    """The deterministic search's seconds on one batch (the fallback before the quick one)."""
    planner = fallback_planner(_planner_at(world))
    config = dataclasses.replace(planner.config, construction="search")
    t0 = time.perf_counter()
    plan = Planner(planner.model, config).plan(lengths)
    seconds = time.perf_counter() - t0
    quick = planner.plan(lengths)
    return {
        "world": world,
        "sequences": len(lengths),
        "seconds": seconds,
        "ms_per_sequence": 1e3 * seconds / len(lengths),
        "step": plan.stats.predicted_step_seconds,
        "fallback_step": quick.stats.predicted_step_seconds,
        "constructor": quick.stats["constructor"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--search", default="", help="worlds at which to time the search too")
    args = p.parse_args()
    raw = load_lengths(resolve_dataset("wikipedia"))
    rng = np.random.default_rng(0)  # the batches of control_plane_bench --offline, in order
    print(
        "| N | sequences | step budget | fallback (constructor) | fallback / budget "
        "| construct + price + validate | normal plan (seconds) | predicted step: fallback "
        "/ normal | closed-form bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in [int(w) for w in args.worlds.split(",")]:
        r = measure(world, _batch_at(world, rng, raw), args.repeats)
        print(
            f"| {world:,} | {r['sequences']:,} | {r['budget_seconds']:.3f} s "
            f"| {r['fallback_seconds']:.3f} s ({r['constructor']}) "
            f"| {r['fallback_over_budget']:.2f}x "
            f"| {r['construct_seconds']:.3f} + {r['price_seconds']:.3f} + "
            f"{r['validate_seconds']:.3f} s "
            f"| {r['normal_seconds']:.2f} s | {r['fallback_step']:.4f} / {r['normal_step']:.4f} s "
            f"= {r['step_ratio']:.4f} | {r['bound']:.4f} s |",
            flush=True,
        )
    if args.search:
        rng = np.random.default_rng(0)
        print(
            "\n| N | sequences | deterministic search | per sequence | predicted step: search "
            "| fallback (constructor) / search |"
        )
        print("|---|---|---|---|---|---|")
        for world in [int(w) for w in args.search.split(",")]:
            r = search_seconds(world, _batch_at(world, rng, raw))
            print(
                f"| {world:,} | {r['sequences']:,} | {r['seconds']:.2f} s "
                f"| {r['ms_per_sequence']:.2f} ms | {r['step']:.4f} s "
                f"| {r['fallback_step']:.4f} s ({r['constructor']}) / search = "
                f"{r['fallback_step'] / r['step']:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
