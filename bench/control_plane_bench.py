"""What the control plane costs per step, measured against world size, and a model that
extrapolates it to 1,024, 4,096 and 16,384 ranks.

    python bench/control_plane_bench.py [--worlds 2,4,8,16] [--iters 200] [--offline]

1. Real processes (gloo, one thread each, forked) for each world size N, ``--iters`` steps each:
   - before (the runtime this replaced): the plan agreement as an all_gather of 24 bytes, plus
     one status all_gather per wave (2 waves), on the pool's gloo control group;
   - after: the agreement as one all_reduce(MAX) of values and complements
     (``dyncp.control.agreement.PendingAgreement``), no per-wave synchronisation;
   - ``runtime.execute`` of a 2-wave plan whose ``step_fn`` does nothing (the whole per-step
     overhead of the runtime now), with the collectives it issues and the Store requests the
     pool makes counted at their seams (wrapped ``torch.distributed`` calls, a counting Store);
   - the Store: N readers each ``get`` a 1 MB value (what a plan fetch is), the server's
     aggregate throughput and one small request's latency.
   p50 per step on rank 0 (microseconds).
2. ``--offline``: per-rank CPU of the whole-plan path on megatron-policy plans of 2 x N x 8,192
   tokens of the bundled Wikipedia sample at N = 4,096 and 16,384 (JSON bytes, decode, digest,
   validation, this rank's own checks), before (reader validates, sampler and ``execute`` hash,
   ``execute`` validates) and after (``execute(agree=False, validate=False)`` behind the
   sampler's agreement); and with slices (``dyncp.plan.slice``): bytes a rank reads (header +
   its slice), the CPU to decode the header and check its slice, all slices' bytes against the
   plan's JSON, and the maker's time to cut the plan.
   ``--policy dyncp`` plans those batches with the dyncp Planner (CP-SAT off) instead;
   ``--fallback`` also times the plan service's deterministic fallback on them
   (``service.fallback_planner``: what every rank computes inside its step when no plan is
   published).
   ``--defaults``: Store requests per reader per step with the sampler's defaults (slices, by
   ``slices="auto"``) and with ``slices=False`` (whole plans), counted at a counting Store in one
   process (they do not depend on N), and the collectives per step of the defaults (the
   sampler's agreement and ``execute(agree=True)``).
3. The model: each collective's latency fitted as a + b log2 N and as a + b N (least squares
   over the measured N; the better fit is used), the Store as a server of fixed throughput;
   per step: agreement + waves x exchange (before) or agreement (after), plus every rank
   fetching the whole plan (N x plan bytes through one server), plus the per-rank CPU of 2.
   Printed for N = 1,024 / 4,096 / 16,384 as a share of a 5-second step.

Everything here runs on the 2 shared cores of this machine: N processes time-share them, so
latencies at N > 2 include scheduling (an upper bound for a network at the same N).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dyncp.plan.slice as slice_module
from dyncp.control.agreement import PendingAgreement
from dyncp.cost_model import CostModel
from dyncp.data import BatchSchedule, load_lengths, resolve_dataset
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave, plan_digest
from dyncp.plan.slice import SliceHeader, open_slice, record_index, slice_plan, use_slices
from dyncp.planner import Planner
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.runtime import GroupPool, execute
from dyncp.runtime.executor import check_against_pool
from dyncp.service import PlanClient, PlanService, fallback_planner
from dyncp.testing.distributed import CountingStore

STEP_SECONDS = 5.0  # the step the overhead is compared with
PAYLOAD = 1 << 20  # bytes of the value the readers fetch (a plan of ~4,000 ranks)


def _p50_us(seconds: list[float]) -> float:
    return float(np.percentile(np.asarray(seconds) * 1e6, 50))


def _two_wave_plan(world: int) -> StepPlan:
    """Wave 0: every rank alone; wave 1: groups of 2 (or one rank alone when world is 1)."""
    mb = MicroBatch
    pairs = 2 if world % 2 == 0 else 1
    waves = (
        Wave(tuple(Group(r, 1, (mb((r,)),)) for r in range(world))),
        Wave(tuple(Group(s, pairs, (mb((world + s // pairs,)),)) for s in range(0, world, pairs))),
    )
    return StepPlan(Topology(world, world, 64), (8,) * (world + world // pairs), waves)


def _count_collectives(counts: Counter) -> None:
    """Wrap the torch.distributed collectives the runtime uses so that each call is counted."""
    for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _timed(op, iters: int, group) -> list[float]:
    for step in range(10):  # warm-up
        op(step)
    dist.barrier(group=group)
    out = []
    for step in range(iters):
        t0 = time.perf_counter()
        op(step)
        out.append(time.perf_counter() - t0)
    return out


def _worker(rank: int, world: int, iters: int, tmp: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/pg",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    store = CountingStore(dist.distributed_c10d._get_default_store())
    pool = GroupPool(store=store)
    control = pool.control_group
    plan = _two_wave_plan(world)
    mine = torch.tensor([0, 0, 123], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    flag = torch.zeros(1, dtype=torch.int64)
    flags = [torch.empty_like(flag) for _ in range(world)]

    def before(step: int) -> None:
        dist.all_gather(rows, mine, group=control)  # the agreement
        for _ in plan.waves:  # the status exchange after each wave
            dist.all_gather(flags, flag, group=control)

    def after(step: int) -> None:
        PendingAgreement(control, where=(step,), digest=123, label="bench").result()

    result = {
        "before": _p50_us(_timed(before, iters, control)),
        "after": _p50_us(_timed(after, iters, control)),
        "execute": _p50_us(_timed(lambda s: execute(plan, pool, lambda ctx: None), iters, control)),
    }
    counts: Counter = Counter()
    _count_collectives(counts)
    store.requests = 0
    for _ in range(10):
        execute(plan, pool, lambda ctx: None)
    result["collectives_per_step"] = {k: v / 10 for k, v in counts.items()}
    result["store_requests_per_step"] = store.requests / 10
    # The Store: every rank reads a 1 MB value, as every rank reads a plan today.
    kv = dist.distributed_c10d._get_default_store()
    if rank == 0:
        kv.set("bench/payload", b"x" * PAYLOAD)
        kv.set("bench/small", b"x")
    dist.barrier()
    small = []
    for _ in range(50):
        t0 = time.perf_counter()
        kv.get("bench/small")
        small.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        kv.get("bench/payload")
    dist.barrier()
    result["store_mb_per_s"] = world * 5 * PAYLOAD / (time.perf_counter() - t0) / 1e6
    result["store_small_us"] = _p50_us(small)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(world: int, iters: int) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker, args=(world, iters, tmp, out), nprocs=world, start_method="fork"
        )
        return json.loads(Path(out).read_text())


def _batch_at(world: int, rng: np.random.Generator, raw: np.ndarray) -> np.ndarray:
    """One global batch of 2 x world x 8,192 tokens of the sample's lengths."""
    tokens = 2 * world * 8192
    lengths = np.minimum(raw[rng.integers(0, len(raw), 4 * tokens // 300)], 65536)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


def _planner_at(world: int) -> Planner:
    model = CostModel.load("h100-reference", ranks_per_node=8)
    return Planner(model, world=world, ranks_per_node=8, capacity=8192, cpsat=None)


def _plan_at(
    world: int, rng: np.random.Generator, raw: np.ndarray, policy: str = "megatron"
) -> tuple[StepPlan, dict]:
    """A plan of one global batch of 2 x world x 8,192 tokens (megatron policy, or the dyncp
    Planner's, with its seconds)."""
    lengths = _batch_at(world, rng, raw)
    if policy == "megatron":
        return megatron_plan(lengths, Topology(world, 8, 8192)), {}
    planner = _planner_at(world)
    t0 = time.perf_counter()
    plan = planner.plan(lengths)
    return plan, {"plan_seconds": time.perf_counter() - t0, "lengths": lengths}


def fallback_seconds(world: int, lengths: np.ndarray) -> float:
    """Seconds of the plan service's deterministic fallback (what every rank computes in its
    step when no plan is published) on one batch."""
    fallback = fallback_planner(_planner_at(world))
    t0 = time.perf_counter()
    fallback.plan(lengths)
    return time.perf_counter() - t0


def _seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class _Position:
    """What ``check_against_pool`` reads of a pool for this rank's own groups."""

    def __init__(self, world: int, position: int) -> None:
        self.world, self.position = world, position
        self.ranks = tuple(range(world))
        self.group_sizes = tuple(1 << k for k in range(world.bit_length()) if world % (1 << k) == 0)
        self.head_sizes = (1,)

    def has_block(self, start: int, size: int, heads: int = 1) -> bool:
        return start % size == 0 and size in self.group_sizes and heads == 1


def _per_rank_cpu(plan: StepPlan) -> dict:
    """Seconds of each whole-plan operation a rank does per step (best of 3), and the sums."""
    text = plan.to_json()
    own = _Position(plan.topology.world, 0)
    row = {
        "sequences": len(plan.lengths),
        "json_bytes": len(text),
        "decode": _seconds(lambda: StepPlan.from_json(text)),
        "digest": _seconds(lambda: plan_digest(plan)),
        "validate": _seconds(plan.validate),
        "own_check": _seconds(lambda: check_against_pool(plan, own, validate=False)),  # type: ignore[arg-type]
    }
    row["before"] = row["decode"] + 2 * row["validate"] + 2 * row["digest"]
    row["after"] = row["decode"] + row["validate"] + row["digest"] + row["own_check"]
    # Slices: the maker cuts the plan once; a rank decodes the header and checks its slice.
    row["cut"] = _seconds(lambda: slice_plan(plan), repeats=1)
    # The baseline, in the same run: one record per position (the layout before node records).
    with mock.patch.object(slice_module, "slice_span", lambda topology: 1):
        row["cut_per_rank"] = _seconds(lambda: slice_plan(plan), repeats=1)
        _, per_rank = slice_plan(plan)
    row["per_rank_stored"] = sum(len(r) for r in per_rank)
    header, records = slice_plan(plan)
    sizes = np.array([len(r) for r in records])
    raw_header = header.to_json()
    positions = range(0, plan.topology.world, max(1, plan.topology.world // 64))
    topo = plan.topology
    row["slice_cpu"] = max(
        _seconds(
            lambda p=p: open_slice(
                SliceHeader.from_json(raw_header), records[record_index(topo, p)], p
            )
        )
        for p in positions
    )
    row["slice_median"], row["slice_max"] = int(np.median(sizes)), int(sizes.max())
    row["header_bytes"] = len(raw_header)
    row["slices_stored"] = int(sizes.sum()) + len(raw_header)
    return row


def offline(worlds: list[int], policy: str = "megatron", fallback: bool = False) -> dict[int, dict]:
    raw = load_lengths(resolve_dataset("wikipedia"))
    rng = np.random.default_rng(0)
    out = {}
    for world in worlds:
        plan, times = _plan_at(world, rng, raw, policy)
        out[world] = {**_per_rank_cpu(plan), **times}
        _print_offline({world: out[world]}, policy)
    if policy == "dyncp" and fallback:
        for world in worlds:
            seconds = fallback_seconds(world, out[world].pop("lengths"))
            print(f"  {world:6d} ranks: the deterministic fallback planned in {seconds:.2f} s")
    return out


def defaults_requests(steps: int = 8) -> dict[str, dict[str, float]]:
    """Store requests per step of reader ranks 0 and 1 with the defaults (``slices="auto"``:
    slices at this world, ``use_slices``) and with whole plans (``slices=False``), the service
    publishing in the same process before each read; counted over the second half of the steps
    (in steady state: old keys are being deleted). Rank 1 is not the first of its span: the
    first (here rank 0) also deletes the span's old record."""
    world = 4
    model = CostModel.load("h100-reference", ranks_per_node=world)
    planner = Planner(model, world=world, ranks_per_node=world, capacity=1024, cpsat=None)
    rng = np.random.default_rng(3)
    schedule = BatchSchedule(
        np.clip(rng.lognormal(5.5, 1.2, 400).astype(np.int64), 1, 4096),
        max_length=4096,
        global_batch_tokens=2 * world * 1024,
    )
    default = use_slices("auto", planner.topology, pipelined=False)
    out: dict[str, dict[str, float]] = {}
    for slices in (default, not default):
        base = dist.HashStore()
        prefix = "slices" if slices else "whole"
        service = PlanService(
            base, source=schedule, planner=planner, prefix=prefix, slices=slices, lookahead=0
        )
        readers = {
            r: PlanClient(
                CountingStore(base),
                source=schedule,
                planner=planner,
                prefix=prefix,
                rank=r,
                slices=slices,
                keep_steps=2,
            )
            for r in (0, 1)
        }
        counts = {0: 0, 1: 0}
        for step in range(steps):
            service.publish(0, step)
            for r, reader in readers.items():
                before = reader.store.requests
                got = reader.fetch(0, step)
                assert got.source == "service", got
                if step >= steps // 2:
                    counts[r] += reader.store.requests - before
        kind = "slices" if slices else "whole plans"
        label = f"{kind} ({'the default' if slices == default else f'slices={slices}'})"
        out[label] = {f"rank {r}": n / (steps - steps // 2) for r, n in counts.items()}
    return out


def _fit(worlds: list[int], us: list[float]) -> tuple[str, float, float]:
    """The better of a + b log2 N and a + b N (least squares), as (form, a, b)."""
    best = None
    for form, x in (("log", np.log2(worlds)), ("linear", np.asarray(worlds, float))):
        a_mat = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(a_mat, np.asarray(us), rcond=None)
        err = float(np.sum((a_mat @ np.array([a, b]) - us) ** 2))
        if best is None or err < best[0]:
            best = (err, form, float(a), float(b))
    assert best is not None
    return best[1], best[2], best[3]


def _predict(form: str, a: float, b: float, world: int) -> float:
    return a + b * (np.log2(world) if form == "log" else world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4,8,16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--offline", action="store_true", help="per-rank CPU at 4,096 and 16,384")
    p.add_argument("--policy", choices=("megatron", "dyncp"), default="megatron")
    p.add_argument("--defaults", action="store_true", help="Store requests of the defaults")
    p.add_argument("--fallback", action="store_true", help="time the deterministic fallback")
    p.add_argument("--no-processes", action="store_true", help="skip part 1 (and the model)")
    args = p.parse_args()
    if args.defaults:
        print("Store requests per reader per step (with the defaults; N does not matter):")
        for kind, ranks in defaults_requests().items():
            print(f"  {kind}: " + ", ".join(f"{r} {n:.2f}" for r, n in ranks.items()))
        print(
            "  collectives per step with the defaults: the sampler's agreement (1 all_reduce) +"
            " execute(agree=True) (1 all_reduce) = 2; execute(agree=False) behind the sampler: 1"
        )
    if args.no_processes:
        if args.offline:
            offline([4096, 16384], args.policy, args.fallback)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = {w: measure(w, args.iters) for w in worlds}
    print(f"1. real gloo processes on this machine ({os.cpu_count()} cores), p50 per step:")
    print(
        "   N   before (all_gather + 2 exchanges)   after (all_reduce)   ratio   execute no-op"
        "   collectives/step   Store req/step   Store MB/s   Store get"
    )
    for w, r in rows.items():
        print(
            f"  {w:3d}   {r['before']:10.0f} us {'':21} {r['after']:9.0f} us   "
            f"{r['after'] / r['before']:5.2f}   {r['execute']:9.0f} us   "
            f"{json.dumps(r['collectives_per_step']):>16}   {r['store_requests_per_step']:6.1f}"
            f"   {r['store_mb_per_s']:9.0f}   {r['store_small_us']:6.0f} us"
        )
    fits = {k: _fit(worlds, [rows[w][k] for w in worlds]) for k in ("before", "after")}
    for k, (form, a, b) in fits.items():
        shape = "log2 N" if form == "log" else "N"
        print(f"   fit {k}: {a:.0f} + {b:.1f} x {shape} us")
    throughput = float(np.median([rows[w]["store_mb_per_s"] for w in worlds])) * 1e6
    cpu = offline([4096, 16384], args.policy, args.fallback) if args.offline else {}
    _print_model(cpu, fits, throughput)


def _print_offline(cpu: dict[int, dict], policy: str) -> None:
    print(f"2. per-rank CPU per step ({policy} plans, Wikipedia lengths):", flush=True)
    for w, r in cpu.items():
        if "plan_seconds" in r:
            print(f"  {w:6d} ranks: planned in {r['plan_seconds']:.2f} s", flush=True)
        print(
            f"  {w:6d} ranks: {r['sequences']} sequences, JSON {r['json_bytes'] / 1e6:.2f} MB;"
            f" decode {r['decode'] * 1e3:.0f} ms, digest {r['digest'] * 1e3:.0f} ms, validate"
            f" {r['validate'] * 1e3:.0f} ms, own groups {r['own_check'] * 1e3:.1f} ms ->"
            f" whole plan before {r['before'] * 1e3:.0f} ms, after {r['after'] * 1e3:.0f} ms;"
            f" slices: header {r['header_bytes']} B + slice median {r['slice_median']} B /"
            f" max {r['slice_max']} B, checked in {r['slice_cpu'] * 1e3:.2f} ms (worst of"
            f" 64 positions); all slices {r['slices_stored'] / r['json_bytes']:.2f}x the"
            f" plan's JSON; cut once by the maker in {r['cut']:.2f} s (baseline, one record per"
            f" rank: {r['per_rank_stored'] / r['json_bytes']:.2f}x, cut in"
            f" {r['cut_per_rank']:.2f} s)"
        )


def _print_model(cpu: dict[int, dict], fits: dict, throughput: float) -> None:
    print(
        f"3. model (Store throughput {throughput / 1e6:.0f} MB/s, measured above; plan bytes "
        "from 2 where given, else 100 B per rank):"
    )
    for world in (1024, 4096, 16384):
        plan_bytes = cpu.get(world, {}).get("json_bytes", 100 * world)
        fetch = world * plan_bytes / throughput
        agree = {k: _predict(*fits[k], world) / 1e6 for k in fits}
        per_rank = cpu.get(world, {})
        for k in ("before", "after"):
            cpu_text = f"{per_rank[k] * 1e3:6.0f} ms" if per_rank else "(not run)"
            total = agree[k] + fetch + per_rank.get(k, 0.0)
            print(
                f"  {world:6d} ranks {k:6s}: collectives {agree[k] * 1e3:7.1f} ms + whole-plan "
                f"fetch {fetch:7.2f} s ({world * plan_bytes / 1e9:.1f} GB) + per-rank CPU "
                f"{cpu_text} = {total:7.2f} s ({100 * total / STEP_SECONDS:.1f}% of a "
                f"{STEP_SECONDS:g} s step)"
            )
        if per_rank:
            read = world * (per_rank["header_bytes"] + per_rank["slice_median"])
            total = agree["after"] + read / throughput + per_rank["slice_cpu"]
            print(
                f"  {world:6d} ranks slices: collectives {agree['after'] * 1e3:7.1f} ms + slice "
                f"fetch {read / throughput * 1e3:7.1f} ms ({read / 1e6:.1f} MB) + per-rank CPU "
                f"{per_rank['slice_cpu'] * 1e3:6.2f} ms = {total:7.2f} s "
                f"({100 * total / STEP_SECONDS:.1f}% of a {STEP_SECONDS:g} s step)"
            )


if __name__ == "__main__":
    main()
