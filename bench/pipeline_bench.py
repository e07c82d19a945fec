"""Predicted: dyncp's pipelined plans against Megatron dev's dynamic CP with PP and static CP + PP.

    python bench/pipeline_bench.py            # PP 4 and 8, 64 and 512 H100 ranks, both datasets
    python bench/pipeline_bench.py --latency  # plan() wall clock at PP 4, 512 columns

Measured against predicted on gloo (PP 2 x DP-CP 2 and 4, 1F1B and interleaved, before and after
calibration, on held-out steps) is ``bench/pipeline_measured.py``.

Nothing here is measured but ``--latency``: every step time is a prediction of
``dyncp.cost_model.pipeline_timing.price_pipeline`` under the H100 reference profiles. Shapes and
profiles as ``bench/fsdp_predict.py``: the Llama-3-8B-like ``h100-reference`` (bundled) and a
Llama-3-70B-like profile built by ``dyncp.cost_model.reference`` from the DistCA H100 reference
folder (``--src``; skipped with a note when it is absent).

Batches: documents of ``--dataset`` (``wikipedia_flexsp``, ``wlbllm_distca``: column
``length``), longer ones split at ``--max-length`` (128 Ki tokens: a long-context pre-training
setup; ``dyncp.sim.replay.admit``), drawn by ``dyncp.sim.replay.draw_batches`` until a batch holds
``--step-tokens`` x columns x ``--capacity`` tokens (default 4: four micro-batches a column if
packed perfectly, so a plan needs splitting or smaller packs to reach the 2 x stages slots that
keep the 1F1B bubble under a third). Per dataset, model, columns and schedule (``--virtual``: 1
for 1F1B, 2 for interleaved), over ``--batches`` batches:

- ``dyncp``: ``Planner(pipeline=Pipeline(P, V))`` (``--stages``: P = 4 and 8), deterministic
  (closed-form bound, no CP-SAT, as ``fsdp_predict``), with the default ``StepBudget``;
- ``megatron-pp``: ``dyncp.planner.baselines.pipeline.megatron_pp_plan`` (every micro-batch over
  all ranks, powers of two, its order, the count aligned as Megatron dev's
  ``align_sample_id_groups``);
- ``static-pp``: static CP at the size that holds ``--max-length``, packs in order, the count
  aligned (``static_pp_plan``).

Columns: predicted step seconds (mean over the batches), the baselines' over dyncp's (the mean of
the per-batch ratios: > 1 means dyncp is faster), the chosen plan in verl's order over it (what
the order search gained), dyncp's bubble fraction and slot count, and its gap to the pipelined
lower bound (``dyncp.planner.bounds.pipeline``).

``--latency`` (wall clock of this machine): ``plan()`` of the default planner (wall-clock
budget, ``StepBudget()``) at PP 4 and ``--latency-world`` columns on ``--batches`` batches of each
dataset: p50 of ``plan()``'s wall clock against the p50 of the budget the step was given, and
the mean megatron-pp / dyncp step ratio of these (wall-clock budgeted) plans.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.pipeline_timing import price_pipeline
from dyncp.cost_model.reference import build_reference_profile
from dyncp.data.readers import load_lengths
from dyncp.plan import Pipeline
from dyncp.planner import Planner, StepBudget
from dyncp.planner.baselines.pipeline import megatron_pp_plan, static_pp_plan
from dyncp.planner.baselines.static import static_cp_size
from dyncp.sim.replay import admit, draw_batches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_predict import LLAMA3_70B  # noqa: E402

RANKS_PER_NODE = 8  # DGX H100
DATASETS = ("wikipedia_flexsp", "wlbllm_distca")


def models(src: Path) -> list[tuple[str, CostModel]]:
    out = [("8B", CostModel(load_profile("h100-reference"), RANKS_PER_NODE))]
    if src.is_dir():
        profile = build_reference_profile(src, shape=LLAMA3_70B)
        out.append(("70B", CostModel(profile, RANKS_PER_NODE)))
    else:
        print(f"(no 70B: --src {src} is not a folder; its profile is built from the DistCA CSVs)")
    return out


def steps(args: argparse.Namespace, dataset: str, world: int) -> list[np.ndarray]:
    lengths = load_lengths(Path(args.datasets) / f"{dataset}.parquet")
    lengths, _ = admit(lengths, args.max_length, "split")
    tokens = int(args.step_tokens * world * args.capacity)
    return list(
        draw_batches(lengths, steps=args.batches, seed=args.seed, global_batch_tokens=tokens)
    )


def planner(
    model: CostModel, world: int, args: argparse.Namespace, stages: int, virtual: int, **kw
) -> Planner:
    return Planner(
        model,
        world=world,
        ranks_per_node=RANKS_PER_NODE,
        capacity=args.capacity,
        max_length=args.max_length,
        bound="simple",
        pipeline=Pipeline(stages, virtual),
        budget=StepBudget(),
        **kw,
    )


def compare(args: argparse.Namespace) -> None:
    print(
        f"{'dataset':17} {'model':5} {'cols':>4} {'P':>1} {'V':>1} {'dyncp s':>8} {'mega s':>8} "
        f"{'static s':>8} {'mega/dyn':>8} {'stat/dyn':>8} {'verl/dyn':>8} {'bubble':>6} "
        f"{'slots':>5} {'gap':>6}"
    )
    for dataset in DATASETS:
        for world in args.worlds:
            batches = steps(args, dataset, world)
            for name, model in models(args.src):
                for stages, virtual in [(p, v) for p in args.stages for v in args.virtual]:
                    pipeline = Pipeline(stages, virtual)
                    plans = planner(
                        model, world, args, stages, virtual, deterministic=True, cpsat=None
                    )
                    cp = static_cp_size(args.max_length, plans.topology)
                    rows = []
                    for lengths in batches:
                        plan = plans.plan(lengths)
                        mega = megatron_pp_plan(lengths, plans.topology, pipeline)
                        static = static_pp_plan(lengths, plans.topology, model, cp, pipeline)
                        ours = plan.stats.predicted_step_seconds
                        stats = plan.stats["pipeline"]
                        gap = plan.stats.gap_to_lower_bound
                        rows.append(
                            (
                                ours,
                                price_pipeline(mega, model).step_seconds,
                                price_pipeline(static, model).step_seconds,
                                stats["bubble_fraction"],
                                stats["slots"],
                                np.nan if gap is None else gap,
                                stats["rule_step_seconds"],
                            )
                        )
                    a = np.asarray(rows, dtype=np.float64)
                    print(
                        f"{dataset:17} {name:5} {world:4d} {stages:1d} {virtual:1d} "
                        f"{a[:, 0].mean():8.3f} "
                        f"{a[:, 1].mean():8.3f} {a[:, 2].mean():8.3f} "
                        f"{(a[:, 1] / a[:, 0]).mean():8.3f} {(a[:, 2] / a[:, 0]).mean():8.3f} "
                        f"{(a[:, 6] / a[:, 0]).mean():8.3f} "
                        f"{a[:, 3].mean():6.3f} {a[:, 4].mean():5.1f} {a[:, 5].mean():6.3f}",
                        flush=True,
                    )


def latency(args: argparse.Namespace) -> None:
    _, model = models(args.src)[0]
    for dataset in DATASETS:
        for virtual in args.virtual:
            plans = planner(model, args.latency_world, args, 4, virtual)
            spent, given, ratio = [], [], []
            for lengths in steps(args, dataset, args.latency_world):
                t0 = time.perf_counter()
                plan = plans.plan(lengths)
                spent.append(time.perf_counter() - t0)
                given.append(plan.stats["budget"]["seconds"])
                mega = megatron_pp_plan(lengths, plans.topology, Pipeline(4, virtual))
                ratio.append(
                    price_pipeline(mega, model).step_seconds / plan.stats.predicted_step_seconds
                )
            print(
                f"{dataset:17} 8B {args.latency_world} columns V={virtual}: plan() p50 "
                f"{np.median(spent):.3f} s, budget p50 {np.median(given):.3f} s, "
                f"ratio {np.median(spent) / np.median(given):.2f}; these plans: megatron-pp / "
                f"dyncp {np.mean(ratio):.3f} ({len(spent)} batches)",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, default=Path("../shared/reference/h100-distca"))
    parser.add_argument("--datasets", default="../shared/datasets")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--capacity", type=int, default=8192, help="tokens a rank a micro-batch")
    parser.add_argument("--max-length", type=int, default=131072, help="longer documents split")
    parser.add_argument("--step-tokens", type=float, default=4.0, help="x columns x capacity")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", action="store_true", help="time plan() instead (docstring)")
    parser.add_argument("--latency-world", type=int, default=512)
    args = parser.parse_args(argv)
    print("python bench/pipeline_bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    (latency if args.latency else compare)(args)
    print(
        "measured against predicted on gloo, after calibration: python bench/pipeline_measured.py"
    )


if __name__ == "__main__":
    main()
