"""Plan digests of the bench scenarios: proof that a refactor changed no plan.

    python bench/plan_digests.py --out before.json              # record
    python bench/plan_digests.py --check before.json            # compare; exit 1 on a change

Every scenario of ``bench/planner_bench.py`` (the shared length files or their bundled samples,
the constructed distributions, ``long``, ``sparse-*``) is planned in deterministic mode (every
candidate priced, no clock read: the same plan on any machine and under any load) by each policy
(``static``, ``dp-balanced``, ``batch-adaptive``, ``megatron``, ``dyncp``), and by ``dyncp`` on a
layer-mix model too. Recorded per plan: ``plan_digest`` (what the plan executes), the predicted
step seconds, both bounds, the gap and which construction won, as ``repr`` of each value so that a
change in the last bit shows. ``--check`` names every plan that differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_bench import scenarios  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.plan import plan_digest  # noqa: E402
from dyncp.planner import POLICIES  # noqa: E402

MIX_PROFILE = "h100-nemotron-h-8b-like"
#: The stats that deterministic mode fixes (wall-clock timings left out).
FIELDS = (
    "predicted_step_seconds",
    "lower_bound_seconds",
    "simple_lower_bound_seconds",
    "gap_to_lower_bound",
    "construction",
    "chosen",
)


def record(args: argparse.Namespace) -> dict[str, list]:
    """``{scenario/policy: [[digest, predicted seconds, bound], ...]}`` over every batch."""
    out: dict[str, list] = {}
    model = CostModel.load(args.profile, ranks_per_node=8)
    mix = CostModel.load(MIX_PROFILE, ranks_per_node=8)
    for sc in scenarios(args, model):
        runs = [(policy, sc.planner(policy=policy, deterministic=True)) for policy in POLICIES]
        if sc.model is model:
            sc.model = mix
            runs.append(("dyncp-mix", sc.planner(deterministic=True)))
            sc.model = model
        for policy, planner in runs:
            rows = []
            for batch in sc.batches:
                plan = planner.plan(batch)
                rows.append([plan_digest(plan), *(repr(plan.stats.get(k)) for k in FIELDS)])
            out[f"{sc.name} cap={sc.capacity}/{policy}"] = rows
            print(f"{sc.name:<40} cap={sc.capacity:<6} {policy:<15} {len(rows)} plans", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="h100-reference")
    p.add_argument("--sparse-profile", default="h100-megatron-dcp-gpt-plain")
    p.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    p.add_argument("--scenarios", nargs="*", default=[])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path)
    g.add_argument("--check", type=Path)
    args = p.parse_args()
    got = record(args)
    if args.out is not None:
        args.out.write_text(json.dumps(got, indent=1) + "\n")
        print(f"{sum(len(v) for v in got.values())} plans recorded in {args.out}")
        return
    want = json.loads(args.check.read_text())
    changed = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    for k in changed:
        print(f"CHANGED: {k}")
    total = sum(len(v) for v in want.values())
    print(f"{total - sum(len(want.get(k, [])) for k in changed)}/{total} plans identical")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
