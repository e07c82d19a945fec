"""Planner benchmark: plan quality against both lower bounds, CP-SAT's contribution, latency.

    python bench/planner_bench.py [--steps 50] [--cpsat-steps 10] [--profile h100-reference]
                                  [--data ../shared/datasets] [--contention 1] [--scale]
                                  [--explain 3] [--determinism] [--budgets 0.1,0.3,1,3,step]
                                  [--scenarios long sparse-2] [--sparse-profile NAME]

Scenarios (512 sequences per step on 64 ranks, 8 per node, max length 131072): the two shared
length files (full parquet files when ``--data`` holds them, else the bundled samples) at
capacities 8192 and 16384 tokens per rank, and three length distributions constructed here (the
planner was not tuned on them), at capacity 8192:

- ``code``: long-tailed, 256 x (1 + Pareto(1.1)) tokens (source files and repositories);
- ``chat``: lognormal around 600 tokens (sigma 1.0): many short turns, a thin tail;
- ``bimodal``: 85% lognormal around 500 tokens, 15% uniform in [16K, 64K] (long documents mixed
  into short ones).

Two more kinds of scenario, each with its own shape:

- ``long``: long-context training (continued pre-training on books, repositories, long
  conversations), where a batch is a token budget filled by a few long documents: 16 documents
  per step, lognormal with median 96K tokens and sigma 0.8, clipped to [8K, 512K] (about 2M
  tokens, 4 passes of 8,192 tokens per rank; the longest need CP 32-64), on 64 ranks, 8 per node,
  capacity 8,192, max length 512K (which sets the static CP size: 64). Run it with
  ``--profile published-flexsp`` too (the FlexSP-style all-to-all form).
- ``sparse-1``, ``sparse-2``, ``sparse-4``: Megatron's dynamic-CP example set-up
  (``bench/megatron_repro.py``: lognormal with mean 1,024 and sigma 1.5 clipped to [128, 8192],
  capacity 2,048, nodes of 4 GPUs, max length 8,192) on 64 GPUs with 1, 2 and 4 documents per
  rank (64, 128, 256 per step; 2 is the published set-up), priced with ``--sparse-profile``
  (default ``h100-megatron-dcp-gpt-plain``, that set-up's profile in the form the sparse losses
  were reported with; ``h100-megatron-dcp-gpt`` is its kernel-aware form). The search was tuned on
  batches of many documents per rank; here most ranks hold one or two.

Every scenario's row also prints dyncp's ratio to the best baseline policy (``static``,
``dp-balanced``, ``batch-adaptive``, ``megatron``, each planned on the same batch and priced with
the same model and timing), per step: its mean and its maximum (``/base``), which must not exceed
1.0 (``Planner`` keeps the baselines as candidates, ``dyncp.planner.baselines``); and, for the
same planner without them (``baselines=False``: dyncp's own construction), the maximum ratio and
the number of steps on which it loses (``own max``, ``own >``).

``--budgets 0.1,0.3,1,3`` prints, per scenario and per budget (``time_limit`` seconds: the
constructor, then CP-SAT for what is left), the mean and max gap to the tight bound, the mean gap
to the best plan any budget found for the batch (how much of the gap is the plan's: what is left
against the bound beyond it is the bound's, or a plan no budget found), the ratio to the best
baseline (max over steps), the share of steps whose plan is faster than the constructor's
(``improved``: CP-SAT or a baseline) and of steps whose plan started from a baseline, and the p50
wall and CPU time of ``plan()`` (CPU: this process, all its threads; under load a wall-clock
budget buys less CPU, so compare the two). ``step`` among the budgets plans with the default
``StepBudget`` (a quarter of the constructed plan's predicted step, within [0.1 s, 2 s]: the
plan service's); its row, marked ``*``, shows the mean budget the steps got.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.cost_model.evaluate import TIMINGS, evaluate_plan
from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import StepPlan, plan_digest
from dyncp.planner import Planner
from dyncp.planner.budget import StepBudget
from dyncp.sim.replay import admit, draw_batches

MAX_LENGTH = 131072
WORLD, SEQUENCES, RANKS_PER_NODE = 64, 512, 8
FILES = {"wikipedia": "wikipedia_flexsp.parquet", "wlbllm": "wlbllm_distca.parquet"}
CONSTRUCTED = ("code", "chat", "bimodal")
# The long-document scenario (module docstring).
LONG_DOCUMENTS, LONG_MEDIAN, LONG_SIGMA, LONG_MIN, LONG_MAX = 16, 98304, 0.8, 8192, 524288
# The sparse scenarios: Megatron's example set-up (bench/megatron_repro.py) on 64 GPUs.
SPARSE_WORLD, SPARSE_RANKS_PER_NODE, SPARSE_CAPACITY, SPARSE_PER_RANK = 64, 4, 2048, (1, 2, 4)
SPARSE_MEAN, SPARSE_SIGMA, SPARSE_MIN, SPARSE_MAX = 1024, 1.5, 128, 8192
BASELINE_POLICIES = ("static", "dp-balanced", "batch-adaptive", "megatron")


@dataclass
class Scenario:
    """One scenario: its batches and the shape and model they are planned on."""

    name: str
    capacity: int
    batches: list[np.ndarray]
    model: CostModel
    world: int = WORLD
    ranks_per_node: int = RANKS_PER_NODE
    max_length: int = MAX_LENGTH
    timing: str | None = None  # every planner's objective (None: the Planner's default)

    def planner(self, **kw) -> Planner:
        if self.timing is not None:
            kw.setdefault("timing", self.timing)
        return Planner(
            self.model,
            world=self.world,
            ranks_per_node=self.ranks_per_node,
            capacity=self.capacity,
            max_length=self.max_length,
            **kw,
        )


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


def long_documents(n: int, seed: int) -> np.ndarray:
    """One long-document batch (module docstring): lognormal, clipped to [LONG_MIN, LONG_MAX]."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(np.log(LONG_MEDIAN), LONG_SIGMA, n)
    return np.clip(np.rint(x), LONG_MIN, LONG_MAX).astype(np.int64)


def sparse_documents(n: int, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` sparse batches of ``n``: Megatron's mock lengths (mean SPARSE_MEAN, sigma
    SPARSE_SIGMA), drawn as ``bench/megatron_repro.py`` draws them (NumPy's legacy generator, one
    stream cut into consecutive batches), so seed 0 with 2 per rank is that script's 64-GPU run."""
    rng = np.random.RandomState(seed)
    mu = np.log(SPARSE_MEAN) - SPARSE_SIGMA**2 / 2
    x = np.clip(rng.lognormal(mu, SPARSE_SIGMA, n * steps), SPARSE_MIN, SPARSE_MAX)
    return list(x.astype(np.int64).reshape(steps, n))


def scenarios(args: argparse.Namespace, model: CostModel) -> Iterator[Scenario]:
    """The scenarios whose name starts with one of ``args.scenarios`` (all without it), planned
    under ``args.timing``."""
    for sc in _scenarios(args, model):
        sc.timing = getattr(args, "timing", None)
        yield sc


def _scenarios(args: argparse.Namespace, model: CostModel) -> Iterator[Scenario]:

    def wanted(name: str) -> bool:
        return not args.scenarios or any(name.startswith(w) for w in args.scenarios)

    for name, file in FILES.items():
        if not wanted(name):
            continue
        path = args.data / file
        source = path if path.exists() else resolve_dataset(name)
        lengths, _ = admit(load_lengths(source), MAX_LENGTH, "truncate")
        batches = list(
            draw_batches(lengths, steps=args.steps, seed=args.seed, global_batch_size=SEQUENCES)
        )
        for capacity in (8192, 16384):
            yield Scenario(f"{name} ({source.name})", capacity, batches, model)
    for name in CONSTRUCTED:
        if wanted(name):
            batches = [constructed(name, SEQUENCES, args.seed + s) for s in range(args.steps)]
            yield Scenario(name, 8192, batches, model)
    if wanted("long"):
        batches = [long_documents(LONG_DOCUMENTS, args.seed + s) for s in range(args.steps)]
        yield Scenario("long", 8192, batches, model, max_length=LONG_MAX)
    sparse_model = None
    for per_rank in SPARSE_PER_RANK:
        name = f"sparse-{per_rank}"
        if not wanted(name):
            continue
        if sparse_model is None:
            sparse_model = CostModel.load(args.sparse_profile, ranks_per_node=SPARSE_RANKS_PER_NODE)
        n = per_rank * SPARSE_WORLD
        batches = sparse_documents(n, args.steps, args.seed)
        yield Scenario(
            f"{name} ({args.sparse_profile})",
            SPARSE_CAPACITY,
            batches,
            sparse_model,
            world=SPARSE_WORLD,
            ranks_per_node=SPARSE_RANKS_PER_NODE,
            max_length=SPARSE_MAX,
        )


class Baselines:
    """The baseline policies of a scenario; ``best`` prices their plans of one batch."""

    def __init__(self, scenario: Scenario, timing: str) -> None:
        self.model, self.timing = scenario.model, timing
        self.planners = [scenario.planner(policy=p) for p in BASELINE_POLICIES]

    def best(self, batch: np.ndarray) -> float:
        """The fastest baseline plan's seconds (the planners' timing)."""
        return min(
            evaluate_plan(p.plan(batch), self.model, timing=self.timing).step_seconds
            for p in self.planners
        )


def ratio_to_baselines(plan: StepPlan, model: CostModel, timing: str, best: float) -> float:
    """``plan``'s seconds over the best baseline's, both under ``timing``."""
    return evaluate_plan(plan, model, timing=timing).step_seconds / best


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
    cost = evaluate_plan(plan, model, timing="barrier")  # per wave its level, as the search sees it
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
        f"{'bound ms':>9}{'cpsat closes':>13}{'/base mean':>11}{'/base max':>10}{'own max':>8}"
        f"{'own >':>6}  cpsat outcomes"
    )
    print(header)
    for sc in scenarios(args, model):
        name, capacity, batches, model = sc.name, sc.capacity, sc.batches, sc.model
        mode = {"deterministic": True} if args.deterministic else {"time_limit": args.time_limit}
        dyncp = sc.planner(**mode)
        megatron = sc.planner(policy="megatron")
        baselines = Baselines(sc, dyncp.timing)
        own = sc.planner(**mode, baselines=False)
        gaps, old, lat, bound_lat, secs, meg, ratios, owns = [], [], [], [], [], [], [], []
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
            best = baselines.best(batch)
            ratios.append(ratio_to_baselines(plan, model, dyncp.timing, best))
            owns.append(ratio_to_baselines(own.plan(batch), model, dyncp.timing, best))
        busy = []
        if args.contention:
            with contention(args.contention):
                for batch in batches:
                    busy.append(dyncp.plan(batch).stats["timings"]["plan_seconds"])
        closes, outcomes = [], Counter()
        solver = sc.planner(time_limit=1.0)
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
            f"{(np.mean(closes) if closes else float('nan')):>13.1%}"
            f"{np.mean(ratios):>11.4f}{np.max(ratios):>10.4f}{np.max(owns):>8.4f}"
            f"{sum(r > 1 + 1e-12 for r in owns):>6}  {dict(outcomes)}",
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
    for sc in scenarios(args, model):
        name, capacity, batches = sc.name, sc.capacity, sc.batches
        wall = sc.planner(time_limit=args.time_limit)
        det = sc.planner(deterministic=True)
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


def run_budgets(model: CostModel, args: argparse.Namespace) -> None:
    """Plan quality against the planning budget (module docstring)."""
    budgets: list[float | str] = [b if b == "step" else float(b) for b in args.budgets.split(",")]
    print(
        f"{'scenario':<34}{'cap':>6}{'budget s':>9}{'gap':>8}{'max':>8}{'vs best':>9}"
        f"{'/base max':>10}{'improved':>9}{'baseline':>9}{'p50 ms':>9}{'cpu ms':>8}"
    )
    for sc in scenarios(args, model):
        planners = {
            b: sc.planner(budget=StepBudget()) if b == "step" else sc.planner(time_limit=b)
            for b in budgets
        }
        spent = {b: [] for b in budgets}  # the budget each step got
        timing = planners[budgets[0]].timing
        baselines = Baselines(sc, timing)
        seconds = {b: [] for b in budgets}
        bounds, ratios = [], {b: [] for b in budgets}
        lat, cpu = {b: [] for b in budgets}, {b: [] for b in budgets}
        improved, chose_baseline = Counter(), Counter()
        for batch in sc.batches:
            best_base = baselines.best(batch)
            bound = None
            for b in budgets:
                t0 = time.process_time()
                plan = planners[b].plan(batch)
                cpu[b].append(time.process_time() - t0)
                st = plan.stats
                bound = st["lower_bound_seconds"]
                spent[b].append(st["budget"]["seconds"] if b == "step" else b)
                seconds[b].append(st["predicted_step_seconds"])
                ratios[b].append(ratio_to_baselines(plan, sc.model, timing, best_base))
                lat[b].append(st["timings"]["plan_seconds"])
                improved[b] += st["predicted_step_seconds"] < st["greedy_step_seconds"]
                chose_baseline[b] += str(st.get("chosen", "")).startswith("baseline")
            bounds.append(bound)
        best_plan = np.min([seconds[b] for b in budgets], axis=0)
        for b in budgets:
            t = np.asarray(seconds[b])
            gap = t / np.asarray(bounds) - 1
            vs_best = t / best_plan - 1
            print(
                f"{sc.name:<34}{sc.capacity:>6}{np.mean(spent[b]):>9.2f}"
                f"{'*' if b == 'step' else ' '}{gap.mean():>7.2%}{gap.max():>8.2%}"
                f"{vs_best.mean():>9.2%}{np.max(ratios[b]):>10.4f}"
                f"{improved[b] / len(sc.batches):>9.0%}{chose_baseline[b] / len(sc.batches):>9.0%}"
                f"{ms(lat[b], 50):>9.0f}{ms(cpu[b], 50):>8.0f}",
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
        "--budgets",
        default="",
        help="comma-separated time limits, e.g. 0.1,0.3,1,3,step (docstring)",
    )
    parser.add_argument(
        "--scenarios", nargs="*", default=[], help="only scenarios whose name starts so"
    )
    parser.add_argument("--sparse-profile", default="h100-megatron-dcp-gpt-plain")
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default=None,
        help="every planner's objective, and what ratios are priced with (default: Planner's)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="the quality table's dyncp planners in deterministic mode (no clock: load-free)",
    )
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
    if args.budgets:
        run_budgets(model, args)
    if args.determinism:
        run_determinism(model, args)
    if args.scale:
        run_scale(model, args)


if __name__ == "__main__":
    main()
