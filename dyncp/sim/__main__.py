"""``python -m dyncp.sim``: replay real length distributions and compare scheduling policies.

    python -m dyncp.sim                                   # bundled Wikipedia sample, defaults
    python -m dyncp.sim --dataset wlbllm --world 64 --ranks-per-node 8 --json out.json
    python -m dyncp.sim --dataset lengths.parquet --column n_tokens --max-length 65536
    python -m dyncp.sim --metrics-port 9464 --hold      # Prometheus metrics while replaying
    python -m dyncp.sim --plot plots/                    # Gantt charts and step-time plots
    python -m dyncp.sim --timing barrier                 # the wave-barrier price, to compare
    python -m dyncp.sim --pp 4 [--vpp 2] --plot plots/   # pipelined steps: bubble, pipelined bound

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

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import ProfileError
from dyncp.data.readers import DatasetError, describe, load_lengths, resolve_dataset
from dyncp.observability import Exporter, Metrics
from dyncp.plan import Pipeline, PlanError, StepPlan, Topology
from dyncp.plan.menu import menu_sizes
from dyncp.planner.planner import ALL_POLICIES, HYBRID_POLICY, POLICIES, Planner
from dyncp.sim.options import DEFAULT_MAX_LENGTH, OneLineParser, build_parser
from dyncp.sim.progress import Progress
from dyncp.sim.release import RELEASE_POLICY, ReleasePlanner, overflow_summary
from dyncp.sim.replay import (
    admit,
    batch_notes,
    draw_batches,
    plural,
    replay,
    synthetic_measurement,
)
from dyncp.sim.report import format_table, summarise


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


def _latency_note(time_limit: float | None) -> str:
    """What the table's plan p50/p99 columns measure, in the mode the planners ran in."""
    if time_limit is None:
        return (
            "planners: deterministic (same plans on any machine); plan p50/p99 = this machine's "
            "wall clock for the full deterministic search, not what a training job waits for "
            "(its plan service plans ahead under a deadline: try --time-limit 0.1)"
        )
    return (
        f"planners: anytime, under a {time_limit:g} s wall-clock deadline per step, as a "
        f"training job's plan service runs them (plans may vary with the machine's load); plan "
        f"p50/p99 = their wall clock"
    )


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


def _check_machine(
    parser: OneLineParser, args: argparse.Namespace, policies: list[str]
) -> tuple[int, ...]:
    """The CP-size menu of the machine the flags describe; a flag that does not fit is reported
    by its name and value (the planner's own errors name its arguments, not the flags)."""
    world, per_node = args.world, args.ranks_per_node
    if world > per_node and world % per_node:
        parser.error(
            f"--world {world} is not a whole number of nodes of --ranks-per-node {per_node}: "
            f"give a multiple of {per_node}, or at most {per_node} ranks (one node)"
        )
    try:
        sizes = (
            menu_sizes(args.group_sizes, world=world, ranks_per_node=per_node)
            if isinstance(args.group_sizes, str)
            else args.group_sizes
        )
        topology = Topology(world, per_node, args.capacity, tuple(sizes))
    except ValueError as exc:
        menu = args.group_sizes
        shown = ",".join(map(str, menu)) if isinstance(menu, tuple) else menu
        text = str(exc).removeprefix("Topology.group_sizes: ")
        for name, flag in (("world=", "--world "), ("ranks_per_node=", "--ranks-per-node ")):
            text = text.replace(name, flag)
        parser.error(f"--group-sizes {shown}: {text}")
    if HYBRID_POLICY in policies and args.head_sizes == (1,):
        parser.error(
            f"--policies {HYBRID_POLICY} chooses head splits: give --head-sizes beyond 1, such as "
            f"--head-sizes 1,2,4,8"
        )
    largest = max(topology.group_sizes)
    bad = [u for u in args.head_sizes if u > largest]
    if bad:
        parser.error(
            f"--head-sizes {','.join(map(str, args.head_sizes))}: {bad} exceed the largest group "
            f"({largest} ranks at --world {world})"
        )
    longest = topology.max_length()
    chosen = args.max_length is not None
    if not chosen:
        args.max_length = DEFAULT_MAX_LENGTH
    if args.max_length > longest:
        where = "--max-length" if chosen else "the default --max-length"
        parser.error(
            f"{where} {args.max_length} exceeds {longest} tokens, the longest document a group "
            f"holds at --world {world} and --capacity {args.capacity}: give --max-length "
            f"{longest} or less (longer documents then follow --overlong {args.overlong}; "
            f"split keeps every token), or raise --capacity"
        )
    return tuple(topology.group_sizes)


def _pipeline(parser: OneLineParser, args: argparse.Namespace) -> Pipeline | None:
    """``--pp``/``--vpp`` as a Pipeline (None without ``--pp``); what cannot run with a pipeline
    is reported by its flag."""
    if args.pp is None:
        if args.vpp != 1:
            parser.error(f"--vpp {args.vpp} needs --pp (the pipeline stages it interleaves)")
        return None
    try:
        pipeline = Pipeline(args.pp, args.vpp)
    except PlanError as exc:
        parser.error(f"--pp {args.pp} --vpp {args.vpp}: {str(exc).removeprefix('[pipeline] ')}")
    if args.metrics_port is not None:
        parser.error("--metrics-port with --pp: the metrics do not describe pipelined steps yet")
    return pipeline


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.policies is None:
        hybrid = args.head_sizes != (1,)
        args.policies = ",".join(ALL_POLICIES if hybrid else POLICIES)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    known = (RELEASE_POLICY, *ALL_POLICIES)
    unknown = [s for s in policies if s not in known]
    if unknown or not policies:
        parser.error(f"--policies {args.policies!r}: choose from {','.join(known)}")
    if RELEASE_POLICY in policies and args.pp is not None:
        parser.error(f"--policies {RELEASE_POLICY} with --pp: the release's dynamic CP has no PP")
    if args.metrics_port is None:
        for flag, value in (("--hold", args.hold), ("--step-delay", args.step_delay)):
            if value:
                parser.error(f"{flag} needs --metrics-port")
        if args.measurement_noise and args.plot is None:
            parser.error("--measurement-noise needs --metrics-port or --plot (where it is shown)")
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
    except (DatasetError, ValueError) as exc:
        parser.error(f"--dataset {args.dataset}: {exc}".replace(f": {args.dataset}: ", ": "))
    try:
        model = CostModel.load(args.profile, args.ranks_per_node)
    except (ProfileError, ValueError) as exc:
        parser.error(f"--profile {args.profile}: {exc}")
    sizes = _check_machine(parser, args, policies)
    pipeline = _pipeline(parser, args)
    release = None
    if RELEASE_POLICY in policies:
        if any(c & (c - 1) for c in sizes):
            parser.error(f"--policies {RELEASE_POLICY}: the release's CP sizes are powers of two")
        topology = Topology(args.world, args.ranks_per_node, args.capacity, sizes)
        release = ReleasePlanner(model, topology=topology, step_parts=True)
    try:
        planners = {
            name: release
            if name == RELEASE_POLICY
            else Planner(
                model,
                world=args.world,
                ranks_per_node=args.ranks_per_node,
                capacity=args.capacity,
                policy=name,
                max_length=args.max_length,
                head_sizes=args.head_sizes,
                group_sizes=sizes,
                timing=args.timing,
                pipeline=pipeline,
                step_parts=True,  # reported per step (not planning time)
                **_planner_mode(args.time_limit),
            )
            for name in policies
        }
    except ValueError as exc:
        parser.error(str(exc))
    lengths, admission = admit(raw, args.max_length, args.overlong)
    print(
        f"dataset {path} ({plural(len(raw), 'document')}): {admission.summary()}", file=sys.stderr
    )
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
    for line in batch_notes(batches, world=args.world):
        print(line, file=sys.stderr)
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

    measured_steps: dict[str, list[float]] = {name: [] for name in policies}

    def on_plan(step: int, name: str, plan: StepPlan) -> None:
        noisy = args.measurement_noise > 0
        cost = evaluate_plan(plan, model, timing=args.timing) if noisy else None
        if metrics is not None:
            metrics.observe_step(plan, cost=cost)
        if cost is not None:
            measured = synthetic_measurement(plan, cost, model, noise_rng, args.measurement_noise)
            measured_steps[name].append(measured.step_seconds)
            if metrics is not None:
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

    try:
        runs, bounds = replay(batches, planners, progress=progress, on_plan=on_plan)
    except RuntimeError as exc:  # the release's child process: absent megatron-core, a failure
        parser.error(str(exc))
    finally:
        if release is not None:
            release.close()
    bar.close()
    summary = summarise(runs, bounds)
    if release is not None:
        summary["overflow"] = {RELEASE_POLICY: overflow_summary(release.overflows)}
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
            "pipeline": None if pipeline is None else pipeline.to_dict(),
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
        + (
            ""
            if pipeline is None
            else f", pipelined over {pipeline.stages} stages ({pipeline.schedule}"
            + (f", {pipeline.virtual} virtual" if pipeline.virtual > 1 else "")
            + "): step s and gap to LB are the pipelined step's, static and megatron run "
            "static CP + PP and Megatron-dev-like PP"
        )
    )
    print(_latency_note(args.time_limit))
    print(format_table(summary))
    if release is not None:
        o = summary["overflow"][RELEASE_POLICY]
        print(
            f"{RELEASE_POLICY} over capacity: {o['steps_over']}/{o['steps']} steps with a "
            f"sub-sample over (max {o['max_ratio']:.2f}x), {o['steps_packed_over']}/{o['steps']} "
            f"with a rank's round over (max {o['max_rank_round_ratio']:.2f}x)"
        )
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
            measured=measured_steps if args.measurement_noise else None,
        )
        print(f"plots written: {', '.join(str(w) for w in written)}", file=sys.stderr)
    if exporter is not None:
        if args.hold:
            _hold(exporter, args.hold)
        exporter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
