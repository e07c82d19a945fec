"""Megatron-LM's published dynamic-CP table, reproduced with dyncp's simulator.

    python bench/megatron_repro.py                 # all five GPU counts, 50 steps each
    python bench/megatron_repro.py --steps 20 --gpus 8 64

Megatron-LM's ``examples/dynamic_context_parallel`` (dev branch; README measured June 9, 2026 on
nodes of four GPUs) trains a 12-layer, hidden-2048 GPT with TP 1, CP 4, PP 1,
``--max-seqlen-per-dp-cp-rank 2048``, micro-batch size 1, 8 micro-batches per data-parallel rank
(global batch = 2 x GPUs samples) on mock lengths: lognormal with mean 1024 and sigma 1.5, clipped
to [128, 8192] (``MockVarlenDataset``: mu = ln(mean) - sigma^2 / 2, NumPy seed 0). It compares
``--sequence-packing-scheduler dp_balanced`` (fixed CP 4) with ``default_dynamic_cp``.

Here both runs are simulated on the same lengths: the ``dp-balanced`` policy (Megatron's
dp_balanced packing) against the ``megatron`` policy (Megatron's dynamic-CP scheduler), priced by
the ``h100-megatron-dcp-gpt`` reference profile with 4 ranks per node. Printed per GPU count: the
published trimmed-mean iteration times and speedup, the simulated step times and speedup, and
the ratio simulated / published. No constant here is fitted to the published figures.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.stats import trim_mean

from dyncp.cost_model.model import CostModel
from dyncp.planner.planner import Planner

# Megatron-LM dev, examples/dynamic_context_parallel/README.md, "Slurm Benchmark Results":
# GPUs -> (baseline dp_balanced trimmed mean ms, dynamic CP trimmed mean ms, trimmed speedup).
PUBLISHED = {
    4: (195.269, 151.906, 1.285),
    8: (220.119, 155.850, 1.412),
    16: (226.775, 187.125, 1.212),
    32: (286.206, 208.088, 1.375),
    64: (271.988, 181.912, 1.495),
}
MEAN, SIGMA, MIN_LEN, MAX_LEN, SEED = 1024, 1.5, 128, 8192, 0
CP, CAPACITY, RANKS_PER_NODE, MICROBATCHES_PER_DP_RANK = 4, 2048, 4, 8
TOLERANCE = 0.15


def mock_lengths(count: int) -> np.ndarray:
    """Megatron's MockVarlenDataset lengths: clipped lognormal, NumPy legacy RNG seed 0."""
    rng = np.random.RandomState(SEED)
    mu = np.log(MEAN) - SIGMA**2 / 2
    return np.clip(rng.lognormal(mu, SIGMA, count), MIN_LEN, MAX_LEN).astype(np.int64)


def simulate(
    gpus: int, steps: int, profile: str, policies: tuple[str, ...]
) -> dict[str, list[float]]:
    """Predicted step seconds of each policy over ``steps`` consecutive global batches."""
    model = CostModel.load(profile, RANKS_PER_NODE)
    batch = MICROBATCHES_PER_DP_RANK * gpus // CP  # = 2 x GPUs samples
    lengths = mock_lengths(steps * batch)
    out: dict[str, list[float]] = {}
    for policy in policies:
        planner = Planner(
            model,
            world=gpus,
            ranks_per_node=RANKS_PER_NODE,
            capacity=CAPACITY,
            policy=policy,
            max_length=MAX_LEN,
            deterministic=True,
        )
        out[policy] = [
            planner.plan(lengths[k * batch : (k + 1) * batch]).stats["predicted_step_seconds"]
            for k in range(steps)
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="global batches per GPU count")
    parser.add_argument("--gpus", type=int, nargs="+", default=sorted(PUBLISHED))
    parser.add_argument("--profile", default="h100-megatron-dcp-gpt")
    args = parser.parse_args(argv)
    unknown = [g for g in args.gpus if g not in PUBLISHED]
    if unknown or args.steps < 1:
        parser.error(f"--gpus from {sorted(PUBLISHED)}, --steps >= 1 (got {unknown or args.steps})")
    policies = ("dp-balanced", "megatron", "static", "dyncp")
    print(
        f"profile {args.profile}, {RANKS_PER_NODE} GPUs/node, CP {CP}, capacity {CAPACITY}, "
        f"{args.steps} steps, 10%-trimmed means (as published)"
    )
    header = (
        f"{'GPUs':>4} | {'pub base ms':>11} {'pub dcp ms':>10} {'pub x':>6} | {'sim base ms':>11} "
        f"{'sim dcp ms':>10} {'sim x':>6} | {'sim/pub':>7} {'<=15%':>5} | "
        f"{'meg/static':>10} {'dyncp/base':>10}"
    )
    print(header)
    print("-" * len(header))
    ratios = []
    for gpus in args.gpus:
        start = time.perf_counter()
        runs = simulate(gpus, args.steps, args.profile, policies)
        mean = {p: float(trim_mean(v, 0.1)) for p, v in runs.items()}
        base_ms, dcp_ms, pub = PUBLISHED[gpus]
        sim = mean["dp-balanced"] / mean["megatron"]
        ratio = sim / pub
        ratios.append(ratio)
        print(
            f"{gpus:>4} | {base_ms:>11.1f} {dcp_ms:>10.1f} {pub:>6.3f} | "
            f"{mean['dp-balanced'] * 1e3:>11.1f} {mean['megatron'] * 1e3:>10.1f} {sim:>6.3f} | "
            f"{ratio:>7.3f} {'yes' if abs(ratio - 1) <= TOLERANCE else 'no':>5} | "
            f"{mean['static'] / mean['megatron']:>10.3f} "
            f"{mean['dp-balanced'] / mean['dyncp']:>10.3f}   ({time.perf_counter() - start:.0f} s)"
        )
    print(
        f"simulated / published speedup: mean {np.mean(ratios):.3f}, "
        f"range {min(ratios):.3f}..{max(ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
