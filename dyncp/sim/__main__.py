"""``python -m dyncp.sim``: replay real length distributions and compare scheduling policies.

    python -m dyncp.sim                                   # bundled Wikipedia sample, defaults
    python -m dyncp.sim --dataset wlbllm --world 64 --ranks-per-node 8 --json out.json
    python -m dyncp.sim --dataset lengths.parquet --column n_tokens --max-length 65536
    python -m dyncp.sim --metrics-port 9464 --hold      # Prometheus metrics while replaying
    python -m dyncp.sim --plot plots/                    # Gantt charts and step-time plots
    python -m dyncp.sim --timing barrier                 # the wave-barrier price, to compare

Prints, per policy: mean predicted step seconds, speedup vs static, mean imbalance, gap to the
lower bound, plan latency p50/p99 and the CP-size mix, all under ``--timing`` (default dataflow:
no barrier between waves, as dyncp's runtime runs a plan; the planners optimise it too). Same
arguments and seed, same numbers on any machine and under any load (plan latencies are
wall-clock measurements and vary): the planners run in deterministic mode, pricing every
candidate and never reading a clock, unless ``--time-limit`` asks for the anytime planner a
training job runs under a wall-clock deadline (docs/guides/determinism.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import ProfileError, bundled_profiles
from dyncp.data.readers import (
    BUNDLED,
    DEFAULT_DATASET,
    DatasetError,
    describe,
    load_lengths,
    resolve_dataset,
)
from dyncp.observability import Exporter, Metrics
from dyncp.plan import StepPlan
from dyncp.plan.menu import MENU_KINDS, menu_sizes
from dyncp.planner.planner import ALL_POLICIES, HYBRID_POLICY, POLICIES, Planner
from dyncp.sim.progress import Progress
from dyncp.sim.replay import (
    OVERLONG_ACTIONS,
    admit,
    draw_batches,
    replay,
    synthetic_measurement,
)
from dyncp.sim.report import format_table, summarise


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _deadline(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def _head_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,2,4,8, got {text!r}"
        ) from None
    if not sizes or any(u < 1 for u in sizes):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,2,4,8, got {text!r}"
        )
    return tuple(sorted({1, *sizes}))


def _group_sizes(text: str) -> str | tuple[int, ...]:
    """A menu kind (``dyncp.plan.menu.MENU_KINDS``) or comma-separated sizes."""
    if text in MENU_KINDS:
        return text
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(c < 1 for c in sizes):
        raise argparse.ArgumentTypeError(
            f"expected {' or '.join(MENU_KINDS)} or comma-separated positive sizes such as "
            f"1,2,3,6,12, got {text!r}"
        )
    return tuple(sorted(set(sizes)))


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {value}")
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
        default=None,
        help=f"comma-separated subset of {','.join(ALL_POLICIES)} (default: all; "
        f"{HYBRID_POLICY} only with --head-sizes)",
    )
    p.add_argument(
        "--head-sizes",
        type=_head_sizes,
        default=(1,),
        metavar="U,U,...",
        help="head-parallel degrees a group may use (u ranks exchange heads by all-to-all, the "
        "rest form the ring), e.g. 1,2,4,8; the dyncp-hybrid policy chooses among them "
        "(default 1: rings only)",
    )
    p.add_argument(
        "--group-sizes",
        type=_group_sizes,
        default="powers-of-two",
        metavar="MENU",
        help="the menu of CP sizes: powers-of-two (default: those dividing the world that fit "
        "the placement rules), divisors (divisors of --ranks-per-node, the NVLink domain, and "
        "whole-domain multiples), or a list such as 1,2,3,4,6,8,12 (see dyncp.plan.menu)",
    )
    p.add_argument(
        "--time-limit",
        type=_deadline,
        default=None,
        metavar="SECONDS",
        help="plan under a wall-clock deadline of SECONDS per step, as a training job's anytime "
        "planner does; plans then depend on the machine and its load (default: deterministic "
        "planners, the same plans on any machine)",
    )
    p.add_argument(
        "--timing",
        choices=TIMINGS,
        default="dataflow",
        help="how a step is timed, planned for and reported: dataflow (default; no barrier "
        "between waves, how dyncp's runtime runs a plan) or barrier (every wave ends together, "
        "the price before dataflow execution; kept for one release, for comparison)",
    )
    p.add_argument("--steps", type=_positive, default=20, help="global batches to replay")
    p.add_argument("--seed", type=_seed, default=0, help="(an integer >= 0; default 0)")
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    obs = p.add_argument_group("metrics and plots")
    obs.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port while replaying (0: a free port, printed)",
    )
    obs.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address to serve on (default 127.0.0.1)",
    )
    obs.add_argument(
        "--hold",
        type=_seconds,
        nargs="?",
        const=math.inf,
        default=None,
        metavar="SECONDS",
        help="keep serving metrics after the replay: SECONDS, or until interrupted if omitted",
    )
    obs.add_argument(
        "--step-delay",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="pause after each step so that a dashboard sees the replay unfold (default 0)",
    )
    obs.add_argument(
        "--measurement-noise",
        type=_seconds,
        default=0.0,
        metavar="SIGMA",
        help="also feed synthetic 'measured' steps: each micro-batch's predicted time times "
        "exp(N(0, SIGMA)), to try the measured-vs-predicted panels without a GPU (default 0: "
        "no measured series)",
    )
    obs.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="DIR",
        help="write PNGs: gantt-<policy>.png, gantt.png, step-seconds.png (needs matplotlib)",
    )
    obs.add_argument(
        "--plot-step",
        type=int,
        default=0,
        metavar="K",
        help="step the Gantt charts show (default 0)",
    )
    return p


def _planner_mode(time_limit: float | None) -> dict:
    """Planner arguments: deterministic unless a wall-clock ``time_limit`` is asked for.

    Deterministic mode makes the README's promise true on any machine and under any load: the
    greedy prices every candidate and bounds its local search by rounds, and CP-SAT (which needs
    ``min_improve_seconds`` of budget) does not run at the default budget, so nothing reads a
    clock. The wall-clock mode is what a training job's anytime planner does and what its plan
    latency looks like; its plans may differ from run to run when the machine is loaded.
    """
    if time_limit is None:
        return {"deterministic": True}
    return {"deterministic": False, "time_limit": time_limit}


def _hold(exporter: Exporter, seconds: float) -> None:
    forever = math.isinf(seconds)
    how = "until interrupted (Ctrl-C)" if forever else f"for {seconds:g} s"
    print(f"replay done; serving {exporter.url} {how}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + seconds
    try:
        while forever or time.monotonic() < deadline:
            time.sleep(1.0 if forever else min(1.0, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.policies is None:
        hybrid = args.head_sizes != (1,)
        args.policies = ",".join(ALL_POLICIES if hybrid else POLICIES)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = [s for s in policies if s not in ALL_POLICIES]
    if unknown or not policies:
        parser.error(f"--policies {args.policies!r}: choose from {','.join(ALL_POLICIES)}")
    if args.metrics_port is None:
        for flag, value in (
            ("--hold", args.hold),
            ("--step-delay", args.step_delay),
            ("--measurement-noise", args.measurement_noise),
        ):
            if value:
                parser.error(f"{flag} needs --metrics-port")
    if args.json is not None:
        folder = args.json.parent
        if args.json.is_dir():
            parser.error(f"--json {args.json}: is a directory; give a file name")
        if not folder.is_dir():
            parser.error(f"--json {args.json}: directory {folder} does not exist")
    if not 0 <= args.plot_step < args.steps:
        parser.error(f"--plot-step {args.plot_step}: choose a step in 0..{args.steps - 1}")
    if args.plot is not None:
        from dyncp.sim.plots import PlotsUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotsUnavailable as exc:
            parser.error(f"--plot: {exc}")
    try:
        path = resolve_dataset(args.dataset)
        raw = load_lengths(path, args.column)
        model = CostModel.load(args.profile, args.ranks_per_node)
        sizes = (
            menu_sizes(args.group_sizes, world=args.world, ranks_per_node=args.ranks_per_node)
            if isinstance(args.group_sizes, str)
            else args.group_sizes
        )
        planners = {
            name: Planner(
                model,
                world=args.world,
                ranks_per_node=args.ranks_per_node,
                capacity=args.capacity,
                policy=name,
                max_length=args.max_length,
                head_sizes=args.head_sizes,
                group_sizes=sizes,
                timing=args.timing,
                **_planner_mode(args.time_limit),
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
    try:
        batches = list(
            draw_batches(
                lengths,
                steps=args.steps,
                seed=args.seed,
                global_batch_tokens=tokens,
                global_batch_size=args.global_batch_size,
            )
        )
    except ValueError as exc:
        flag = "--global-batch-size" if args.global_batch_size else "--global-batch-tokens"
        parser.error(f"--dataset {path}: {exc} ({flag})")
    metrics: Metrics | None = None
    exporter: Exporter | None = None
    if args.metrics_port is not None:
        metrics = Metrics(policies=policies, cp_sizes=planners[policies[0]].topology.group_sizes)
        try:
            exporter = metrics.serve(port=args.metrics_port, addr=args.metrics_addr)
        except OSError as exc:
            parser.error(f"--metrics-port {args.metrics_port} on {args.metrics_addr}: {exc}")
        print(f"serving metrics on {exporter.url}", file=sys.stderr, flush=True)
    noise_rng = np.random.default_rng(args.seed)
    shown: dict[str, StepPlan] = {}

    def on_plan(step: int, name: str, plan: StepPlan) -> None:
        if metrics is not None:
            noisy = args.measurement_noise > 0
            cost = evaluate_plan(plan, model, timing=args.timing) if noisy else None
            metrics.observe_step(plan, cost=cost)
            if cost is not None:
                measured = synthetic_measurement(
                    plan, cost, model, noise_rng, args.measurement_noise
                )
                metrics.observe_measured_step(
                    policy=name,
                    step_seconds=measured.step_seconds,
                    rank_busy_seconds=measured.rank_busy_seconds,
                    predicted_step_seconds=cost.step_seconds,
                )
        if args.plot is not None and step == args.plot_step:
            shown[name] = plan

    bar = Progress(len(batches))

    def progress() -> None:
        bar.update(1)
        if args.step_delay:
            time.sleep(args.step_delay)

    runs, bounds = replay(batches, planners, progress=progress, on_plan=on_plan)
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
            "head_sizes": list(args.head_sizes),
            "group_sizes": list(planners[policies[0]].topology.group_sizes),
            "planner": "deterministic" if args.time_limit is None else "wall-clock",
            "time_limit": args.time_limit,
            "timing": args.timing,
        },
        "dataset": {**describe(raw), "admission": asdict(admission)},
        "mean_batch_documents": float(sum(len(b) for b in batches) / len(batches)),
        **summary,
    }
    print(
        f"{args.steps} steps, {report['mean_batch_documents']:.0f} documents/step, "
        f"world {args.world} ({args.ranks_per_node}/node), capacity {args.capacity}, "
        f"profile {model.name}, group sizes {list(planners[policies[0]].topology.group_sizes)}, "
        f"{args.timing} timing"
    )
    print(format_table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}", file=sys.stderr, flush=True)
    if args.plot is not None:
        from dyncp.sim.plots import write_plots

        caption = (
            f"{Path(str(path)).name}, world {args.world} ({args.ranks_per_node}/node), "
            f"capacity {args.capacity}, profile {model.name}"
        )
        written = write_plots(
            args.plot,
            plans=shown,
            model=model,
            runs=runs,
            bounds=bounds,
            step=args.plot_step,
            caption=caption,
        )
        print(f"plots written: {', '.join(str(w) for w in written)}", file=sys.stderr)
    if exporter is not None:
        if args.hold:
            _hold(exporter, args.hold)
        exporter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
