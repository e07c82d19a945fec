"""Measured: dyncp's FSDP2 and DDP runners against every rank holding the model, same plans.

    python bench/fsdp_bench.py                 # 2 gloo processes, 1 thread each
    python bench/fsdp_bench.py --world 4 --layers 8    # the figures of the issue's closing note

Each step's global batch (bundled Wikipedia lengths, truncated to ``--max-length``) is planned
once by the deterministic dyncp planner (``cpu-gloo`` profile) and run by three copies of the
same tiny decoder, interleaved step by step so that machine drift hits them alike:

- ``replicated`` (the baseline): every rank holds the whole model; ``runtime.execute`` then
  ``reduce_gradients``;
- ``fsdp``: ``fully_shard`` per block and root, :class:`dyncp.integrations.fsdp.FSDPRunner`;
- ``ddp``: ``DistributedDataParallel``, :class:`dyncp.integrations.ddp.DDPRunner`.

Printed:

1. errors: one fp64 step of each path against the same batch on one process (loss relative
   error, gradients' largest error relative to each parameter's largest gradient);
2. per-step time (the slowest rank's wall clock of forward + backward + gradient reduction): the
   median over steps, the median and quartiles of each step's ratio to the same step under
   ``replicated``, the ratio of the fastest steps, and the time spent outside ``execute`` (the
   FSDP path's all-gathers and reduce-scatters; the others' all-reduces); then the CPU seconds per
   step summed over the ranks, the work each path does, which a loaded machine disturbs far less
   than the wall clock;
3. parameter + gradient bytes per rank, counted from the live tensors: ``replicated`` holds the
   whole model's parameters and gradients; the FSDP path's peak is measured at its reduce-scatter
   (unsharded parameters, the flat gradient buffers, their reduce-scatter outputs and the sharded
   parameters), and its footprint between steps is the sharded parameters and gradients;
4. FSDP2's three ways on a uniform plan (every rank CP 1 with the same micro-batch count, the
   one kind of plan plain FSDP2 runs), fp32: ``gather-once`` (FSDPRunner), ``sharded``
   (ShardedFSDPRunner, FSDP2's own per-block collectives in lockstep passes) and ``plain``
   (``execute`` on the FSDP2 model, FSDP2's own collectives, SUM reduction as dyncp's):
   the allocator's peak per rank over one step, from ``torch.profiler``'s memory events (every
   allocation and free of the step, summed in time order; the CPU allocator caches nothing, so
   this is what the tensors need), plus the sharded parameters live at the step's start; the
   step time (slowest rank) and the CPU seconds summed over the ranks, as ratios to ``plain`` in
   the same run (median over steps, modes interleaved); and the collectives each rank issues in
   one step, counted by wrapping ``torch.distributed``'s functions. The sharded runner's errors
   (fp64, the first uneven plan, against one process) are in section 1's list.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

import dyncp.integrations.fsdp as fsdp_module
from dyncp.cost_model import CostModel
from dyncp.data import load_lengths, resolve_dataset
from dyncp.integrations.ddp import DDPRunner
from dyncp.integrations.fsdp import FSDPRunner
from dyncp.integrations.fsdp_sharded import ShardedFSDPRunner
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner import Planner
from dyncp.ring_attention import make_ring_layout
from dyncp.runtime import (
    GroupPool,
    MicroBatchContext,
    execute,
    reduce_gradients,
    reduce_loss,
)
from dyncp.sim.replay import admit, draw_batches
from dyncp.testing import LossSum, ThroughDDP, TinyConfig, TinyDecoder, microbatch_loss
from dyncp.testing.distributed import run_gloo

MODES = ("replicated", "fsdp", "ddp")
#: Section 1 also checks the sharded runner; section 4 compares FSDP2's three ways.
ERROR_MODES = (*MODES, "sharded")
UNIFORM_MODES = ("plain", "gather-once", "sharded")
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_to_all_single",
    "barrier",
)


def _model(cfg: TinyConfig, dtype: torch.dtype) -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(cfg).to(dtype)


def _build(mode: str, cfg: TinyConfig, dtype: torch.dtype, mesh):
    """(the object step_fn's loss goes through, the user's model, a step runner)."""
    model = _model(cfg, dtype)
    if mode == "replicated":

        def run(plan, pool, step_fn):
            report = execute(plan, pool, step_fn)
            reduce_gradients(model)
            return report

        return model, model, run
    if mode == "ddp":
        ddp = DistributedDataParallel(LossSum(model))
        return ThroughDDP(ddp), model, DDPRunner(ddp).step
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "sharded":
        return model, model, ShardedFSDPRunner(model).step
    if mode == "plain":  # FSDP2 as it is; SUM over the ranks like dyncp's runners

        def plain(plan, pool, step_fn):
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            return execute(plan, pool, step_fn)

        return model, model, plain
    return model, model, FSDPRunner(model).step


def _uniform_plan(args: argparse.Namespace) -> StepPlan:
    """Every rank CP 1 with ``--uniform-microbatches`` micro-batches of one sequence each."""
    k, length = args.uniform_microbatches, args.capacity
    groups = tuple(
        Group(r, 1, tuple(MicroBatch((r * k + j,)) for j in range(k))) for r in range(args.world)
    )
    topology = Topology(args.world, args.world, args.capacity)
    return StepPlan(topology, (length,) * (args.world * k), (Wave(groups),), policy="uniform")


class _Collectives:
    """Counts the ``torch.distributed`` collectives issued inside the ``with`` (by name)."""

    def __init__(self) -> None:
        self.calls = dict.fromkeys(COLLECTIVES, 0)

    def __enter__(self) -> _Collectives:
        self.saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))
        return self

    def _counting(self, name, fn):
        @functools.wraps(fn)
        def counted(*a, **k):
            self.calls[name] += 1
            return fn(*a, **k)

        return counted

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _allocator_peak(prof) -> int:
    """The largest sum of the bytes allocated minus freed since the profile began."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _uniform(args, cfg, mesh, pool) -> dict:
    """Section 4 on this rank: allocator peak, collective counts, step times."""
    plan = _uniform_plan(args)
    tokens = _tokens(plan.lengths, 1, cfg.vocab)
    built = {mode: _build(mode, cfg, torch.float32, mesh) for mode in UNIFORM_MODES}
    out: dict = {"peak": {}, "start": {}, "calls": {}, "times": {m: [] for m in UNIFORM_MODES}}

    def clear(model) -> None:
        for p in model.parameters():
            p.grad = None

    for loss_model, model, run in built.values():  # warm-up (FSDP2's lazy init)
        _step(loss_model, run, pool, plan, tokens)
        clear(model)
    for mode, (loss_model, model, run) in built.items():
        out["start"][mode] = _bytes(_local(p) for p in model.parameters())
        counter = _Collectives()
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )

        @contextlib.contextmanager
        def around(counter=counter, profiler=profiler):
            with counter, profiler:
                yield

        _step(loss_model, run, pool, plan, tokens, around=around)
        out["peak"][mode] = _allocator_peak(profiler)
        out["calls"][mode] = {n: c for n, c in counter.calls.items() if c}
        clear(model)
    for s in range(args.uniform_steps):
        order = UNIFORM_MODES[s % 3 :] + UNIFORM_MODES[: s % 3]
        for mode in order:
            loss_model, model, run = built[mode]
            _, sec, _, cpu = _step(loss_model, run, pool, plan, tokens)
            out["times"][mode].append((sec, cpu))
            clear(model)
    return out


def _tokens(lengths, seed: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(s),), generator=gen) for s in lengths]


def _step(
    loss_model, run, pool, plan, tokens, around=contextlib.nullcontext
) -> tuple[float, float, float, float]:
    """One step: (loss, slowest rank's seconds, outside execute, CPU seconds summed); the
    runner's call alone runs inside ``around()`` (a profiler, a collective counter)."""
    losses = []

    def step_fn(ctx: MicroBatchContext) -> None:
        loss = microbatch_loss(loss_model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids]))
        loss.backward()
        losses.append(loss.detach().double())

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    with around():
        report = run(plan, pool, step_fn)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    # the step and the part outside execute (gather + reduction): the slowest rank's; CPU
    # seconds: the sum over ranks (work done, which other jobs' load on the machine barely moves)
    seconds = torch.tensor([total, total - report.step_seconds])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    cpu_all = torch.tensor([cpu])
    dist.all_reduce(cpu_all)
    seconds = torch.cat([seconds, cpu_all])
    return reduce_loss(losses, dtype=torch.float64).item(), *seconds.tolist()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
    return out


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _worker(rank: int, world: int, args: argparse.Namespace, plans: list, cfg: TinyConfig):
    torch.set_num_threads(1)
    pool = GroupPool()
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    # 1. errors, fp64, first plan.
    plan, seed = plans[0]
    tokens = _tokens(plan.lengths, seed, cfg.vocab)
    out["errors"] = {}
    for mode in ERROR_MODES:
        loss_model, model, run = _build(mode, cfg, torch.float64, mesh)
        loss, *_ = _step(loss_model, run, pool, plan, tokens)
        out["errors"][mode] = (loss, _grads(model))
    # 2./3. time and memory, fp32, modes interleaved step by step.
    built = {mode: _build(mode, cfg, torch.float32, mesh) for mode in MODES}
    fsdp_model = built["fsdp"][1]
    peak = {"flat": 0, "unsharded": 0}
    real = fsdp_module._reduce_scatter

    def spy(out_t, flat, *, group, async_op):  # at the reduce-scatter: the FSDP path's peak
        peak["flat"] += _bytes([flat, out_t])
        peak["unsharded"] = _bytes(fsdp_model.parameters())  # still unsharded here
        return real(out_t, flat, group=group, async_op=async_op)

    fsdp_module._reduce_scatter = spy
    times = {mode: [] for mode in MODES}
    for s, (plan, seed) in enumerate(plans):
        tokens = _tokens(plan.lengths, seed, cfg.vocab)
        for mode in MODES[s % 3 :] + MODES[: s % 3]:  # each mode first, second, third in turn
            loss_model, model, run = built[mode]
            peak["flat"] = 0
            _, sec, outside, cpu = _step(loss_model, run, pool, plan, tokens)
            if s >= args.warmup:
                times[mode].append((sec, outside, cpu))
            if mode == "fsdp":
                sharded = _bytes(_local(p) for p in model.parameters())
                sharded_grads = _bytes(_local(p.grad) for p in model.parameters())
                at_peak = peak["unsharded"] + peak["flat"] + sharded
                out["fsdp_peak"] = max(out.get("fsdp_peak", 0), at_peak)
                out["fsdp_rest"] = sharded + sharded_grads
            if mode == "replicated":
                out["replicated"] = _bytes(model.parameters()) + _bytes(
                    p.grad for p in model.parameters()
                )
            for p in model.parameters():
                p.grad = None
    fsdp_module._reduce_scatter = real
    out["times"] = times
    out["counts"] = [
        sum(len(g.microbatches) for w in plan.waves for g in w.groups if rank in g.ranks)
        for plan, _ in plans
    ]
    out["uniform"] = _uniform(args, cfg, mesh, pool)
    return out


def _reference(cfg: TinyConfig, plan, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = _model(cfg, torch.float64)
    lengths = tuple(int(s) for s in plan.lengths)
    ctx = MicroBatchContext(
        0,
        0,
        1,
        0,
        tuple(range(len(lengths))),
        None,
        lengths,
        make_ring_layout(seqlens=lengths, cp=1),
        1.0 / sum(s - 1 for s in lengths),
    )
    tokens = _tokens(lengths, seed, cfg.vocab)
    loss = microbatch_loss(model, ctx, torch.cat(tokens))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--uniform-steps", type=int, default=6, help="section 4's timed steps")
    p.add_argument(
        "--uniform-microbatches", type=int, default=2, help="section 4: micro-batches per rank"
    )
    args = p.parse_args()

    cfg = TinyConfig(
        vocab=args.vocab, dim=args.dim, heads=4, kv_heads=2, layers=args.layers, ffn=4 * args.dim
    )
    lengths, _ = admit(load_lengths(resolve_dataset("wikipedia")), args.max_length, "truncate")
    batches = draw_batches(
        lengths,
        steps=args.warmup + args.steps,
        seed=args.seed,
        global_batch_tokens=args.batch_tokens,
    )
    planner = Planner(
        CostModel.load("cpu-gloo", ranks_per_node=args.world),
        world=args.world,
        ranks_per_node=args.world,
        capacity=args.capacity,
        max_length=args.max_length,
        deterministic=True,
        cpsat=None,
    )
    plans = [(planner.plan(b), s) for s, b in enumerate(batches)]
    results = run_gloo(_worker, world=args.world, args=(args, plans, cfg), timeout=1800)
    params = sum(p.numel() for p in _model(cfg, torch.float32).parameters())
    counts = np.array([r["counts"] for r in results])  # ranks x steps
    print(
        f"fsdp bench: {args.world} gloo processes x 1 thread, tiny decoder dim {args.dim} x "
        f"{args.layers} layers, vocab {args.vocab} ({params / 1e6:.2f} M parameters, fp32), "
        f"{len(plans)} steps of {args.batch_tokens} tokens (wikipedia lengths <= "
        f"{args.max_length}), capacity {args.capacity}; {args.warmup} warm-up steps"
    )
    uneven = int((counts.max(0) != counts.min(0)).sum())
    sizes = sorted({g.size for plan, _ in plans for w in plan.waves for g in w.groups})
    print(
        f"plans: CP sizes {sizes}; {uneven}/{len(plans)} steps give the ranks different "
        f"micro-batch counts (per rank per step: {counts.tolist()})"
    )

    ref_loss, ref_grads = _reference(cfg, *plans[0])
    print("errors (fp64, one step, against one process):")
    for mode in ERROR_MODES:
        loss, grads = results[0]["errors"][mode]
        worst = max(
            (grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in ref_grads.items()
        )
        print(
            f"  {mode:10s} loss rel {abs(loss - ref_loss) / abs(ref_loss):.1e}  "
            f"gradients rel {worst:.1e}"
        )

    times = results[0]["times"]

    def median(mode: str, k: int) -> float:
        return statistics.median(t[k] for t in times[mode])

    base = median("replicated", 0)
    print(
        f"per-step time, slowest rank, {args.steps} steps; ratio: the median [quartiles] of each "
        f"step's time over the same step's replicated time; outside execute: the all-gather and "
        f"gradient reduction around the micro-batches (median):"
    )
    for mode in MODES:
        ratios = [t[0] / r[0] for t, r in zip(times[mode], times["replicated"])]
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        fastest = min(t[0] for t in times[mode]) / min(t[0] for t in times["replicated"])
        print(
            f"  {mode:10s} step {median(mode, 0) * 1e3:8.1f} ms   ratio x{q2:.3f} [{q1:.3f}, "
            f"{q3:.3f}]   fastest steps x{fastest:.3f}   outside execute "
            f"{median(mode, 1) * 1e3:6.1f} ms ({median(mode, 1) / median(mode, 0):.1%})"
        )
    print(f"  (replicated median step {base * 1e3:.1f} ms)")
    print(
        "CPU seconds per step, summed over the ranks (median; ratio: median [quartiles], paired):"
    )
    for mode in MODES:
        ratios = [t[2] / r[2] for t, r in zip(times[mode], times["replicated"])]
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        print(f"  {mode:10s} {median(mode, 2):7.3f} s   ratio x{q2:.3f} [{q1:.3f}, {q3:.3f}]")

    mib = 2**20
    rep = results[0]["replicated"]
    peak = max(r["fsdp_peak"] for r in results)
    rest = max(r["fsdp_rest"] for r in results)
    print("parameters + gradients per rank (bytes of live tensors):")
    print(f"  replicated (every rank holds the model)  {rep / mib:8.2f} MiB   x1.000")
    print(f"  fsdp runner, peak (at reduce-scatter)     {peak / mib:8.2f} MiB   x{peak / rep:.3f}")
    print(f"  fsdp runner, between steps (sharded)      {rest / mib:8.2f} MiB   x{rest / rep:.3f}")
    _print_uniform(args, results)


def _print_uniform(args: argparse.Namespace, results: list[dict]) -> None:
    mib = 2**20
    k = args.uniform_microbatches
    print(
        f"FSDP2 on a uniform plan ({args.world} ranks x CP 1 x {k} micro-batches of "
        f"{args.capacity} tokens, fp32, {args.layers} blocks): allocator peak per rank over one "
        f"step (torch.profiler memory events) + the sharded parameters live at its start; "
        f"ratio to plain FSDP2:"
    )
    uni = [r["uniform"] for r in results]
    for mode in UNIFORM_MODES:
        peaks = [u["peak"][mode] + u["start"][mode] for u in uni]
        base = [u["peak"]["plain"] + u["start"]["plain"] for u in uni]
        worst = max(p / b for p, b in zip(peaks, base))
        print(
            f"  {mode:12s} max {max(peaks) / mib:8.2f} MiB  per rank "
            f"[{', '.join(f'{p / mib:.2f}' for p in peaks)}] MiB   x{max(peaks) / max(base):.3f} "
            f"(worst rank x{worst:.3f})"
        )
    times = uni[0]["times"]  # the slowest rank's per step, the same on every rank
    print(
        f"step time, slowest rank, and CPU seconds summed over the ranks, {args.uniform_steps} "
        f"steps, modes interleaved; ratio to plain: median [min, max] of the paired steps:"
    )
    for mode in UNIFORM_MODES:
        line = f"  {mode:12s}"
        for k, (unit, scale) in enumerate((("ms", 1e3), ("s CPU", 1.0))):
            ratios = [t[k] / b[k] for t, b in zip(times[mode], times["plain"])]
            line += (
                f"  {statistics.median(t[k] for t in times[mode]) * scale:8.1f} {unit} x"
                f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
            )
        print(line)
    print("collectives per rank in one step (rank 0; every rank the same: checked):")
    for mode in UNIFORM_MODES:
        calls = uni[0]["calls"][mode]
        same = all(u["calls"][mode] == calls for u in uni)
        print(
            f"  {mode:12s} {', '.join(f'{n} {c}' for n, c in sorted(calls.items()))}"
            + ("" if same else "   (ranks differ: " + str([u["calls"][mode] for u in uni]) + ")")
        )


if __name__ == "__main__":
    main()
