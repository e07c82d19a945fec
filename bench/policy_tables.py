"""The policy tables: every policy on both shared length distributions, one run.

Shown in docs/reproductions/policy-tables.md.

    python bench/policy_tables.py [--steps 20] [--out results] [--profile h100-reference-step]

For each (dataset, scenario) it runs ``python -m dyncp.sim`` in-process, writes the JSON report to
``--out`` and prints the table, then a summary of dyncp's speedup over static and over megatron
measured in the same run. Scenarios (64 ranks, 8 per node, h100-reference profile):

- ``cross-node``: capacity 8192 tokens/rank, max length 131072 -> static CP 16 spans two nodes
  (the simulator's defaults);
- ``in-node``: capacity 16384 tokens/rank, max length 131072 -> static CP 8 stays on NVLink.

``--profile h100-reference-step`` plans exactly as h100-reference (the same micro-batch prices)
and adds the whole step's common parts (gradient reduction, optimizer): the summary then shows
dyncp's whole-step speedup over static beside the micro-batch one.
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
            argv = ["--dataset", dataset, *flags, "--steps", str(args.steps), "--json", str(out)]
            if args.profile is not None:
                argv = ["--profile", args.profile, *argv]
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                sim_main(argv)
            print(f"$ python -m dyncp.sim {' '.join(argv[:-2])}")
            print(text.getvalue())
            report = json.loads(out.read_text())
            rows.append(
                (
                    scenario,
                    dataset,
                    report["speedup_vs_static"]["dyncp"],
                    report["speedup_vs_static"]["megatron"],
                    report["speedup_vs_megatron"]["dyncp"],
                    report["policies"]["dyncp"]["mean_gap_to_lower_bound"],
                    report.get("whole_step_speedup_vs_static", {}).get("dyncp"),
                )
            )
    print(
        f"{'scenario':<12}{'dataset':<11}{'dyncp/static':>13}{'megatron/static':>16}"
        f"{'dyncp/megatron':>15}{'dyncp gap':>10}{'whole step dyncp/static':>24}"
    )
    for scenario, dataset, ds, ms, dm, gap, whole in rows:
        shown = "-" if whole is None else f"{whole:.3f}x"  # a profile without the whole step
        print(
            f"{scenario:<12}{dataset:<11}{ds:>12.3f}x{ms:>15.3f}x{dm:>14.3f}x{gap:>10.1%}"
            f"{shown:>24}"
        )


if __name__ == "__main__":
    main()
