"""Menus shaped by the machine against powers of two: dyncp's predicted step time, one run.

Shown in docs/concepts/group-menus.md.

    python bench/menu_bench.py [--steps 5] [--full] [--capacity 8192] [--batch 2]
                               [--scenarios nvl72,nvl72x8,node4] [--datasets ...]

For each machine and distribution it draws the same global batches (seeded), plans each with the
deterministic dyncp planner once with powers of two only and once with each menu, prices the
plans with the same cost model (h100-reference: measured H100 attention, NVLink inside a domain,
the inter-node link between domains) and prints the mean step seconds and their ratio (pow2 /
menu: above 1 the menu is faster), each run's mean gap to its own lower bound, the ratio of the
lower bounds (what a perfect planner could gain at most, roughly) and the share of sequences the
menu runs on sizes that are not powers of two; first the communicators each pool needs
(``dyncp.plan.menu.pool_count``, computed without creating any).

Machines (documents up to 131072 tokens; ``--capacity`` tokens per rank, ``--batch`` x world x
capacity tokens per step, 8192 and 2 by default as in the simulator):

- ``nvl72``: one GB200 NVL72 domain, world 72. Menus: divisors of 72; divisors of 72 and the
  powers of two up to 64. Powers of two: 1..64 (a 64-ring on ranks 0..63, the last 8 ranks only
  in smaller groups).
- ``nvl72x8``: 8 NVL72 racks, world 576. Menus: the same, plus 144, 288, 576 (whole racks).
  Powers of two: 1..64, at most one 64-ring per rack.
- ``node4``: 16 nodes of 4 GPUs, world 64. Menu: 1, 2, 3, 4 inside a node (3 leaves a GPU idle),
  8, 12, 16, 24, 32, 48, 64 on whole nodes. Powers of two: 1..64.

Distributions: the two shared datasets (bundled samples ``wikipedia``, ``wlbllm``, or the full
files under /work/shared/datasets with ``--full``), and two constructed ones that isolate what a
menu changes: ``needs-3`` (documents that fill 2 to 3 ranks' capacity among short ones: powers
of two round them up to 4 ranks) and ``needs-6-12`` (documents needing 5-6 or 9-12 ranks: 8 and
16 with powers of two).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan.menu import menu_sizes, pool_count
from dyncp.planner.planner import Planner
from dyncp.sim.replay import admit, draw_batches

CAPACITY = 8192
MAX_LENGTH = 131072
POW2 = (1, 2, 4, 8, 16, 32, 64)
#: Per machine: (world, ranks per node, {menu name: sizes}); every menu is compared with POW2.
MACHINES = {
    "nvl72": (
        72,
        72,
        {
            "divisors": menu_sizes("divisors", world=72, ranks_per_node=72),
            "div+pow2": menu_sizes("divisors-and-powers-of-two", world=72, ranks_per_node=72),
        },
    ),
    "nvl72x8": (
        576,
        72,
        {
            "divisors": menu_sizes("divisors", world=576, ranks_per_node=72),
            "div+pow2": menu_sizes("divisors-and-powers-of-two", world=576, ranks_per_node=72),
        },
    ),
    "node4": (64, 4, {"nodes": (1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64)}),
}
SHARED = Path("/work/shared/datasets")


def constructed(name: str, seed: int = 0, count: int = 200_000) -> np.ndarray:
    """Lengths of a constructed distribution (see the module docstring)."""
    rng = np.random.default_rng(seed)
    short = rng.integers(100, 4000, size=count)
    if name == "needs-3":
        long = rng.integers(2 * CAPACITY + 1, 3 * CAPACITY - 6, size=count)
        pick = rng.random(count) < 0.08
    elif name == "needs-6-12":
        six = rng.integers(4 * CAPACITY + 1, 6 * CAPACITY - 12, size=count)
        twelve = rng.integers(8 * CAPACITY + 1, 12 * CAPACITY - 24, size=count)
        long = np.where(rng.random(count) < 0.5, six, twelve)
        pick = rng.random(count) < 0.02
    else:
        raise ValueError(f"unknown constructed distribution {name!r}")
    return np.where(pick, long, short).astype(np.int64)


def lengths_of(name: str, full: bool) -> np.ndarray:
    if name in ("needs-3", "needs-6-12"):
        return constructed(name)
    if full:
        stem = {"wikipedia": "wikipedia_flexsp", "wlbllm": "wlbllm_distca"}[name]
        return load_lengths(SHARED / f"{stem}.parquet", "length")
    return load_lengths(resolve_dataset(name))


def run(machine: str, dataset: str, steps: int, full: bool, capacity: int, batch: float) -> dict:
    world, rpn, menus = MACHINES[machine]
    model = CostModel.load("h100-reference", rpn)
    lengths, _ = admit(lengths_of(dataset, full), MAX_LENGTH, "truncate")
    tokens = int(batch * world * capacity)
    batches = list(draw_batches(lengths, steps=steps, seed=0, global_batch_tokens=tokens))
    out: dict = {"machine": machine, "dataset": dataset}
    for label, sizes in (("pow2", POW2), *menus.items()):
        planner = Planner(
            model,
            world=world,
            ranks_per_node=rpn,
            capacity=capacity,
            group_sizes=sizes,
            deterministic=True,
            cpsat=None,
        )
        plans = [planner.plan(b) for b in batches]
        out[label] = dict(
            seconds=float(np.mean([p.stats["predicted_step_seconds"] for p in plans])),
            gap=float(np.mean([p.stats["gap_to_lower_bound"] for p in plans])),
            bound=float(np.mean([p.stats["lower_bound_seconds"] for p in plans])),
            non_pow2=float(np.mean([_off_pow2(p) for p in plans])),
        )
    return out


def _off_pow2(plan) -> float:
    """Share of the plan's sequences run by a group whose size is not a power of two."""
    off = sum(len(mb.seq_ids) for _, g, mb in plan.microbatches() if g.size & (g.size - 1))
    return off / len(plan.lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scenarios", default=",".join(MACHINES))
    parser.add_argument(
        "--datasets", default="wikipedia,wlbllm,needs-3,needs-6-12", help="comma-separated"
    )
    parser.add_argument("--full", action="store_true", help="the full shared parquet files")
    parser.add_argument("--capacity", type=int, default=CAPACITY, help="tokens per rank")
    parser.add_argument(
        "--batch", type=float, default=2.0, help="tokens per step, in world x capacity"
    )
    args = parser.parse_args()
    machines = args.scenarios.split(",")
    print("communicators per pool (no head splits; NCCL buffers at 2 peers x 4 MiB, 1 channel):")
    for machine in machines:
        world, rpn, menus = MACHINES[machine]
        for label, sizes in (("pow2", POW2), *menus.items()):
            c = pool_count(sizes, world=world, ranks_per_node=rpn)
            print(
                f"  {machine:<8} {label:<9} sizes {list(sizes)}: {c.total} communicators, "
                f"at most {c.per_rank_max} per rank, {c.buffer_bytes_per_rank / 2**20:.0f} MiB"
            )
    print(
        f"\ncapacity {args.capacity} tokens/rank, {args.batch:g} x world x capacity tokens/step, "
        f"{args.steps} steps; ratio = pow2 s / menu s (above 1: the menu is faster)"
    )
    print(
        f"{'machine':<9}{'dataset':<12}{'menu':<10}{'menu s':>8}{'pow2 s':>8}{'ratio':>8}"
        f"{'menu gap':>9}{'pow2 gap':>9}{'LB ratio':>9}{'non-pow2':>9}"
    )
    for machine in machines:
        for dataset in args.datasets.split(","):
            r = run(machine, dataset, args.steps, args.full, args.capacity, args.batch)
            p = r["pow2"]
            for label in MACHINES[machine][2]:
                m = r[label]
                print(
                    f"{machine:<9}{dataset:<12}{label:<10}{m['seconds']:>8.3f}{p['seconds']:>8.3f}"
                    f"{p['seconds'] / m['seconds']:>7.3f}x{m['gap']:>9.1%}{p['gap']:>9.1%}"
                    f"{p['bound'] / m['bound']:>8.3f}x{m['non_pow2']:>9.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
