"""Planner benchmark: plan quality against both lower bounds, CP-SAT's contribution, latency.

    python bench/planner_bench.py [--steps 50] [--cpsat-steps 10] [--profile h100-reference]
                                  [--data ../shared/datasets] [--contention 1] [--scale]
                                  [--explain 3] [--determinism]

Scenarios (512 sequences per step on 64 ranks, 8 per node, max length 131072): the two shared
length files (full parquet files when ``--data`` holds them, else the bundled samples) at
capacities 8192 and 16384 tokens per rank, and three length distributions constructed here (the
planner was not tuned on them), at capacity 8192:

- ``code``: long-tailed, 256 x (1 + Pareto(1.1)) tokens (source files and repositories);
- ``chat``: lognormal around 600 tokens (sigma 1.0): many short turns, a thin tail;
- ``bimodal``: 85% lognormal around 500 tokens, 15% uniform in [16K, 64K] (long documents mixed
  into short ones).

Per scenario it prints, for the default ``dyncp`` (``time_limit=0.1``): mean and max gap to the
tight LP bound and to the closed-form bound, speedup over ``megatron`` on the same batches, plan
latency p50/p99 of the whole ``plan()`` call quiet and while ``--contention`` CPU-bound processes
run on the same cores; and for ``dyncp+cpsat`` (``time_limit=1.0``: CP-SAT gets what the
constructor leaves, about 0.9 s) on the first ``--cpsat-steps`` batches: the share of the
remaining gap to the tight bound CP-SAT closes (mean over batches of (constructed - final) /
(constructed - bound)) and its outcomes. ``--scale`` plans steps of 32768 sequences on 4096 ranks
and 131072 on 16384 ranks and prints the wall time of ``plan()`` and its parts. ``--explain N``
prints, per scenario, the N batches furthest from the bound as text Gantts: each wave's level,
its groups of more than one rank (size, seconds, sequences, the long ones named) and the spread
of its single ranks' loads -- where a plan loses time is visible there. ``--determinism`` prints,
per scenario, what deterministic mode (``deterministic=True``: every candidate priced, no clock
read; the simulator's default) costs against the wall-clock ``dyncp`` in the same run: plan
latency p50/p99 of each and their ratio, the ratio of mean predicted step seconds, and whether the
deterministic plans planned quiet and again under ``--contention`` are identical (they must be).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.datasets import load_lengths, resolve_dataset
from dyncp.plan import StepPlan, plan_digest
from dyncp.planner import Planner
from dyncp.sim.replay import admit, draw_batches

MAX_LENGTH = 131072
WORLD, SEQUENCES, RANKS_PER_NODE = 64, 512, 8
FILES = {"wikipedia": "wikipedia_flexsp.parquet", "wlbllm": "wlbllm_distca.parquet"}
CONSTRUCTED = ("code", "chat", "bimodal")


def constructed(name: str, n: int, seed: int) -> np.ndarray:
    """Lengths of one constructed distribution (module docstring), clipped to [1, MAX_LENGTH]."""
    rng = np.random.default_rng(seed)
    if name == "code":
        x = 256 * (1 + rng.pareto(1.1, n))
    elif name == "chat":
        x = rng.lognormal(np.log(600), 1.0, n)
    elif name == "bimodal":
        long = rng.random(n) < 0.15
        x = np.where(long, rng.uniform(16384, 65536, n), rng.lognormal(np.log(500), 0.8, n))
    else:
        raise ValueError(f"unknown distribution {name!r}; choose one of {', '.join(CONSTRUCTED)}")
    return np.clip(np.rint(x), 1, MAX_LENGTH).astype(np.int64)


def scenarios(args: argparse.Namespace) -> Iterator[tuple[str, int, list[np.ndarray]]]:
    for name, file in FILES.items():
        path = args.data / file
        source = path if path.exists() else resolve_dataset(name)
        lengths, _ = admit(load_lengths(source), MAX_LENGTH, "truncate")
        batches = list(
            draw_batches(lengths, steps=args.steps, seed=args.seed, global_batch_size=SEQUENCES)
        )
        for capacity in (8192, 16384):
            yield f"{name} ({source.name})", capacity, batches
    for name in CONSTRUCTED:
        batches = [constructed(name, SEQUENCES, args.seed + s) for s in range(args.steps)]
        yield name, 8192, batches


def planner(model: CostModel, capacity: int, **kw) -> Planner:
    return Planner(
        model,
        world=WORLD,
        ranks_per_node=RANKS_PER_NODE,
        capacity=capacity,
        max_length=MAX_LENGTH,
        **kw,
    )


@contextmanager
def contention(processes: int) -> Iterator[None]:
    """``processes`` CPU-bound busy loops on the same cores as this process while inside."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    code = "import os\n"
    if cores:
        code += f"os.sched_setaffinity(0, {set(cores)!r})\n"
    code += "x = 0\nwhile True:\n    x = (x * 31 + 7) % 1000003\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    try:
        time.sleep(0.5)  # let them reach the busy loop
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


def explain(plan: StepPlan, model: CostModel, long_tokens: int) -> list[str]:
    """A text Gantt of ``plan``: per wave its level, its groups of more than one rank (size,
    seconds, how many sequences, those longer than ``long_tokens``) and its single ranks."""
    lengths = np.asarray(plan.lengths)
    cost = evaluate_plan(plan, model)
    lines = []
    for w, (wave, seconds) in enumerate(zip(plan.waves, cost.microbatch_seconds)):
        j, rings, singles = 0, [], []
        for group in wave.groups:
            n = len(group.microbatches)
            t = float(sum(seconds[j : j + n]))
            j += n
            ids = [i for mb in group.microbatches for i in mb.seq_ids]
            if group.size == 1:
                singles.append(t)
                continue
            longs = sorted((int(lengths[i]) for i in ids if lengths[i] > long_tokens), reverse=True)
            rings.append((group.size, t, len(ids), longs))
        rings.sort(key=lambda g: (-g[0], -g[1]))
        text = "; ".join(f"c{c} {t * 1e3:.0f} ms x{n} {longs}" for c, t, n, longs in rings)
        if singles:
            text += (
                f" | {len(singles)} singles {min(singles) * 1e3:.0f}-{max(singles) * 1e3:.0f} ms"
            )
        lines.append(f"    wave {w}: level {cost.wave_seconds[w] * 1e3:.0f} ms: {text}")
    return lines


def run_quality(model: CostModel, args: argparse.Namespace) -> None:
    header = (
        f"{'scenario':<34}{'cap':>6}{'gap':>7}{'max':>7}{'old gap':>8}{'old max':>8}"
        f"{'vs megatron':>12}{'p50 ms':>8}{'p99 ms':>8}{'p50 busy':>9}{'p99 busy':>9}"
        f"{'bound ms':>9}{'cpsat closes':>13}  cpsat outcomes"
    )
    print(header)
    for name, capacity, batches in scenarios(args):
        dyncp = planner(model, capacity, time_limit=args.time_limit)
        megatron = planner(model, capacity, policy="megatron")
        gaps, old, lat, bound_lat, secs, meg = [], [], [], [], [], []
        worst: list[tuple[float, int, StepPlan]] = []
        for b, batch in enumerate(batches):
            plan = dyncp.plan(batch)
            st = plan.stats
            worst = sorted([*worst, (st["gap_to_lower_bound"], b, plan)], key=lambda x: -x[0])
            worst = worst[: args.explain]
            gaps.append(st["gap_to_lower_bound"])
            old.append(st["gap_to_simple_bound"])
            lat.append(st["timings"]["plan_seconds"])
            bound_lat.append(st["timings"]["bound_seconds"])
            secs.append(st["predicted_step_seconds"])
            meg.append(megatron.plan(batch).stats["predicted_step_seconds"])
        busy = []
        if args.contention:
            with contention(args.contention):
                for batch in batches:
                    busy.append(dyncp.plan(batch).stats["timings"]["plan_seconds"])
        closes, outcomes = [], Counter()
        solver = planner(model, capacity, time_limit=1.0)
        for batch in batches[: args.cpsat_steps]:
            st = solver.plan(batch).stats
            outcomes[st["solver"]["status"].split(":")[0]] += 1
            left = st["greedy_step_seconds"] - st["lower_bound_seconds"]
            won = st["greedy_step_seconds"] - st["predicted_step_seconds"]
            closes.append(won / left if left > 0 else 0.0)
        print(
            f"{name:<34}{capacity:>6}{np.mean(gaps):>7.1%}{np.max(gaps):>7.1%}"
            f"{np.mean(old):>8.1%}{np.max(old):>8.1%}{np.mean(meg) / np.mean(secs):>11.3f}x"
            f"{ms(lat, 50):>8.1f}{ms(lat, 99):>8.1f}"
            f"{(ms(busy, 50) if busy else float('nan')):>9.1f}"
            f"{(ms(busy, 99) if busy else float('nan')):>9.1f}"
            f"{ms(bound_lat, 50):>9.1f}"
            f"{(np.mean(closes) if closes else float('nan')):>13.1%}  {dict(outcomes)}",
            flush=True,
        )
        for gap, b, plan in worst:
            st = plan.stats
            seconds, bound = st["predicted_step_seconds"], st["lower_bound_seconds"]
            old = st["simple_lower_bound_seconds"]
            print(
                f"  batch {b}: gap {gap:.1%}, {seconds * 1e3:.0f} ms, bound {bound * 1e3:.0f} ms "
                f"(old {old * 1e3:.0f})"
            )
            print("\n".join(explain(plan, model, capacity)), flush=True)


def run_determinism(model: CostModel, args: argparse.Namespace) -> None:
    print(
        f"{'scenario':<34}{'cap':>6}{'wall p50':>9}{'wall p99':>9}{'det p50':>9}{'det p99':>9}"
        f"{'p50 x':>7}{'p99 x':>7}{'step det/wall':>14}  same plans under load"
    )
    for name, capacity, batches in scenarios(args):
        wall = planner(model, capacity, time_limit=args.time_limit)
        det = planner(model, capacity, deterministic=True)
        wall_lat, det_lat, wall_secs, det_secs, quiet = [], [], [], [], []
        for batch in batches:
            a, b = wall.plan(batch), det.plan(batch)
            wall_lat.append(a.stats["timings"]["plan_seconds"])
            det_lat.append(b.stats["timings"]["plan_seconds"])
            wall_secs.append(a.stats["predicted_step_seconds"])
            det_secs.append(b.stats["predicted_step_seconds"])
            quiet.append(plan_digest(b))
        with contention(max(args.contention, 1)):
            loaded = [plan_digest(det.plan(batch)) for batch in batches]
        same = sum(x == y for x, y in zip(quiet, loaded))
        print(
            f"{name:<34}{capacity:>6}{ms(wall_lat, 50):>9.1f}{ms(wall_lat, 99):>9.1f}"
            f"{ms(det_lat, 50):>9.1f}{ms(det_lat, 99):>9.1f}"
            f"{ms(det_lat, 50) / ms(wall_lat, 50):>6.2f}x"
            f"{ms(det_lat, 99) / ms(wall_lat, 99):>6.2f}x"
            f"{np.mean(det_secs) / np.mean(wall_secs):>14.4f}  {same}/{len(batches)}",
            flush=True,
        )


def run_scale(model: CostModel, args: argparse.Namespace) -> None:
    path = args.data / FILES["wikipedia"]
    source = path if path.exists() else resolve_dataset("wikipedia")
    lengths, _ = admit(load_lengths(source), MAX_LENGTH, "truncate")
    for world, n, limit in ((4096, 32768, 2.0), (16384, 131072, 8.0)):
        p = Planner(
            model, world=world, ranks_per_node=RANKS_PER_NODE, capacity=8192, time_limit=limit
        )
        draws = draw_batches(lengths, steps=args.scale_steps, seed=args.seed, global_batch_size=n)
        for batch in draws:
            t0 = time.perf_counter()
            plan = p.plan(batch)
            wall = time.perf_counter() - t0
            deferred = "deferred, " if p.bound_pending(plan) else ""
            p.wait_bound(plan)  # a deferred bound is computed after plan() returns
            t = plan.stats["timings"]
            print(
                f"{n} sequences / {world} ranks (time_limit {limit}): plan() {wall:.2f} s "
                f"(construct {t['construct_seconds']:.2f}, validate {t['validate_seconds']:.2f}, "
                f"bound {deferred}{t['bound_seconds']:.2f}; {t['candidates']} candidates), gap "
                f"{plan.stats['gap_to_lower_bound']:.1%} (old bound "
                f"{plan.stats['gap_to_simple_bound']:.1%}), {len(plan.waves)} waves",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="batches per scenario")
    parser.add_argument("--cpsat-steps", type=int, default=10, help="batches given CP-SAT 1 s")
    parser.add_argument("--time-limit", type=float, default=0.1)
    parser.add_argument("--contention", type=int, default=1, help="busy processes (0: none)")
    parser.add_argument("--profile", default="h100-reference")
    parser.add_argument("--data", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", action="store_true", help="also plan 4096- and 16384-rank steps")
    parser.add_argument("--scale-steps", type=int, default=2)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument(
        "--determinism", action="store_true", help="deterministic mode's cost (docstring)"
    )
    parser.add_argument(
        "--explain", type=int, default=0, help="text Gantts of the N worst batches per scenario"
    )
    args = parser.parse_args()
    model = CostModel.load(args.profile, ranks_per_node=RANKS_PER_NODE)
    print(
        f"profile {args.profile}; {SEQUENCES} sequences / {WORLD} ranks; dyncp time_limit "
        f"{args.time_limit}; {args.steps} batches per scenario; {os.cpu_count()} CPUs; "
        f"contention: {args.contention} busy process(es)"
    )
    if not args.no_quality:
        run_quality(model, args)
    if args.determinism:
        run_determinism(model, args)
    if args.scale:
        run_scale(model, args)


if __name__ == "__main__":
    main()
