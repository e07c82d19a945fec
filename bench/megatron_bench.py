"""How long the megatron policy takes to plan one step, against the plain loop it replaced.

    python bench/megatron_bench.py [--sizes 1024:8192 2048:16384 4096:32768] [--reference-max 2048]

For each ``world:sequences`` pair, that many sequence lengths are drawn (seed 0) from the bundled
Wikipedia sample, capped at 131,072 tokens, and planned on ``world`` ranks of 8 per node at 8,192
tokens per rank, once by ``dyncp.planner.baselines.megatron.megatron_plan`` (a vectorised pass per
CP size to choose each sequence's group) and, up to ``--reference-max`` ranks, once by the plain
loop it replaced (``tests/megatron_reference.py``: every document tries every group). Printed:
seconds of each, their ratio, whether the plans are identical, and the waves of the plan.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import Topology
from dyncp.planner.baselines.megatron import megatron_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from megatron_reference import reference_megatron_plan  # noqa: E402


def _pair(text: str) -> tuple[int, int]:
    world, n = text.split(":")
    return int(world), int(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", type=_pair, nargs="+", default=[(1024, 8192), (2048, 16384), (4096, 32768)]
    )
    p.add_argument("--reference-max", type=int, default=2048, help="largest world for the loop")
    args = p.parse_args()
    raw = load_lengths(resolve_dataset("wikipedia"))
    head = ("world", "seqs", "waves", "vectorised s", "loop s", "ratio")
    print("".join(f"{h:>{w}}" for h, w in zip(head, (6, 8, 7, 14, 10, 8))) + "  same")
    for world, n in args.sizes:
        lengths = np.minimum(np.random.default_rng(0).choice(raw, n), 131072)
        topo = Topology(world, 8, 8192)
        t0 = time.perf_counter()
        plan = megatron_plan(lengths, topo)
        new = time.perf_counter() - t0
        old, same = float("nan"), "-"
        if world <= args.reference_max:
            t0 = time.perf_counter()
            ref = reference_megatron_plan(lengths, topo)
            old = time.perf_counter() - t0
            same = "yes" if ref.to_json() == plan.to_json() else "NO"
        print(
            f"{world:>6}{n:>8}{len(plan.waves):>7}{new:>14.2f}{old:>10.2f}{old / new:>8.1f}  {same}"
        )


if __name__ == "__main__":
    main()
