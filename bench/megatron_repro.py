"""Megatron-LM's published dynamic-CP table, reproduced with dyncp's simulator.

    python bench/megatron_repro.py                 # all five GPU counts, 50 steps each
    python bench/megatron_repro.py --steps 20 --gpus 8 64

Megatron-LM's ``examples/dynamic_context_parallel`` (dev branch; README measured June 9, 2026 on
nodes of four GPUs) trains a 12-layer, hidden-2048 GPT with TP 1, CP 4, PP 1,
``--max-seqlen-per-dp-cp-rank 2048``, micro-batch size 1, 8 micro-batches per data-parallel rank
(global batch = 2 x GPUs samples) on mock lengths: lognormal with mean 1024 and sigma 1.5, clipped
to [128, 8192] (``MockVarlenDataset``: mu = ln(mean) - sigma^2 / 2, NumPy seed 0). It compares
``--sequence-packing-scheduler dp_balanced`` (fixed CP 4) with ``default_dynamic_cp``.

Here the same lengths are planned by

- ``dp-balanced``: Megatron's dp_balanced packing (the baseline);
- ``megatron``: dyncp's model of Megatron's dynamic-CP scheduler on the dev branch today
  (packing-aware, since June 27, 2026) -- the simulator's ``megatron`` policy;
- ``megatron-min-cp``: the scheduler the published run used (June 8, 2026: every sequence at its
  minimum CP size), see ``dyncp.planner.megatron_min_cp``;
- ``dyncp``: dyncp's own planner (greedy constructor, deterministic),

and priced by the ``h100-megatron-dcp-gpt`` reference profile with 4 ranks per node. For the two
Megatron schedulers each sequence is first padded to a multiple of 2 x GPUs tokens, as Megatron's
``MockVarlenDataset`` pads under dynamic CP (``_calculate_padding_divisor``: dp x cp x 2); the
baseline pads to 2 x CP, which dyncp's zigzag padding already does.

Printed per GPU count: published and simulated step times and speedups, and simulated /
published (against the published trimmed-mean speedup, the primary figure, and against the same
runs' arithmetic-mean speedup, to show how much the statistic alone moves it). A second table is
a diagnostic, not part of any model: how much of the published baseline time the profile
explains, and the extra cost per ring step (per layer, forward + backward) that would make each
simulated speedup equal the published one. No constant here is fitted to the published figures.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.optimize import brentq
from scipy.stats import trim_mean

from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, load_profile
from dyncp.plan import StepPlan, Topology
from dyncp.planner.dp_balanced import dp_balanced_plan
from dyncp.planner.megatron import megatron_plan
from dyncp.planner.megatron_min_cp import megatron_min_cp_plan
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
# The same runs' arithmetic means (baseline ms, dynamic CP ms): the published spread of a run.
PUBLISHED_AVERAGE = {
    4: (216.125, 155.150),
    8: (226.515, 157.905),
    16: (231.620, 189.470),
    32: (287.780, 225.875),
    64: (281.480, 217.620),
}
MEAN, SIGMA, MIN_LEN, MAX_LEN, SEED = 1024, 1.5, 128, 8192, 0
CP, CAPACITY, RANKS_PER_NODE, MICROBATCHES_PER_DP_RANK = 4, 2048, 4, 8
TOLERANCE = 0.15
MAX_EXTRA_STEP_SECONDS = 5e-3


def mock_lengths(count: int) -> np.ndarray:
    """Megatron's MockVarlenDataset lengths: clipped lognormal, NumPy legacy RNG seed 0."""
    rng = np.random.RandomState(SEED)
    mu = np.log(MEAN) - SIGMA**2 / 2
    return np.clip(rng.lognormal(mu, SIGMA, count), MIN_LEN, MAX_LEN).astype(np.int64)


def dcp_padded(lengths: np.ndarray, gpus: int) -> np.ndarray:
    """Lengths as Megatron's varlen dataset pads them under dynamic CP: to dp x cp x 2."""
    unit = 2 * gpus
    return -(-lengths // unit) * unit


def step_plans(
    gpus: int, steps: int, model: CostModel, *, timing: str = "dataflow"
) -> dict[str, list[StepPlan]]:
    """Each policy's plans for ``steps`` consecutive global batches of 2 x GPUs samples (dyncp
    planned for ``timing``; the other policies do not price their plans)."""
    topology = Topology(gpus, RANKS_PER_NODE, CAPACITY)
    batch = MICROBATCHES_PER_DP_RANK * gpus // CP
    lengths = mock_lengths(steps * batch)
    dyncp = Planner(
        model,
        world=gpus,
        ranks_per_node=RANKS_PER_NODE,
        capacity=CAPACITY,
        policy="dyncp",
        deterministic=True,
        timing=timing,
    )
    plans: dict[str, list[StepPlan]] = {p: [] for p in ("dp-balanced", "megatron", "min-cp")}
    plans["dyncp"] = []
    for k in range(steps):
        b = lengths[k * batch : (k + 1) * batch]
        plans["dp-balanced"].append(dp_balanced_plan(b, topology, CP))
        plans["megatron"].append(megatron_plan(dcp_padded(b, gpus), topology))
        plans["min-cp"].append(megatron_min_cp_plan(dcp_padded(b, gpus), topology))
        plans["dyncp"].append(dyncp.plan(b))
    return plans


def trimmed_seconds(plans: list[StepPlan], model: CostModel, *, timing: str = "dataflow") -> float:
    """10%-trimmed mean of the predicted step seconds (the published statistic), timed as
    ``timing``: dataflow by default, as Megatron's dynamic CP and dyncp's runtime run (no
    barrier between micro-batches of different groups)."""
    seconds = [evaluate_plan(p, model, timing=timing).step_seconds for p in plans]
    return float(trim_mean(seconds, 0.1))


def with_extra_step_cost(profile: Profile, seconds: float) -> CostModel:
    """The profile with ``seconds`` more per ring step (every CP size pays it once per step)."""
    att = profile.attention
    update = {"step_overhead_seconds": att.step_overhead_seconds + seconds}
    if att.form == "table":
        update["seconds"] = [t + seconds for t in att.seconds]
    return CostModel(
        profile.model_copy(update={"attention": att.model_copy(update=update)}), RANKS_PER_NODE
    )


def extra_step_cost_to_match(
    profile: Profile,
    base: list[StepPlan],
    dcp: list[StepPlan],
    published: float,
    *,
    timing: str = "dataflow",
) -> float | None:
    """Extra seconds per ring step making the simulated speedup equal ``published`` (or None)."""

    def gap(extra: float) -> float:
        model = with_extra_step_cost(profile, extra)
        return (
            trimmed_seconds(base, model, timing=timing) / trimmed_seconds(dcp, model, timing=timing)
            - published
        )

    lo, hi = gap(0.0), gap(MAX_EXTRA_STEP_SECONDS)
    if lo >= 0:
        return 0.0
    if hi < 0:
        return None
    return float(brentq(gap, 0.0, MAX_EXTRA_STEP_SECONDS, xtol=1e-7))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="global batches per GPU count")
    parser.add_argument("--gpus", type=int, nargs="+", default=sorted(PUBLISHED))
    parser.add_argument("--profile", default="h100-megatron-dcp-gpt")
    parser.add_argument(
        "--no-diagnostic", action="store_true", help="skip the extra-step-cost diagnostic"
    )
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default="dataflow",
        help="step timing: dataflow (default, no barrier between waves) or barrier",
    )
    args = parser.parse_args(argv)
    unknown = [g for g in args.gpus if g not in PUBLISHED]
    if unknown or args.steps < 2:
        parser.error(f"--gpus from {sorted(PUBLISHED)}, --steps >= 2 (got {unknown or args.steps})")
    profile = load_profile(args.profile)
    model = CostModel(profile, RANKS_PER_NODE)
    print(
        f"profile {profile.name}, {RANKS_PER_NODE} GPUs/node, CP {CP}, capacity {CAPACITY}, "
        f"{args.steps} steps per GPU count, 10%-trimmed means (as published), {args.timing} "
        "timing\n"
    )
    header = (
        f"{'GPUs':>4} | {'published ms':>13} {'x':>6} {'avg x':>6} | {'megatron (dev) ms':>17} "
        f"{'x':>6} {'sim/pub':>7} {'<=15%':>5} {'sim/avg':>7} | {'min-cp x':>8} {'sim/pub':>7} | "
        f"{'dyncp x':>7}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for gpus in args.gpus:
        start = time.perf_counter()
        plans = step_plans(gpus, args.steps, model, timing=args.timing)
        sec = {p: trimmed_seconds(v, model, timing=args.timing) for p, v in plans.items()}
        base_ms, dcp_ms, pub = PUBLISHED[gpus]
        x = {p: sec["dp-balanced"] / sec[p] for p in ("megatron", "min-cp", "dyncp")}
        ok = abs(x["megatron"] / pub - 1) <= TOLERANCE
        results[gpus] = (plans, sec)
        avg = PUBLISHED_AVERAGE[gpus][0] / PUBLISHED_AVERAGE[gpus][1]
        print(
            f"{gpus:>4} | {base_ms:>6.1f} {dcp_ms:>6.1f} {pub:>6.3f} {avg:>6.3f} | "
            f"{sec['dp-balanced'] * 1e3:>8.1f} {sec['megatron'] * 1e3:>8.1f} "
            f"{x['megatron']:>6.3f} {x['megatron'] / pub:>7.3f} {'yes' if ok else 'no':>5} "
            f"{x['megatron'] / avg:>7.3f} | {x['min-cp']:>8.3f} {x['min-cp'] / pub:>7.3f} | "
            f"{x['dyncp']:>7.3f}"
            f"   ({time.perf_counter() - start:.0f} s)"
        )
    if args.no_diagnostic:
        return 0
    print(
        "\ndiagnostic (not a model): share of the published baseline time the profile predicts,"
        "\nand the extra seconds per ring step (per layer, fwd+bwd) that would make the simulated"
        "\nspeedup equal the published one"
    )
    print(f"{'GPUs':>4} | {'sim/pub baseline ms':>19} | {'extra us/step: megatron':>23} "
          f"{'min-cp':>7}")  # fmt: skip
    for gpus, (plans, sec) in results.items():
        pub = PUBLISHED[gpus][2]
        extra = [
            extra_step_cost_to_match(
                profile, plans["dp-balanced"], plans[p], pub, timing=args.timing
            )
            for p in ("megatron", "min-cp")
        ]
        shown = [f"{e * 1e6:.0f}" if e is not None else "none" for e in extra]
        share = sec["dp-balanced"] * 1e3 / PUBLISHED[gpus][0]
        print(f"{gpus:>4} | {share:>19.2f} | {shown[0]:>23} {shown[1]:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
