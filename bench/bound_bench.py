"""Lower-bound benchmark: how far the bounds sit below the best plan found, per scenario.

    python bench/bound_bench.py [--steps 10] [--time-limit 2.0] [--data ../shared/datasets]

Scenarios: the seven of ``bench/planner_bench.py`` (512 sequences on 64 ranks, ``h100-reference``)
and two constructed on the FlexSP-style all-to-all profile (``published-flexsp``: 64 GPUs, 8 per
node, 5,992 tokens per rank, so up to 383,488 tokens per document):

- ``long-doc``: a few documents per step (4 to 16), lengths log-uniform from 1K tokens to the
  longest a step holds: documents of hundreds of thousands of tokens next to short ones;
- ``mid-doc``: 8 to 48 documents, log-uniform between 2K and 24K tokens: each wants a group of 1
  to 8 ranks, and the sizes left over decide the step.

Per scenario it prints: the best plan found (``dyncp`` with ``time_limit`` seconds, CP-SAT
included) timed barrier and dataflow; the tight bound as it was (``timing="barrier"``,
bit-for-bit the bound before dataflow) and as reported now (``timing="dataflow"``, valid under
both), the closed-form bound, and the gaps of each plan timing to its bound (mean and max over
steps); the ratio of the reported bound to the one before; and the bound's wall and CPU
milliseconds (mean) before and now.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_bench import scenarios as bench_scenarios  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.cost_model.evaluate import evaluate_plan  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.planner.bounds.closed_form import lower_bound  # noqa: E402
from dyncp.planner.bounds.lp_bound import lp_lower_bound  # noqa: E402

WORLD, RANKS_PER_NODE = 64, 8
FLEXSP_CAPACITY = 5992


def flexsp_batches(name: str, steps: int, seed: int) -> list[np.ndarray]:
    """Batches of the two FlexSP-profile scenarios (module docstring)."""
    rng = np.random.default_rng(seed)
    longest = WORLD * FLEXSP_CAPACITY
    out = []
    for _ in range(steps):
        if name == "long-doc":
            n, lo, hi = int(rng.integers(4, 17)), 1024, longest
        elif name == "mid-doc":
            n, lo, hi = int(rng.integers(8, 49)), 2048, 24576
        else:
            raise ValueError(f"unknown scenario {name!r}; choose long-doc or mid-doc")
        x = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
        out.append(np.clip(np.rint(x), 1, longest).astype(np.int64))
    return out


def all_scenarios(args: argparse.Namespace) -> Iterator[tuple[str, str, int, list[np.ndarray]]]:
    """(name, profile, capacity, batches)."""
    ns = argparse.Namespace(steps=args.steps, seed=args.seed, data=args.data)
    for name, capacity, batches in bench_scenarios(ns):
        yield name, "h100-reference", capacity, batches
    for name in ("long-doc", "mid-doc"):
        yield name, "published-flexsp", FLEXSP_CAPACITY, flexsp_batches(name, args.steps, args.seed)


def timed_bound(batch: np.ndarray, planner: Planner, simple: float, timing: str):
    """The tight bound of ``timing`` and its wall and CPU seconds."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = lp_lower_bound(
        batch, planner.topology, planner.search_model, simple=simple, timing=timing
    )
    return out, time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run only scenarios whose name contains this")
    args = parser.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3] if os.path.exists("/proc/loadavg") else []
    print(
        f"{args.steps} steps per scenario; dyncp time_limit {args.time_limit} s (CP-SAT on); "
        f"{WORLD} ranks; {os.cpu_count()} CPUs; load {' '.join(load)}"
    )
    print(
        f"{'scenario':<34}{'cap':>6}{'plan ms':>9}{'df ms':>8}{'old LB':>8}{'LB':>8}{'simple':>8}"
        f"{'old gap':>8}{'max':>7}{'df gap':>7}{'max':>7}{'simple gap':>11}{'LB/old':>8}"
        f"{'old ms':>8}{'ms':>7}{'old cpu':>8}{'cpu':>7}"
    )
    for name, profile, capacity, batches in all_scenarios(args):
        if args.only not in name:
            continue
        model = CostModel.load(profile, RANKS_PER_NODE)
        planner = Planner(
            model,
            world=WORLD,
            ranks_per_node=RANKS_PER_NODE,
            capacity=capacity,
            time_limit=args.time_limit,
        )
        rows = []
        for batch in batches:
            plan = planner.plan(batch)
            barrier = evaluate_plan(plan, model, timing="barrier").step_seconds
            dataflow = evaluate_plan(plan, model, timing="dataflow").step_seconds
            simple = lower_bound(batch, planner.topology, planner.search_model)
            old, old_wall, old_cpu = timed_bound(batch, planner, simple, "barrier")
            new, new_wall, new_cpu = timed_bound(batch, planner, simple, "dataflow")
            assert old.seconds <= barrier * (1 + 1e-9) and new.seconds <= dataflow * (1 + 1e-9)
            assert new.seconds >= simple * (1 - 1e-12)
            rows.append(
                (barrier, dataflow, old.seconds, new.seconds, simple)
                + (old_wall, new_wall, old_cpu, new_cpu)
            )
        a = np.asarray(rows)
        old_gap = a[:, 0] / a[:, 2] - 1
        new_gap = a[:, 1] / a[:, 3] - 1
        simple_gap = a[:, 1] / a[:, 4] - 1
        print(
            f"{name:<34}{capacity:>6}{a[:, 0].mean() * 1e3:>9.0f}{a[:, 1].mean() * 1e3:>8.0f}"
            f"{a[:, 2].mean() * 1e3:>8.0f}{a[:, 3].mean() * 1e3:>8.0f}{a[:, 4].mean() * 1e3:>8.0f}"
            f"{old_gap.mean():>8.1%}{old_gap.max():>7.1%}{new_gap.mean():>7.1%}"
            f"{new_gap.max():>7.1%}{simple_gap.mean():>11.1%}"
            f"{(a[:, 3] / a[:, 2]).mean():>8.4f}"
            f"{a[:, 5].mean() * 1e3:>8.1f}{a[:, 6].mean() * 1e3:>7.1f}"
            f"{a[:, 7].mean() * 1e3:>8.1f}{a[:, 8].mean() * 1e3:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
