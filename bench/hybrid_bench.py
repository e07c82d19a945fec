"""Measured through the runtime: one micro-batch as an all-to-all group and as a ring group.

    python bench/hybrid_bench.py                    # 2 gloo processes, 1 thread each
    python bench/hybrid_bench.py --packs 4096 2048,1024,512 --repeats 9

On 2 gloo processes the same micro-batch (a pack of sequence lengths) runs through
``runtime.execute`` as a group of 2 ranks split heads 2 x ring 1 (all-to-all only: each rank
computes 2 of the 4 query heads of whole sequences) and as a plain ring of 2 (heads 1 x ring 2),
the two interleaved repeat by repeat so that machine drift hits both alike. The model is the
tiny decoder of the profile (``profiles/cpu-gloo``: 4 query heads, 2 KV heads, 2 layers,
float32), forward and backward, kernel "auto". A micro-batch's time is its slowest rank's
``MicroBatchTiming.seconds`` (what the cost model predicts), the median of ``--repeats``.

Printed per pack: measured seconds of each layout, their ratio (ring / all-to-all), and the cost
model's prediction of each (``CostModel.microbatch_seconds(2, lengths, heads=u)``) with its
ratio, when this checkout's cost model prices head splits. The measured ratio is *paired*: each
repeat runs both layouts back to back (ABBA order), its ring / all-to-all ratio is taken, and the
median of those ratios is printed with their interquartile range (``iqr``), so a load that
drifts over the run scales both layouts of a pair alike and shows up as spread, not as a wrong
ratio. ``verdict`` says whether a model's predicted ratio is within 10% of the measured median,
and whether the difference is inside the measured spread (then the bench cannot tell).

``--calibrate N`` also runs N other packs (Wikipedia lengths, seeded, never the printed ones) in
both layouts and as two CP-1 micro-batches (sequences dealt alternately to the two ranks: what
tells per-token work from attention), refits the profile to those measurements (``fit_profile``:
every repeat one measurement, the split ones with ``heads=2``) and prints the calibrated model's
predictions of the printed packs next to the shipped profile's: calibration judged on packs it
never saw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch
import torch.distributed as dist

from dyncp.cost_model import CostModel, Profile, load_profile
from dyncp.cost_model.calibration.fit import Measurement, fit_profile
from dyncp.data import load_lengths, resolve_dataset
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.runtime import GroupPool, execute
from dyncp.testing import TinyConfig, TinyDecoder, microbatch_loss
from dyncp.testing.distributed import run_gloo

WORLD = 2
LAYOUTS = {"a2a2": 2, "ring2": 1}  # name: heads u of a group of 2 ranks


def _plan(lengths: list[int], heads: int, cfg: TinyConfig) -> StepPlan:
    capacity = sum(lengths) + 4 * len(lengths)  # every pack fits on one rank's shard
    topo = Topology(
        WORLD, WORLD, capacity, head_sizes=(1, 2), query_heads=cfg.heads, kv_heads=cfg.kv_heads
    )
    group = Group(0, WORLD, (MicroBatch(tuple(range(len(lengths)))),), heads=heads)
    return StepPlan(topo, tuple(lengths), (Wave((group,)),), policy=f"heads{heads}")


def halves(lengths: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sequence ids of a pack dealt alternately to the two ranks (CP 1 each)."""
    ids = tuple(range(len(lengths)))
    return ids[0::2], ids[1::2]


def _cp1_plan(lengths: list[int], cfg: TinyConfig) -> StepPlan:
    capacity = sum(lengths) + 4 * len(lengths)
    topo = Topology(
        WORLD, WORLD, capacity, head_sizes=(1, 2), query_heads=cfg.heads, kv_heads=cfg.kv_heads
    )
    groups = tuple(Group(r, 1, (MicroBatch(ids),)) for r, ids in enumerate(halves(lengths)))
    return StepPlan(topo, tuple(lengths), (Wave(groups),), policy="cp1")


def _worker(
    rank: int, world: int, args: argparse.Namespace, packs: list[list[int]], with_cp1: int = 0
) -> list:
    """Per pack, the slowest rank's seconds of each layout per repeat; packs from index
    ``with_cp1`` on (the calibration packs) also run as two CP-1 micro-batches ("cp1": each
    rank's own seconds, [rank 0, rank 1] per repeat)."""
    pool = GroupPool(head_sizes=(1, 2))
    shape = load_profile(args.profile).model
    cfg = TinyConfig(
        vocab=shape.vocab_size, dim=shape.hidden_size, heads=shape.num_heads,
        kv_heads=shape.num_kv_heads, layers=shape.num_layers, ffn=shape.ffn_hidden_size,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TinyDecoder(cfg)
    rows = []
    for p, lengths in enumerate(packs):
        gen = torch.Generator().manual_seed(p)
        tokens = [torch.randint(0, cfg.vocab, (s,), generator=gen) for s in lengths]

        def step_fn(ctx, tokens=tokens) -> None:
            packed = torch.cat([tokens[i] for i in ctx.seq_ids])
            microbatch_loss(model, ctx, packed, kernel="auto").backward()

        plans = {name: _plan(lengths, u, cfg) for name, u in LAYOUTS.items()}
        if p >= with_cp1 and len(lengths) > 1:
            plans["cp1"] = _cp1_plan(lengths, cfg)
        times: dict[str, list] = {name: [] for name in plans}
        for r in range(args.warmup + args.repeats):
            order = list(plans) if r % 2 == 0 else list(plans)[::-1]
            for name in order:
                pool.barrier()
                report = execute(plans[name], pool, step_fn)
                (timing,) = report.timings
                if name == "cp1":  # each rank's own micro-batch
                    both = torch.zeros(WORLD, dtype=torch.float64)
                    both[rank] = timing.seconds
                    dist.all_reduce(both)
                    value: object = both.tolist()
                else:
                    assert timing.heads == LAYOUTS[name]
                    slowest = torch.tensor([timing.seconds], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    value = float(slowest.item())
                model.zero_grad(set_to_none=True)
                if r >= args.warmup:
                    times[name].append(value)
        rows.append(times)
    return rows


def _predictions(
    args: argparse.Namespace, packs: list[list[int]], profile: Profile | None = None
) -> list[dict] | str:
    model = CostModel(profile or load_profile(args.profile), ranks_per_node=WORLD)
    try:
        return [
            {name: model.microbatch_seconds(WORLD, lengths, heads=u) for name, u in LAYOUTS.items()}
            for lengths in packs
        ]
    except (TypeError, ValueError) as exc:  # a cost model without head splits
        return f"no prediction: {exc}"


def calibration_packs(n: int, seed: int = 1, tokens: int = 4096) -> list[list[int]]:
    """``n`` packs of Wikipedia lengths (clipped at ``tokens``), up to ``tokens`` tokens each."""
    rng = np.random.default_rng(seed)
    pool = np.minimum(load_lengths(resolve_dataset("wikipedia")), tokens)
    packs = []
    for _ in range(n):
        budget = int(rng.integers(tokens // 8, tokens + 1))
        pack: list[int] = []
        while True:
            s = int(rng.choice(pool))
            if pack and sum(pack) + s > budget:
                break
            pack.append(s)
        packs.append(pack)
    return packs


def _pack(text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",")]
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"a pack is comma-separated lengths >= 1, got {text!r}")
    return lengths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="cpu-gloo")
    p.add_argument(
        "--packs", nargs="+", type=_pack, default=[[4096], [2048, 1024, 512, 300], [256] * 8]
    )
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--calibrate", type=int, default=0, help="calibration packs (0: none)")
    p.add_argument("--save", default=None, help="write the packs and raw times here (JSON)")
    args = p.parse_args(argv)
    extra = calibration_packs(args.calibrate) if args.calibrate else []
    results = run_gloo(
        _worker,
        world=WORLD,
        args=(args, args.packs + extra, len(args.packs)),
        timeout=args.timeout,
    )
    times = results[0]
    if args.save:
        with open(args.save, "w") as fh:
            json.dump({"packs": args.packs, "extra": extra, "times": times}, fh)
    measured = [
        {name: statistics.median(row[name]) for name in LAYOUTS} for row in times[: len(args.packs)]
    ]
    paired = [np.array(row["ring2"]) / np.array(row["a2a2"]) for row in times[: len(args.packs)]]
    predicted = _predictions(args, args.packs)
    calibrated = None
    if extra:
        ms = []
        for lengths, row in zip(extra, times[len(args.packs) :]):
            for name, ts in row.items():
                if name == "cp1":
                    for pair in ts:
                        for ids, t in zip(halves(lengths), pair):
                            ms.append(Measurement(1, tuple(lengths[i] for i in ids), t))
                else:
                    ms += [Measurement(WORLD, tuple(lengths), t, heads=LAYOUTS[name]) for t in ts]
        fit = fit_profile(load_profile(args.profile), ms, ranks_per_node=WORLD)
        calibrated = _predictions(args, args.packs, fit.profile)
        print(
            f"calibrated on {len(ms)} measurements of {len(extra)} other packs: mean |error| "
            f"{fit.error_before:.1%} -> {fit.error_after:.1%} on them, {fit.outliers} outliers; "
            + ", ".join(f"{k} {v:.4g}" for k, v in fit.coefficients_after.items())
        )
    cores = os.cpu_count() or 1
    print(
        f"hybrid bench: {WORLD} gloo processes x 1 thread ({cores} cores), tiny decoder of "
        f"profile {args.profile} (float32, fwd+bwd, kernel auto) through runtime.execute; "
        f"slowest rank's micro-batch seconds, median of {args.repeats} (+{args.warmup} warm-up)"
    )
    head = f"{'pack':<28}{'a2a2 s':>10}{'ring2 s':>10}{'ring/a2a':>10}"
    if not isinstance(predicted, str):
        head += f"{'pred a2a2':>11}{'pred ring2':>11}{'pred r/a':>10}"
    if calibrated is not None and not isinstance(calibrated, str):
        head += f"{'cal a2a2':>10}{'cal ring2':>10}{'cal r/a':>9}"
    print(head)
    for i, lengths in enumerate(args.packs):
        m = measured[i]
        name = ",".join(map(str, lengths))
        name = name if len(name) <= 26 else f"{len(lengths)} seqs, {sum(lengths)} tokens"
        line = f"{name:<28}{m['a2a2']:>10.4f}{m['ring2']:>10.4f}{m['ring2'] / m['a2a2']:>10.3f}"
        if not isinstance(predicted, str):
            pr = predicted[i]
            line += f"{pr['a2a2']:>11.4f}{pr['ring2']:>11.4f}{pr['ring2'] / pr['a2a2']:>10.3f}"
        if calibrated is not None and not isinstance(calibrated, str):
            c = calibrated[i]
            line += f"{c['a2a2']:>10.4f}{c['ring2']:>10.4f}{c['ring2'] / c['a2a2']:>9.3f}"
        print(line)
    print("paired ratio ring/a2a per repeat: median [25%, 75%]; verdict on a predicted ratio:")
    for i, lengths in enumerate(args.packs):
        q1, med, q3 = np.percentile(paired[i], [25, 50, 75])
        name = ",".join(map(str, lengths))
        name = name if len(name) <= 26 else f"{len(lengths)} seqs, {sum(lengths)} tokens"
        line = f"  {name:<26} measured {med:.3f} [{q1:.3f}, {q3:.3f}]"
        for label, pred in (("shipped", predicted), ("calibrated", calibrated)):
            if pred is None or isinstance(pred, str):
                continue
            ratio = pred[i]["ring2"] / pred[i]["a2a2"]
            off = ratio / med - 1.0
            verdict = "within 10%" if abs(off) <= 0.10 else "MISSED"
            inside = "inside" if q1 <= ratio <= q3 else "outside"
            line += f"; {label} {ratio:.3f} ({off:+.1%}, {verdict}, {inside} the iqr)"
        print(line)
    if isinstance(predicted, str):
        print(predicted)


if __name__ == "__main__":
    sys.exit(main())
