"""The policy tables: every policy on both shared length distributions, one run.

Shown in docs/reproductions/policy-tables.md.

    python bench/policy_tables.py [--steps 20] [--out results] [--profile h100-reference-step]

For each (dataset, scenario) it runs ``python -m dyncp.sim`` in-process, writes the JSON report to
``--out`` and prints the table, then a summary of dyncp's speedup over static, over
``megatron-core`` (megatron-core 0.16.1's released scheduler, what Megatron-LM users run today;
needs ``pip install 'dyncp[megatron]'``) and over ``megatron`` (Megatron-LM's dev-branch greedy),
measured in the same run, and how often the release exceeds the capacity. Scenarios (64 ranks,
8 per node, h100-reference profile):

- ``cross-node``: capacity 8192 tokens/rank, max length 131072 -> static CP 16 spans two nodes
  (the simulator's defaults);
- ``in-node``: capacity 16384 tokens/rank, max length 131072 -> static CP 8 stays on NVLink.

``--profile h100-reference-step`` plans exactly as h100-reference (the same micro-batch prices)
and adds the whole step's common parts (gradient reduction, optimizer): a second summary then
shows dyncp's whole-step speedups over static, megatron-core and megatron-dev (each policy's mean
``step_parts`` total), the figures the README leads with.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

from dyncp.sim.__main__ import main as sim_main

SCENARIOS = {
    "cross-node": ["--capacity", "8192", "--max-length", "131072"],
    "in-node": ["--capacity", "16384", "--max-length", "131072"],
}
DATASETS = ("wikipedia", "wlbllm")
POLICIES = "megatron-core,static,dp-balanced,batch-adaptive,megatron,dyncp"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--profile", default=None, help="default: the simulator's")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for scenario, flags in SCENARIOS.items():
        for dataset in DATASETS:
            out = args.out / f"{dataset}-{scenario}.json"
            argv = [
                "--dataset",
                dataset,
                *flags,
                "--steps",
                str(args.steps),
                "--policies",
                POLICIES,
            ]
            if args.profile is not None:
                argv = ["--profile", args.profile, *argv]
            argv += ["--json", str(out)]
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                sim_main(argv)
            print(f"$ python -m dyncp.sim {' '.join(argv[:-2])}")
            print(text.getvalue())
            report = json.loads(out.read_text())
            over = report["overflow"]["megatron-core"]
            rows.append(
                (
                    scenario,
                    dataset,
                    _speedups(report, "mean_step_seconds"),
                    report["policies"]["dyncp"]["mean_gap_to_lower_bound"],
                    f"{over['steps_packed_over']}/{over['steps']}",
                    _speedups(report, "whole step"),
                )
            )
    _summary("micro-batches", [(s, d, x, gap, over) for s, d, x, gap, over, _ in rows])
    if all(whole is not None for *_, whole in rows):
        _summary("whole step", [(s, d, w, gap, over) for s, d, _, gap, over, w in rows])


def _speedups(report: dict, measure: str) -> tuple[float, float, float] | None:
    """dyncp over static, megatron-core and megatron-dev, by the mean step seconds or, for
    ``"whole step"``, by each policy's mean whole step (None: the profile has no ``step``)."""
    policies = report["policies"]
    if measure == "whole step":
        if not all("mean_step_parts" in p for p in policies.values()):
            return None
        step = {k: v["mean_step_parts"]["total"] for k, v in policies.items()}
    else:
        step = {k: v[measure] for k, v in policies.items()}
    return tuple(step[base] / step["dyncp"] for base in ("static", "megatron-core", "megatron"))


def _summary(title: str, rows: list) -> None:
    print(f"{title}:")
    print(
        f"{'scenario':<12}{'dataset':<11}{'dyncp/static':>13}{'dyncp/megatron-core':>20}"
        f"{'dyncp/megatron-dev':>19}{'dyncp gap':>10}{'  release over capacity (rank-round)'}"
    )
    for scenario, dataset, (ds, dc, dm), gap, over in rows:
        print(
            f"{scenario:<12}{dataset:<11}{ds:>12.3f}x{dc:>19.3f}x{dm:>18.3f}x{gap:>10.1%}  {over}"
        )


if __name__ == "__main__":
    main()
