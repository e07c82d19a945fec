"""Predicted: step time and memory per rank of gather-once and full sharding, 8 B and 70 B models.

    python bench/fsdp_predict.py                     # 64 and 512 H100 ranks, WLB-LLM lengths
    python bench/fsdp_predict.py --latency           # what alignment adds to plan() latency

Nothing here is measured: every figure is a prediction from the H100 reference profiles and the
formulas below, each parameter from measured data or a stated assumption. Shapes (Meta Llama 3
model card and the models' published config.json):

- 8 B:  32 layers, hidden 4096, 32 query / 8 KV heads (head dim 128), SwiGLU FFN 14336,
  vocabulary 128256 (``dyncp.cost_model.shapes.SHAPES["llama3-8b"]``); profile
  ``h100-reference`` (bundled);
- 70 B: 80 layers, hidden 8192, 64 query / 8 KV heads (head dim 128), SwiGLU FFN 28672,
  vocabulary 128256; its profile is built here by ``dyncp.cost_model.reference`` from the same
  measured H100 data and assumptions as ``h100-reference`` (attention scaled to 64 heads, GEMMs
  at the same sustained throughput), so it needs ``--src`` (the DistCA reference folder).

Each step's global batch is drawn from the bundled WLB-LLM length sample (``--dataset``) until it
holds ``--steps-tokens`` x world x capacity tokens (default 2: two micro-batches a rank if packed
perfectly), and planned by the deterministic dyncp planner (closed-form bound, no CP-SAT: the
plans at 512 ranks take seconds) with the default ``StepBudget``: steps of seconds get its 2 s
cap, half of which is alignment's, as work units (``dyncp.planner.planner.ALIGN_SHARE``).
Per model, world and mode, over ``--batches`` batches:

- ``gather-once``: today's FSDP runner: the whole model is all-gathered (bf16) before the step and
  its gradients reduce-scattered (fp32) after it, not overlapped; the plan runs dataflow
  (``dyncp.cost_model.evaluate``). Step = plan seconds + that all-gather + that reduce-scatter.
- ``full (unaligned)``: FSDP2 full sharding of the same plan, priced as lockstep passes
  (``dyncp.cost_model.pass_timing`` with ``dyncp.cost_model.sharding``: per unit all-gather in
  forward and backward, reduce-scatter every pass, prefetch overlap), empty passes included.
- ``full (aligned)``: ``Planner(passes="aligned", sharding=...)``;
- ``full (aligned, barrier)``: the same with ``timing="barrier"``: plans built for waves that end
  together, which lockstep passes resemble more than dataflow does.

Columns: predicted step seconds; the collectives' seconds not hidden by compute (gather-once: the
whole-model all-gather and reduce-scatter); passes and empty rank-passes a step (mean over the
batches); memory per rank; whether it fits one H100.

``--latency`` (measured, not predicted: wall clock of this machine) times, in one run, over
``--batches`` batches of the 8 B model at ``--latency-world`` ranks (default 512): ``plan()`` of
the default planner (``passes="free"``, wall-clock ``time_limit``), of ``passes="aligned"`` at the
same ``time_limit`` and at ``--latency-limit`` seconds, and ``align_best`` alone with no budget
on the free plan and its baselines' plans (what alignment costs when it runs to the end); p50s,
and each as a ratio to the free planner's p50 in the same run. Run it with ``PYTHONPATH`` at
another checkout to compare its alignment with this one's.

FSDP units: the embedding, each block, and the final norm with the output head (untied, as in
Llama 3). Their compute shares: the embedding none (a lookup), the head its share of the GEMM
FLOPs per token, the blocks the rest equally. Collectives from the profile
(``collective_from_profile``): at 64 and 512 ranks a ring over InfiniBand at the profile's
assumed 40 GB/s a GPU.

Memory per rank (bytes), N parameters, W ranks, U the largest unit, T = capacity tokens a rank,
h hidden, L layers, V vocabulary:

- sharded state, both modes: 16 N / W (fp32 master weights 4, fp32 gradients 4, AdamW's two fp32
  moments 8, all sharded as FSDP2 keeps them);
- gather-once: + 2 N (bf16 unsharded parameters) + 4 N (the full fp32 gradient buffer), the
  2.0x-the-model the issue measured right after the runner's all-gather;
- full sharding: + 12 U: two units' bf16 parameters (the current one and the prefetched one,
  2 x 2 U) and two units' fp32 unsharded gradients (the one computed, the one being
  reduce-scattered, 2 x 4 U);
- activations, both modes, with activation checkpointing per block: T x (2 h L, every block's
  bf16 input kept, + 34 h, one block's working set while it is recomputed -- Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023), eq. 1 without
  its 5as/h attention-score term, which flash attention does not store -- + 4 V, the fp32 logits
  of the loss).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dyncp.cost_model import CostModel, Profile, evaluate_plan, load_profile
from dyncp.cost_model.pass_timing import price_passes
from dyncp.cost_model.reference import build_reference_profile
from dyncp.cost_model.shapes import SHAPES, DecoderShape
from dyncp.cost_model.sharding import ShardingCost, collective_from_profile
from dyncp.data.readers import load_lengths, resolve_dataset
from dyncp.plan import pass_schedule
from dyncp.planner import Planner, StepBudget
from dyncp.planner.baselines.candidates import BaselineCandidates
from dyncp.planner.improvement.pass_align import align_best

LLAMA3_70B = DecoderShape(
    name="llama3-70b-like",
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    ffn_hidden_size=28672,
    ffn_kind="swiglu",
    vocab_size=128256,
    source="Meta Llama 3 model card and Meta-Llama-3-70B config.json: 80 layers, hidden 8192, "
    "64 heads, 8 KV heads, FFN 28672 (SwiGLU), vocabulary 128256",
)
GIB = 2**30
#: H100 SXM memory (NVIDIA H100 datasheet: 80 GB HBM3), as the CUDA allocator sees it.
H100_BYTES = 80e9
RANKS_PER_NODE = 8  # DGX H100: 8 GPUs a node


@dataclass(frozen=True, kw_only=True, slots=True)
class Model:
    """A shape, its profile and its FSDP units."""

    name: str
    shape: DecoderShape
    profile: Profile

    @property
    def block_params(self) -> int:
        """One block's GEMM weights and its two RMSNorm weight vectors."""
        return self.shape.layer_gemm_params + 2 * self.shape.hidden_size

    @property
    def units(self) -> tuple[int, ...]:
        """Parameters of each FSDP unit in forward order: embedding, blocks, norm + head."""
        h, v = self.shape.hidden_size, self.shape.vocab_size
        return (v * h, *(self.block_params,) * self.shape.num_layers, h + v * h)

    @property
    def shares(self) -> tuple[float, ...]:
        """Compute shares: none for the lookup, the head's GEMM share, the blocks the rest."""
        head = self.shape.hidden_size * self.shape.vocab_size / self.shape.gemm_params
        layers = self.shape.num_layers
        return (0.0, *((1.0 - head) / layers,) * layers, head)

    @property
    def params(self) -> int:
        return sum(self.units)

    def sharding(self, world: int) -> ShardingCost:
        return ShardingCost.from_profile(
            self.profile,
            world=world,
            ranks_per_node=RANKS_PER_NODE,
            unit_params=self.units,
            unit_compute=self.shares,
        )

    def activation_bytes(self, tokens: int) -> float:
        h, layers, v = self.shape.hidden_size, self.shape.num_layers, self.shape.vocab_size
        return tokens * (2 * h * layers + 34 * h + 4 * v)

    def memory(self, mode: str, world: int, tokens: int) -> float:
        """Bytes a rank holds at its peak (module docstring)."""
        state = 16 * self.params / world
        working = 6 * self.params if mode == "gather-once" else 12 * max(self.units)
        return state + working + self.activation_bytes(tokens)


def models(src: Path) -> list[Model]:
    out = [Model(name="8B", shape=SHAPES["llama3-8b"], profile=load_profile("h100-reference"))]
    if not src.is_dir():
        sys.exit(f"--src {src} is not a folder: the 70B profile is built from the DistCA CSVs")
    profile = build_reference_profile(src, shape=LLAMA3_70B)
    out.append(Model(name="70B", shape=LLAMA3_70B, profile=profile))
    return out


def batches(lengths: np.ndarray, tokens: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of whole documents, each the first draws reaching ``tokens``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        draw = rng.choice(lengths, size=2 * tokens // int(lengths.mean()) + 16)
        n = int(np.searchsorted(np.cumsum(draw), tokens)) + 1
        out.append(draw[:n])
    return out


def row(model: Model, world: int, capacity: int, steps: list[np.ndarray]) -> list[tuple]:
    """The table's rows for one model and world, figures averaged over the batches."""
    cost = CostModel(model.profile, RANKS_PER_NODE)
    sharding = model.sharding(world)
    link = collective_from_profile(model.profile, world=world, ranks_per_node=RANKS_PER_NODE)
    whole = link.seconds(2 * model.params) + link.seconds(4 * model.params)
    options = dict(
        world=world,
        ranks_per_node=RANKS_PER_NODE,
        capacity=capacity,
        deterministic=True,
        bound="simple",
        cpsat=None,
        budget=StepBudget(),  # alignment's share: work units enough to finish here
    )
    free = Planner(cost, **options)
    aligned = {
        timing: Planner(cost, passes="aligned", sharding=sharding, timing=timing, **options)
        for timing in ("dataflow", "barrier")
    }
    acc: dict[str, list[tuple[float, float, int, int]]] = {}
    for lengths in steps:
        plan = free.plan(lengths)
        once = evaluate_plan(plan, cost).step_seconds + whole
        unaligned = price_passes(plan, cost, sharding)
        acc.setdefault("gather-once", []).append((once, whole, len(plan.waves), 0))
        acc.setdefault("full (unaligned)", []).append(
            (unaligned.step_seconds, unaligned.exposed_seconds, unaligned.passes, unaligned.empty)
        )
        for timing, planner in aligned.items():
            lock = planner.plan(lengths)
            report, schedule = lock.stats.alignment, pass_schedule(lock)
            mode = "full (aligned, barrier)" if timing == "barrier" else "full (aligned)"
            acc.setdefault(mode, []).append(
                (
                    report["seconds_after"],
                    report["exposed_seconds_after"],
                    schedule.passes,
                    schedule.empty,
                )
            )
    rows = []
    for mode, values in acc.items():
        seconds, exposed, passes, empty = (float(np.mean(v)) for v in zip(*values))
        memory = model.memory("gather-once" if mode == "gather-once" else "full", world, capacity)
        rows.append((model.name, world, mode, seconds, exposed, passes, empty, memory))
    return rows


def latency(model: Model, world: int, capacity: int, steps: list[np.ndarray], limit: float) -> None:
    """Wall-clock p50 of ``plan()`` with and without alignment, and of alignment alone
    (module docstring), each also as a ratio to the free planner's p50."""
    cost = CostModel(model.profile, RANKS_PER_NODE)
    sharding = model.sharding(world)
    options = dict(world=world, ranks_per_node=RANKS_PER_NODE, capacity=capacity, bound="simple")
    free = Planner(cost, **options)
    planners = {
        "aligned, same time_limit": Planner(cost, passes="aligned", sharding=sharding, **options),
        f"aligned, time_limit {limit:g} s": Planner(
            cost, passes="aligned", sharding=sharding, time_limit=limit, **options
        ),
    }
    times: dict[str, list[float]] = {"free (default planner)": []}
    notes: dict[str, list[str]] = {}
    work: list[float] = []
    for lengths in steps:
        t0 = time.perf_counter()
        plan = free.plan(lengths)
        times["free (default planner)"].append(time.perf_counter() - t0)
        for name, planner in planners.items():
            t0 = time.perf_counter()
            lock = planner.plan(lengths)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            report = lock.stats.alignment
            notes.setdefault(name, []).append(
                f"{report['empty_before']}->{report['empty_after']} empty"
                + ("" if report.get("complete", True) else " (budget out)")
            )
        others = [p for _, p in BaselineCandidates(free.topology).plans(lengths, cost)]
        t0 = time.perf_counter()
        _, _, report = align_best([plan, *others], cost, sharding)
        seconds = time.perf_counter() - t0
        times.setdefault(f"align_best alone ({1 + len(others)} plans)", []).append(seconds)
        if hasattr(report, "work"):
            work.append(report.work / seconds)
    base = float(np.median(times["free (default planner)"]))
    print(
        f"latency: {model.name}, {world} ranks, {len(steps)} batches of "
        f"{', '.join(str(len(s)) for s in steps)} sequences; time_limit {free.time_limit:g} s"
    )
    for name, values in times.items():
        p50 = float(np.median(values))
        extra = f"  [{'; '.join(notes[name])}]" if name in notes else ""
        print(f"  {name:<34} p50 {p50:7.3f} s  x{p50 / base:5.2f} of free{extra}")
    if work:
        print(f"  alignment work units a second (median): {np.median(work):,.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path("../shared/reference/h100-distca"))
    parser.add_argument("--dataset", default="wlbllm")
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--capacity", type=int, default=16384, help="tokens a rank a pass")
    parser.add_argument("--step-tokens", type=float, default=2.0, help="x world x capacity")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", action="store_true", help="time plan() instead (docstring)")
    parser.add_argument("--latency-world", type=int, default=512)
    parser.add_argument("--latency-limit", type=float, default=1.0, help="seconds")
    args = parser.parse_args(argv)
    lengths = load_lengths(resolve_dataset(args.dataset))
    if args.latency:
        world = args.latency_world
        steps = batches(lengths, int(args.step_tokens * world * args.capacity), args.batches, 1)
        eight = Model(name="8B", shape=SHAPES["llama3-8b"], profile=load_profile("h100-reference"))
        latency(eight, world, args.capacity, steps, args.latency_limit)
        return
    print(
        f"lengths: {args.dataset} ({len(lengths)} documents, mean {lengths.mean():.0f}, max "
        f"{lengths.max()}); capacity {args.capacity} tokens a rank; {args.batches} batches of "
        f"{args.step_tokens:g} x world x capacity tokens; H100 {H100_BYTES / GIB:.1f} GiB"
    )
    header = (
        f"{'model':<5} {'ranks':>5} {'mode':<24} {'step s':>8} {'comm s':>7} {'passes':>6} "
        f"{'empty':>6} {'GiB/rank':>8} fits"
    )
    for model in models(args.src):
        print(
            f"{model.name}: {model.params / 1e9:.2f} B parameters, {len(model.units)} FSDP units "
            f"(largest {max(model.units) / 1e6:.0f} M)"
        )
    print(header)
    for model in models(args.src):
        for world in args.worlds:
            steps = batches(
                lengths, int(args.step_tokens * world * args.capacity), args.batches, args.seed
            )
            for name, w, mode, seconds, exposed, passes, empty, memory in row(
                model, world, args.capacity, steps
            ):
                fits = "yes" if memory <= H100_BYTES else "no"
                lockstep = mode != "gather-once"  # gather-once runs dataflow: no passes
                counts = f"{passes:>6.1f} {empty:>6.1f}" if lockstep else f"{'-':>6} {'-':>6}"
                print(
                    f"{name:<5} {w:>5} {mode:<24} {seconds:>8.3f} {exposed:>7.3f} {counts} "
                    f"{memory / GIB:>8.1f} {fits}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
