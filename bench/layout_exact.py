"""How far the planner's plan is from a better one, and from the bound, on small batches.

    python bench/layout_exact.py [--world 8] [--per-rank 4] [--batches 3] [--seconds 30]
    python bench/layout_exact.py --long [--batches 4] [--seconds 30]

Sparse (default): ``bench/planner_bench.py``'s sparse set-up (Megatron's mock lengths, capacity
2,048, 4-GPU nodes, ``--sparse-profile``) shrunk to ``--world`` ranks with ``--per-rank``
documents each. ``--long``: the long-document batches (16 documents, 64 ranks, capacity 8,192,
``--profile``). Per batch it prints the planner's plan (``time_limit`` 1 s, layout search off:
the constructor, the baselines and CP-SAT on the slots), the tight bound, and the best plan the
layout search (``dyncp.planner.improvement.laminar``: CP-SAT over every nested layout) finds in
``--seconds`` (two workers), once started from the planner's plan and once from nothing (the
faster of the two and the planner's), each as step ms and gap to the bound. Where the layout
search finds a faster plan, at least that much of the gap is the plan's; what is left is the
bound's or a plan neither found.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import planner_bench as pb  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.cost_model.evaluate import evaluate_plan  # noqa: E402
from dyncp.planner import Planner  # noqa: E402
from dyncp.planner.improvement.laminar import LaminarImprover  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--per-rank", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--profile", default="h100-reference")
    ap.add_argument("--sparse-profile", default="h100-megatron-dcp-gpt-plain")
    args = ap.parse_args()
    if args.long:
        rpn, world, capacity, max_length = 8, 64, 8192, pb.LONG_MAX
        model = CostModel.load(args.profile, ranks_per_node=rpn)
        batches = [pb.long_documents(pb.LONG_DOCUMENTS, args.seed + s) for s in range(args.batches)]
        what = f"long, {args.profile}"
    else:
        rpn, world, capacity, max_length = 4, args.world, pb.SPARSE_CAPACITY, pb.SPARSE_MAX
        model = CostModel.load(args.sparse_profile, ranks_per_node=rpn)
        n = args.per_rank * world
        batches = pb.sparse_documents(n, args.batches, args.seed)
        what = f"sparse, {args.per_rank} per rank, {args.sparse_profile}"
    print(
        f"{what}; {world} ranks, {rpn} per node, capacity {capacity}; layout search "
        f"{args.seconds:g} s; load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'batch':>5}{'seqs':>6}{'bound ms':>12}{'plan ms':>12}{'gap':>8}{'layout ms':>12}"
        f"{'gap':>8}{'plan over layout':>18}"
    )
    searches = [LaminarImprover(), LaminarImprover(hint=False)]
    for k, batch in enumerate(batches):
        planner = Planner(
            model,
            world=world,
            ranks_per_node=rpn,
            capacity=capacity,
            max_length=max_length,
            time_limit=1.0,
            layout=False,
        )
        plan = planner.plan(batch)
        step = plan.stats["predicted_step_seconds"]
        bound = plan.stats["lower_bound_seconds"]
        found = step  # the planner keeps the faster plan
        for search in searches:
            better, _ = search.solve(plan, model, args.seconds)
            if better is not None:
                found = min(found, evaluate_plan(better, model).step_seconds)
        print(
            f"{k:>5}{len(batch):>6}{bound * 1e3:>12.3f}{step * 1e3:>12.3f}"
            f"{step / bound - 1:>8.2%}{found * 1e3:>12.3f}{found / bound - 1:>8.2%}"
            f"{step / found - 1:>18.2%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
