"""Per-step cost of proving one plan per step: the digest and the all_gather that compares it.

    python bench/agreement_bench.py [--world 4] [--iters 500]

Two parts, both on this machine's CPUs:

1. ``--world`` gloo processes (one thread each) call, ``--iters`` times each, on one CPU group:
   ``agree`` (dyncp.agreement: a synchronous all_gather of 3 int64 and the comparison), and, as
   the baseline measured in the same run, ``dist.barrier`` (the cheapest synchronisation there
   is) and a bare ``all_gather`` of the same 24 bytes; and ``runtime.execute`` of a 2-wave plan
   whose ``step_fn`` does nothing (the agreement, the plan checks and one status exchange per
   wave: the runtime's whole per-step overhead). Printed: p50 and p99 microseconds per call on
   rank 0 and the ratio of each to the barrier.
2. ``plan_digest`` (the blake2b hash of a plan's JSON that every rank computes each step) on plans
   of realistic sizes: dyncp greedy plans of one global batch (2 x world x 8192 tokens of the
   bundled Wikipedia sample) at 64 and 512 ranks, and a megatron-policy plan of 32,768 sequences
   at 4,096 ranks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dyncp.agreement import agree
from dyncp.cost_model import CostModel
from dyncp.datasets import load_lengths, resolve_dataset
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave, plan_digest
from dyncp.planner import Planner
from dyncp.planner.megatron import megatron_plan
from dyncp.runtime import GroupPool, execute


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    us = np.asarray(seconds) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def _two_wave_plan(world: int) -> StepPlan:
    """Wave 0: every rank alone; wave 1: one group of all ranks."""
    mb = MicroBatch
    waves = (
        Wave(tuple(Group(r, 1, (mb((r,)),)) for r in range(world))),
        Wave((Group(0, world, (mb((world,)),)),)),
    )
    return StepPlan(Topology(world, world, 64), (8,) * (world + 1), waves)


def _worker(rank: int, world: int, iters: int, tmp: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/pg",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.new_group(backend="gloo")
    mine = torch.tensor([0, 0, 123], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    pool = GroupPool(warmup=True)
    plan = _two_wave_plan(world)
    ops = {
        "barrier": lambda step: dist.barrier(group=group),
        "all_gather 24 B": lambda step: dist.all_gather(gathered, mine, group=group),
        "agree": lambda step: agree(group, where=(0, step), digest=123, label=f"step {step}"),
        "execute 2 waves": lambda step: execute(plan, pool, lambda ctx: None),
    }
    times: dict[str, list[float]] = {}
    for name, op in ops.items():
        for step in range(20):  # warm-up
            op(step)
        dist.barrier(group=group)
        times[name] = []
        for step in range(iters):
            t0 = time.perf_counter()
            op(step)
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        base = _percentiles(times["barrier"])[0]
        lines = [f"{world} gloo ranks on this machine, {iters} calls each (rank 0):"]
        for name, seconds in times.items():
            p50, p99 = _percentiles(seconds)
            lines.append(f"  {name:<16} p50 {p50:8.1f} us  p99 {p99:8.1f} us  {p50 / base:5.2f}x")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _digest_costs() -> list[str]:
    raw = load_lengths(resolve_dataset("wikipedia"))
    rng = np.random.default_rng(0)
    model = CostModel.load("h100-reference", ranks_per_node=8)
    lines = ["plan_digest (every rank, every step):"]
    for world in (64, 512):
        tokens = 2 * world * 8192
        order = rng.permutation(len(raw))
        cs = np.cumsum(np.minimum(raw[order], 131072))
        lengths = np.minimum(raw[order[: int(np.searchsorted(cs, tokens)) + 1]], 131072)
        planner = Planner(model, world=world, ranks_per_node=8, capacity=8192, cpsat=None)
        plans = [(f"dyncp greedy, {world} ranks", planner.plan(lengths))]
        lines += _time_digest(plans)
    lengths = np.minimum(rng.choice(raw, 32768), 131072)
    plan = megatron_plan(lengths, Topology(4096, 8, 8192))
    lines += _time_digest([("megatron, 4096 ranks", plan)])
    return lines


def _time_digest(plans: list) -> list[str]:
    out = []
    for name, plan in plans:
        seconds = []
        for _ in range(20):
            t0 = time.perf_counter()
            plan_digest(plan)
            seconds.append(time.perf_counter() - t0)
        p50, _ = _percentiles(seconds)
        out.append(f"  {name:<26} {len(plan.lengths):>6} sequences  p50 {p50 / 1e3:8.2f} ms")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--iters", type=int, default=500)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.txt")
        mp.start_processes(
            _worker,
            args=(args.world, args.iters, tmp, out),
            nprocs=args.world,
            start_method="spawn",
        )
        print(Path(out).read_text(), end="")
    print("\n".join(_digest_costs()))


if __name__ == "__main__":
    main()
