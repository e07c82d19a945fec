"""``python -m dyncp.sim``: replay real length distributions and compare scheduling policies.

    python -m dyncp.sim                                   # bundled Wikipedia sample, defaults
    python -m dyncp.sim --dataset wlbllm --world 64 --ranks-per-node 8 --json out.json
    python -m dyncp.sim --dataset lengths.parquet --column n_tokens --max-length 65536

Prints, per policy: mean predicted step seconds, speedup vs static, mean imbalance, gap to the
lower bound, plan latency p50/p99 and the CP-size mix. Same arguments and seed, same numbers
(plan latencies are wall-clock measurements and vary).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.profile import ProfileError, bundled_profiles
from dyncp.datasets import (
    BUNDLED,
    DEFAULT_DATASET,
    DatasetError,
    describe,
    load_lengths,
    resolve_dataset,
)
from dyncp.planner.planner import POLICIES, Planner
from dyncp.sim.replay import OVERLONG_ACTIONS, admit, draw_batches, replay
from dyncp.sim.report import format_table, summarise


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dyncp.sim",
        description="Replay a length distribution and compare CP scheduling policies.",
    )
    p.add_argument(
        "--dataset",
        default=DEFAULT_DATASET,
        help=f"bundled sample ({', '.join(BUNDLED)}) or a file: .parquet .csv .jsonl .txt .npy "
        f"(default: {DEFAULT_DATASET})",
    )
    p.add_argument("--column", default=None, help="length column for parquet/csv/jsonl")
    p.add_argument("--world", type=_positive, default=64, help="DP x CP ranks (default 64)")
    p.add_argument("--ranks-per-node", type=_positive, default=8, help="(default 8)")
    p.add_argument(
        "--capacity",
        type=_positive,
        default=8192,
        help="tokens per rank per micro-batch, after zigzag padding (default 8192)",
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument(
        "--global-batch-tokens",
        type=_positive,
        default=None,
        help="tokens per global batch (default: 2 x world x capacity)",
    )
    batch.add_argument("--global-batch-size", type=_positive, default=None, help="documents/step")
    p.add_argument(
        "--max-length",
        type=_positive,
        default=131072,
        help="longest admitted document; sets the static policy's CP size (default 131072)",
    )
    p.add_argument(
        "--overlong",
        choices=OVERLONG_ACTIONS,
        default="truncate",
        help="what to do with longer documents (reported either way; default truncate)",
    )
    p.add_argument(
        "--profile",
        default="h100-reference",
        help=f"bundled profile ({', '.join(bundled_profiles())}) or a profile JSON path",
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated subset of {','.join(POLICIES)}",
    )
    p.add_argument("--steps", type=_positive, default=20, help="global batches to replay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = [s for s in policies if s not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies {args.policies!r}: choose from {','.join(POLICIES)}")
    try:
        path = resolve_dataset(args.dataset)
        raw = load_lengths(path, args.column)
        model = CostModel.load(args.profile, args.ranks_per_node)
        planners = {
            name: Planner(
                model,
                world=args.world,
                ranks_per_node=args.ranks_per_node,
                capacity=args.capacity,
                policy=name,
                max_length=args.max_length,
            )
            for name in policies
        }
    except (DatasetError, ProfileError, ValueError) as exc:
        parser.error(str(exc))
    longest = planners[policies[0]].topology.max_length()
    if args.max_length > longest:
        parser.error(
            f"--max-length {args.max_length} exceeds what the largest group holds ({longest} "
            f"tokens = world x capacity, less zigzag padding)"
        )
    lengths, admission = admit(raw, args.max_length, args.overlong)
    print(f"dataset {path} ({len(raw)} documents): {admission.summary()}", file=sys.stderr)
    tokens = args.global_batch_tokens
    if tokens is None and args.global_batch_size is None:
        tokens = 2 * args.world * args.capacity
    if len(lengths) == 0:
        parser.error(f"no document left to replay: {admission.summary()}")
    batches = list(
        draw_batches(
            lengths,
            steps=args.steps,
            seed=args.seed,
            global_batch_tokens=tokens,
            global_batch_size=args.global_batch_size,
        )
    )
    bar = tqdm(
        total=len(batches),
        desc="steps",
        unit="step",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
    runs, bounds = replay(batches, planners, progress=lambda: bar.update(1))
    bar.close()
    summary = summarise(runs, bounds)
    report = {
        "config": {
            "dataset": str(path),
            "world": args.world,
            "ranks_per_node": args.ranks_per_node,
            "capacity": args.capacity,
            "global_batch_tokens": tokens,
            "global_batch_size": args.global_batch_size,
            "max_length": args.max_length,
            "overlong": args.overlong,
            "profile": model.name,
            "steps": args.steps,
            "seed": args.seed,
            "policies": policies,
        },
        "dataset": {**describe(raw), "admission": asdict(admission)},
        "mean_batch_documents": float(sum(len(b) for b in batches) / len(batches)),
        **summary,
    }
    print(
        f"{args.steps} steps, {report['mean_batch_documents']:.0f} documents/step, "
        f"world {args.world} ({args.ranks_per_node}/node), capacity {args.capacity}, "
        f"profile {model.name}"
    )
    print(format_table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
