"""Dataflow against barrier timing: the same plans timed both ways, and plans re-made for dataflow.

    python bench/timing_bench.py [--steps 10] [--profile h100-reference] [--data ../shared/datasets]

Scenarios: those of ``bench/planner_bench.py`` (``--scenarios`` picks some): both shared length
files at capacities 8192 and 16384 and the constructed ``code``, ``chat`` and ``bimodal``
distributions at 8192 (512 sequences per step on 64 ranks, 8 per node, max length 131072), the
long-document one and the sparse ones (Megatron's example set-up on 4-GPU nodes). Every planner
runs in deterministic mode (the simulator's default), so the figures do not depend on the machine
or its load.

Per scenario and policy (``dyncp``, ``megatron``), with B = the plan made under
``timing="barrier"`` and D = the plan made under ``timing="dataflow"`` (the default), it prints the
mean step seconds of: B timed as barrier, B timed as dataflow, D timed as dataflow; and the
ratios ``same`` = B dataflow / B barrier (what removing the barrier is worth on the same plans)
and ``replan`` = D dataflow / B dataflow (what planning for dataflow adds), ``D<=B`` = in how
many steps D is no slower than B (dataflow-timed), ``vs megatron`` = megatron's D / dyncp's D
under dataflow and ``(barrier)`` the same with both B plans timed as barrier. ``gap`` is dyncp's
mean gap to the tight lower bound under dataflow, ``min gap`` the smallest (negative would mean
the bound is not valid under dataflow).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import evaluate_plan

try:  # run as ``python bench/timing_bench.py`` (bench/ on sys.path) or as a module
    from planner_bench import RANKS_PER_NODE, Scenario, scenarios
except ImportError:  # pragma: no cover - imported as bench.timing_bench
    from bench.planner_bench import RANKS_PER_NODE, Scenario, scenarios

POLICIES = ("dyncp", "megatron")


def measure(sc: Scenario, policy: str) -> dict:
    """Per-step seconds of the barrier-made plan (both timings) and the dataflow-made plan."""
    model = sc.model
    made = {
        t: sc.planner(policy=policy, deterministic=True, timing=t) for t in ("barrier", "dataflow")
    }
    out: dict[str, list[float]] = {"bb": [], "bd": [], "dd": [], "gap": []}
    for batch in sc.batches:
        b = made["barrier"].plan(batch)
        d = made["dataflow"].plan(batch)
        out["bb"].append(evaluate_plan(b, model, timing="barrier").step_seconds)
        out["bd"].append(evaluate_plan(b, model, timing="dataflow").step_seconds)
        out["dd"].append(d.stats["predicted_step_seconds"])
        out["gap"].append(d.stats["gap_to_lower_bound"])
    return {k: np.asarray(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="batches per scenario")
    parser.add_argument("--profile", default="h100-reference")
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenarios", nargs="*", help="only scenarios whose name starts so")
    parser.add_argument("--sparse-profile", default="h100-megatron-dcp-gpt-plain")
    args = parser.parse_args()
    model = CostModel.load(args.profile, ranks_per_node=RANKS_PER_NODE)
    print(
        f"profile {args.profile}; 512 sequences / 64 ranks; deterministic planners; "
        f"{args.steps} batches per scenario; B = barrier-made plan, D = dataflow-made plan"
    )
    print(
        f"{'scenario':<30}{'cap':>6}{'policy':>9}{'B barrier':>10}{'B dataflow':>11}"
        f"{'D dataflow':>11}{'same':>7}{'replan':>8}{'D<=B':>6}{'vs megatron':>12}"
        f"{'(barrier)':>10}{'gap':>7}{'min gap':>9}"
    )
    same_all, replan_all = [], []
    for sc in scenarios(args, model):
        name, capacity, batches = sc.name, sc.capacity, sc.batches
        res = {p: measure(sc, p) for p in POLICIES}
        for p in POLICIES:
            r = res[p]
            same = r["bd"].mean() / r["bb"].mean()
            replan = r["dd"].mean() / r["bd"].mean()
            if p == "dyncp":
                same_all.append(same)
                replan_all.append(replan)
            no_slower = int((r["dd"] <= r["bd"] * (1 + 1e-12)).sum())
            vs = res["megatron"]["dd"].mean() / res["dyncp"]["dd"].mean()
            vs_b = res["megatron"]["bb"].mean() / res["dyncp"]["bb"].mean()
            gaps = f"{r['gap'].mean():>7.1%}{r['gap'].min():>9.3%}"
            extra = f"{vs:>11.3f}x{vs_b:>9.3f}x{gaps}" if p == "dyncp" else ""
            print(
                f"{name:<30}{capacity:>6}{p:>9}{r['bb'].mean() * 1e3:>10.1f}"
                f"{r['bd'].mean() * 1e3:>11.1f}{r['dd'].mean() * 1e3:>11.1f}{same:>7.3f}"
                f"{replan:>8.4f}{no_slower:>3}/{len(batches):<2}{extra}",
                flush=True,
            )
    print(
        f"dyncp over all scenarios: same plans dataflow/barrier {np.mean(same_all):.3f} "
        f"(min {np.min(same_all):.3f}); re-planned/same {np.mean(replan_all):.4f} "
        f"(min {np.min(replan_all):.4f})"
    )


if __name__ == "__main__":
    main()
