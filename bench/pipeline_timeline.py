"""The measured timeline of one pipelined step on CPU gloo processes, per process and operation.

    python bench/pipeline_timeline.py                 # PP 2 x DP-CP 2, 1F1B, 4 processes
    python bench/pipeline_timeline.py --virtual 2     # interleaved, 2 virtual stages
    python bench/pipeline_timeline.py --json out.json

Runs ``execute_pipeline`` on the hand-written plan of the runtime tests (slots mixing CP 1 and 2,
a column idle in one slot) with the tiny decoder in fp64, twice (the first step pays the lazy
connections), and prints the second step's ``PipelineReport.ops`` of every process: kind, slot,
chunk, CP and the measured (start, end) in milliseconds since the step's start. This is the
measured side a predicted pipelined timeline is compared with; CPU gloo numbers say nothing
about a GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multirank"))

from dyncp.plan import Pipeline, StepPlan  # noqa: E402
from dyncp.runtime import (  # noqa: E402
    Activation,
    PipelineGroups,
    PipelineLayout,
    execute_pipeline,
    reduce_stage_gradients,
)
from dyncp.testing import tiny_chunks  # noqa: E402
from dyncp.testing.distributed import run_gloo  # noqa: E402


def _worker(rank: int, world: int, plan_json: str) -> dict:
    from test_pipeline_runtime import CFG, make_model, tokens_for

    groups = PipelineGroups(PipelineLayout(stages=2, columns=world // 2), timeout=60.0)
    plan = StepPlan.from_json(plan_json)
    tokens = tokens_for(plan.lengths, 0)
    report = None
    for _ in range(2):
        chunks = tiny_chunks(
            make_model(),
            plan.pipeline,
            groups.stage,
            lambda ctx: torch.cat([tokens[i] for i in ctx.seq_ids]),
        )
        report = execute_pipeline(
            plan, groups, chunks, activation=Activation(hidden=CFG.dim, dtype=torch.float64)
        )
        reduce_stage_gradients(chunks, groups)
    assert report is not None
    return {
        "rank": rank,
        "stage": report.stage,
        "column": report.column,
        "creation_seconds": groups.creation_seconds,
        "step_seconds": report.step_seconds,
        "ops": [[o.kind, o.slot, o.chunk, o.cp, o.start, o.end] for o in report.ops],
    }


def main() -> None:
    from test_pipeline_runtime import plan_two_columns

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--virtual", type=int, default=1, help="virtual stages per process")
    parser.add_argument("--json", type=Path, help="write the timelines here")
    args = parser.parse_args()
    plan = plan_two_columns(Pipeline(2, args.virtual))
    rows = run_gloo(_worker, world=4, args=(plan.to_json(),), timeout=300)
    for row in rows:
        print(
            f"rank {row['rank']} (stage {row['stage']}, column {row['column']}): step "
            f"{row['step_seconds'] * 1e3:.1f} ms, groups created in "
            f"{row['creation_seconds']:.2f} s"
        )
        for kind, slot, chunk, cp, start, end in row["ops"]:
            print(
                f"    {kind} slot {slot} chunk {chunk} cp {cp}: "
                f"{start * 1e3:8.2f} -> {end * 1e3:8.2f} ms"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
