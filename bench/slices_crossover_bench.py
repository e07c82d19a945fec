"""Where plan slices become the better choice: a reader's CPU per step, whole plan vs its slice.

    python bench/slices_crossover_bench.py [--worlds 2,4,8,...,4096] [--repeats 5]

For each world size N: one dyncp-policy plan (``Planner``, CP-SAT off) of 2 x N x 8,192 tokens of
the bundled Wikipedia sample (the batches of ``control_plane_bench.py --offline``, no sequence
longer than N x 8,192), published
through a ``PlanService`` into an in-process HashStore, both whole and sliced, ``--repeats``
times each (a planner that hands out the plan already made, so the maker's time is its
encoding or cutting and its writes, not planning). Timed, median of the repeats:

- reader, whole plan: ``PlanClient.fetch`` (get, decode, check against the batch, validate) plus
  the sampler's digest of the plan (``plan_digest``), on reader rank 1;
- reader, slices: ``PlanClient.fetch`` with ``slices=True`` (header and record in one read,
  the header decoded, the record checked against its root and against the batch);
- the maker: ``PlanService.publish`` whole (JSON) and sliced (cut + one write per span);
- the bytes rank 1 reads of a sliced plan (signed header + its span's record; whole: the plan).

The sampler's ``slices="auto"`` threshold (``dyncp.sampler.config.SLICES_FROM``) is the smallest N
here from which a reader of slices spends less than a reader of whole plans at every larger N,
and the maker's extra time for cutting is below what all the readers save together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_plane_bench import _batch_at, _planner_at  # noqa: E402

from dyncp.data import load_lengths, resolve_dataset  # noqa: E402
from dyncp.plan import StepPlan, plan_digest, record_index  # noqa: E402
from dyncp.service import PlanClient, PlanService, slice_key, step_key  # noqa: E402


class _Batch:
    """The same global batch at every step (a BatchSource)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.ids, self.lengths = np.arange(len(lengths)), lengths

    def num_steps(self, epoch: int) -> int:
        return 1 << 30

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids, self.lengths


class _Made:
    """A planner that hands out one plan already made (what the maker does after planning)."""

    def __init__(self, plan: StepPlan) -> None:
        self.topology, self._plan = plan.topology, plan

    def plan(self, lengths: np.ndarray, budget: object = None) -> StepPlan:
        return self._plan


def measure(world: int, repeats: int, raw: np.ndarray) -> dict[str, float]:
    # Sequences no longer than the world holds (at most 65,536 tokens, as there).
    lengths = np.minimum(_batch_at(world, np.random.default_rng(world), raw), world * 8192)
    planner = _planner_at(world)
    plan = planner.plan(lengths)
    source = _Batch(lengths)
    out: dict[str, float] = {"sequences": len(lengths), "plan_bytes": len(plan.to_json())}
    for slices in (False, True):
        store = dist.HashStore()
        prefix = "slices" if slices else "whole"
        service = PlanService(store, source=source, planner=_Made(plan), prefix=prefix,  # type: ignore[arg-type]
                              slices=slices, lookahead=0, budget=None)  # fmt: skip
        reader = PlanClient(store, source=source, planner=planner, prefix=prefix, rank=1,
                            slices=slices, keep_steps=-1)  # fmt: skip
        made, read = [], []
        for step in range(repeats):
            t0 = time.perf_counter()
            assert service.publish(0, step)
            t1 = time.perf_counter()
            got = reader.fetch(0, step)
            if not slices:
                plan_digest(got.plan)  # the sampler's, for the agreement (a slice's is its root)
            read.append(time.perf_counter() - t1)
            made.append(t1 - t0)
            assert got.source == "service", got
        if slices:  # what rank 1 reads of a sliced plan: the header and its span's record
            key = step_key(prefix, 0, 0)
            own = slice_key(key, record_index(plan.topology, 1))
            out["read_bytes"] = len(store.get(key)) + len(store.get(own))
        out[f"maker_{prefix}"] = statistics.median(made)
        out[f"reader_{prefix}"] = statistics.median(read)
    return out


def crossover(rows: dict[int, dict[str, float]]) -> int | None:
    """The smallest N from which slices are better at every larger N measured (docstring)."""
    found = None
    for world in sorted(rows, reverse=True):
        r = rows[world]
        saved = world * (r["reader_whole"] - r["reader_slices"])
        if r["reader_slices"] < r["reader_whole"] and r["maker_slices"] - r["maker_whole"] < saved:
            found = world
        else:
            break
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4,8,16,32,64,128,256,512,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    raw = load_lengths(resolve_dataset("wikipedia"))
    rows = {}
    print(
        "     N  sequences  plan JSON  rank 1 reads  reader whole   reader slices   ratio"
        "   maker whole   maker slices"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        r = rows[world] = measure(world, args.repeats, raw)
        print(
            f"{world:6d}  {r['sequences']:9d}  {r['plan_bytes'] / 1e3:7.1f} KB"
            f"  {r['read_bytes'] / 1e3:8.1f} KB"
            f"  {r['reader_whole'] * 1e3:10.2f} ms  {r['reader_slices'] * 1e3:11.2f} ms"
            f"  {r['reader_slices'] / r['reader_whole']:6.2f}  {r['maker_whole'] * 1e3:9.1f} ms"
            f"  {r['maker_slices'] * 1e3:10.1f} ms",
            flush=True,
        )
    print(f"slices better from N = {crossover(rows)} (at every larger N measured)")


if __name__ == "__main__":
    main()
