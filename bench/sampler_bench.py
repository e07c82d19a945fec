"""Sampler benchmark: how long a training loop waits on planning, per step, by lookahead.

    python bench/sampler_bench.py [--steps 40] [--step-seconds 0.05] [--world 16]
                                  [--time-limit 0.04] [--data ../shared/datasets]

Rank 0 of a ``--world``-rank job (8 ranks per node, capacity 8192 tokens per rank, global batch
2 x world x capacity tokens, h100-reference cost model) iterates a DynamicCPSampler over the full
shared datasets (or the bundled samples when ``--data`` lacks them) and sleeps ``--step-seconds``
after each step's last micro-batch (the synthetic training step). Two plan sources:

- ``service``: the plan service in a thread of this process, publishing through a TCPStore on
  127.0.0.1, read back by the sampler (the multi-rank path; planner: dyncp, ``--time-limit``);
- ``local``: the sampler's own lookahead thread (deterministic planner, same time limit).

For lookahead 0, 1 and 2 it reports the wait of the first step, the waits of all later steps
(total and max: time spent inside ``next()`` on the step's micro-batches, reading and checking
the plan included), the steps whose plan was not ready when asked, fallbacks, and the planner's
own p50/max seconds per step.
"""

from __future__ import annotations

import argparse
import logging
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist

from dyncp.cost_model import CostModel
from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import Topology
from dyncp.planner import Planner
from dyncp.sampler import DynamicCPSampler, StepInfo

CAPACITY = 8192
FILES = {"wikipedia": "wikipedia_flexsp.parquet", "wlbllm": "wlbllm_distca.parquet"}


def run(lengths: np.ndarray, *, mode: str, lookahead: int, args: argparse.Namespace, store) -> dict:
    model = CostModel.load("h100-reference", ranks_per_node=8)
    planner = Planner(
        model,
        world=args.world,
        ranks_per_node=8,
        capacity=CAPACITY,
        time_limit=args.time_limit,
        deterministic=mode == "local",
    )
    infos: list[StepInfo] = []
    plan_seconds: list[float] = []

    def on_step(plan, info: StepInfo) -> None:
        infos.append(info)
        plan_seconds.append(plan.stats["timings"]["plan_seconds"])

    sampler = DynamicCPSampler(
        lengths,
        world_size=args.world,
        rank=0,
        capacity=CAPACITY,
        planner=planner,
        global_batch_tokens=2 * args.world * CAPACITY,
        seed=args.seed,
        lookahead=lookahead,
        overlong="truncate",
        store=store if mode == "service" else None,
        prefix=f"bench-{mode}-{lookahead}-{time.monotonic_ns()}",
        on_step=on_step,
    )
    waits = [0.0] * args.steps
    it = iter(sampler)
    with sampler:
        for step in range(args.steps):
            while True:
                start = time.perf_counter()
                mb = next(it)
                waits[step] += time.perf_counter() - start
                if mb.meta.last_in_step:
                    break
            time.sleep(args.step_seconds)
    c = sampler.counters
    later = waits[1:]
    return dict(
        first_ms=1e3 * waits[0],
        later_total_ms=1e3 * sum(later),
        later_max_ms=1e3 * max(later),
        not_ready=sum(not i.ready for i in infos[1 : args.steps]),
        fallbacks=c.fallbacks,
        plan_p50_ms=1e3 * float(np.median(plan_seconds)),
        plan_max_ms=1e3 * max(plan_seconds),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--time-limit", type=float, default=0.04)
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("dyncp.sampler").setLevel(logging.ERROR)  # truncation: counted below
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    print(
        f"rank 0 of {args.world} ranks, capacity {CAPACITY}, global batch "
        f"{2 * args.world * CAPACITY} tokens, {args.steps} steps of {1e3 * args.step_seconds:.0f} "
        f"ms, planner time limit {args.time_limit} s"
    )
    header = (
        f"{'dataset':<10}{'source':<9}{'lookahead':>9}{'first ms':>10}{'later total ms':>16}"
        f"{'later max ms':>14}{'not ready':>11}{'fallbacks':>11}{'plan p50 ms':>13}"
        f"{'plan max ms':>13}"
    )
    for name, file in FILES.items():
        path = args.data / file
        source = path if path.exists() else resolve_dataset(name)
        lengths = load_lengths(source)
        over = int((lengths > Topology(args.world, 8, CAPACITY).max_length()).sum())
        print(f"\n{name}: {source} ({len(lengths)} documents, {over} truncated)")
        print(header)
        print("-" * len(header))
        for mode in ("service", "local"):
            for lookahead in (0, 1, 2):
                r = run(lengths, mode=mode, lookahead=lookahead, args=args, store=store)
                print(
                    f"{name:<10}{mode:<9}{lookahead:>9}{r['first_ms']:>10.1f}"
                    f"{r['later_total_ms']:>16.1f}{r['later_max_ms']:>14.2f}"
                    f"{r['not_ready']:>11}{r['fallbacks']:>11}{r['plan_p50_ms']:>13.1f}"
                    f"{r['plan_max_ms']:>13.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
