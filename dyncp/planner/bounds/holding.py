"""The holding bounds of the tight bound: the least cost of the longest sequences' groups.

A node of the LP's branch and bound (``lp_bound``) that fixes the sizes of the ``TOP`` longest
sequences also gets the least, over every way a plan can lay those sequences out in groups (and,
under the barrier timing, waves), of what that layout costs: the wave-holding bound
(``timing="barrier"``: a group holds its ranks for its wave's level) or the dataflow holding
bound (a group's ranks are free when it ends; the groups are a schedule of rigid tasks). The
sequences outside the held groups enter through fractional knapsacks (``_Riders``). Statement
and proof: docs/lp-bound.md, "The holding bound".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from dyncp.cost_model.model import CostModel

__all__: list[str] = []


def _partitions(items: list) -> Iterator[list[list]]:
    """Every set partition of ``items`` (blocks as lists)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for b in range(len(part)):
            yield [*part[:b], [first, *part[b]], *part[b + 1 :]]


class _Riders:
    """Fractional knapsacks of the sequences other than a held set. A sequence outside the held
    groups costs at least ``u`` = min(least r + F_min tokens / C, its least r over ``vrows``);
    as a rider it weighs its r at one size, or the least over several (``wrows``, a subset of
    ``vrows``, so u / weight <= 1). Sorted once per (wrows, vrows, held set)."""

    def __init__(self, r: np.ndarray, floor: np.ndarray) -> None:
        self.r, self.floor = r, floor
        self.values: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
        self.tables: dict[tuple[tuple[int, ...], ...], tuple[np.ndarray, ...]] = {}

    def value(self, vrows: tuple[int, ...], held: tuple[int, ...]) -> np.ndarray:
        """u per sequence, 0 for the held ones."""
        key = (vrows, held)
        if key not in self.values:
            u = np.minimum(self.floor, self.r[list(vrows)].min(axis=0))
            u[list(held)] = 0.0
            self.values[key] = u
        return self.values[key]

    def rest(self, vrows: tuple[int, ...], held: tuple[int, ...]) -> float:
        """What the sequences not held cost at least, riding nowhere."""
        return float(self.value(vrows, held).sum())

    def best(
        self, wrows: tuple[int, ...], vrows: tuple[int, ...], held: tuple[int, ...], room: float
    ) -> float:
        """Most u the non-held sequences fit in ``room`` at weights min over ``wrows``."""
        if room <= 0:
            return 0.0
        key = (wrows, vrows, held)
        if key not in self.tables:
            weight = self.r[list(wrows)].min(axis=0)
            u = self.value(vrows, held)
            ok = np.isfinite(weight) & (weight > 0)
            ok[list(held)] = False
            ratio = u[ok] / weight[ok]
            order = np.argsort(-ratio, kind="stable")
            self.tables[key] = (
                np.cumsum(weight[ok][order]),
                np.cumsum(u[ok][order]),
                ratio[order],
            )
        cum_w, cum_v, ratio = self.tables[key]
        n = int(np.searchsorted(cum_w, room))
        if n >= len(cum_w):
            return float(cum_v[-1]) if len(cum_w) else 0.0
        before_w = float(cum_w[n - 1]) if n else 0.0
        before_v = float(cum_v[n - 1]) if n else 0.0
        return before_v + (room - before_w) * float(ratio[n])


def _held_value(
    items: list[tuple[int, int, float, float]],
    riders: _Riders,
    model: CostModel,
    lengths: np.ndarray,
    tables: tuple[list[int], int, int, np.ndarray, float],
    *,
    timing: str = "barrier",
) -> float:
    """Seconds (without one wave overhead) no plan beats that runs each of ``items`` (sequence,
    size row, time alone, r) at its size, however it lays them out in groups and waves
    (docs/lp-bound.md, "wave-holding" for ``"barrier"``, "dataflow holding" for ``"dataflow"``).

    tables: the allowed sizes, W, C, the fixed seconds per size, the wave overhead.
    """
    sizes, world, cap, fixed, wo = tables
    held = tuple(sorted(i for i, *_ in items))
    best = np.inf
    for groups in _partitions(items):
        if any(len({k for _, k, *_ in g}) > 1 for g in groups):
            continue  # a group has one size
        times = [_group_seconds(g, sizes[g[0][1]], cap, model, lengths) for g in groups]
        if not all(np.isfinite(times)):
            continue
        if timing == "dataflow":
            best = min(best, _dataflow_layout(groups, times, riders, held, tables))
            continue
        for waves in _partitions(list(range(len(groups)))):
            if any(sum(sizes[groups[g][0][1]] for g in q) > world for q in waves):
                continue
            span, hold, rooms, rows = 0.0, 0.0, [], []
            for q in waves:
                level = max(times[g] for g in q)
                span += level
                for g in q:
                    k = groups[g][0][1]
                    hold += sizes[k] * level
                    room = sizes[k] * (level - fixed[k]) - sum(x[3] for x in groups[g])
                    rooms.append(max(room, 0.0))
                    rows.append(k)
            every = tuple(sorted(set(rows)))
            saved = min(
                sum(riders.best((k,), every, held, x) for k, x in zip(rows, rooms, strict=True)),
                riders.best(every, every, held, sum(rooms)),
            )
            rest = riders.rest(every, held)
            value = (len(waves) - 1) * wo + max(span, (hold + rest - saved) / world)
            best = min(best, value)
    return best


def _dataflow_layout(
    groups: list[list[tuple[int, int, float, float]]],
    times: list[float],
    riders: _Riders,
    held: tuple[int, ...],
    tables: tuple[list[int], int, int, np.ndarray, float],
) -> float:
    """The dataflow value of one grouping of the held sequences (docs/lp-bound.md, "dataflow
    holding"): the larger of the least makespan of the groups as rigid tasks (size, wave
    overhead + least seconds) minus one overhead, and the ranks' busy time with the riders'
    knapsacks, each group charged its own seconds (no wave level to idle to)."""
    sizes, world, _, fixed, wo = tables
    rows = [g[0][1] for g in groups]
    tasks = [(sizes[k], wo + t) for k, t in zip(rows, times, strict=True)]
    rooms = [
        max(sizes[k] * (t - fixed[k]) - sum(x[3] for x in g), 0.0)
        for k, t, g in zip(rows, times, groups, strict=True)
    ]
    busy = sum(sizes[k] * t for k, t in zip(rows, times, strict=True))
    # Every rank pays the overhead once per group it is in; one is the caller's.
    busy += wo * max(sum(sizes[k] for k in rows) - world, 0)
    every = tuple(sorted(set(rows)))
    saved = min(
        sum(riders.best((k,), every, held, x) for k, x in zip(rows, rooms, strict=True)),
        riders.best(every, every, held, sum(rooms)),
    )
    rest = riders.rest(every, held)
    return max(_rigid_makespan(tasks, world) - wo, (busy + rest - saved) / world)


def _rigid_makespan(tasks: list[tuple[int, float]], world: int) -> float:
    """Least makespan of non-preemptive rigid tasks (ranks, seconds) on ``world`` ranks, any
    ranks per task: the best over task orders of the schedule that starts each task, in that
    order, no earlier than the previous one, as soon as enough ranks are free. Such a schedule
    in the order of some optimal schedule's start times starts every task no later than it
    does (by induction: the ranks busy at that task's start are busy in the optimum too), so
    the least over orders is the optimum."""
    best = np.inf
    for order in _orders(len(tasks)):
        free = [(0.0, world)]  # (time a rank becomes free, how many), sorted by time
        start = end = 0.0
        for t in order:
            need, seconds = tasks[t]
            left, at = need, 0.0
            for time_free, count in free:
                at = time_free
                left -= count
                if left <= 0:
                    break
            start = max(start, at)
            done = start + seconds
            end = max(end, done)
            # The ``need`` earliest-free ranks now become free at ``done``.
            out, left = [], need
            for time_free, count in free:
                take = min(left, count)
                left -= take
                if count > take:
                    out.append((time_free, count - take))
            out.append((done, need))
            free = sorted(out)
        best = min(best, end)
    return best


def _orders(n: int) -> list[tuple[int, ...]]:
    """Every order of ``n`` items."""
    return list(itertools.permutations(range(n)))


def _group_seconds(
    group: list[tuple[int, int, float, float]],
    c: int,
    cap: int,
    model: CostModel,
    lengths: np.ndarray,
) -> float:
    """Least seconds a group of size ``c`` spends running ``group``'s sequences (time alone
    given) in one wave: the cheapest split into micro-batches that fit, each block at least its
    contract-1 seconds; inf when none fits (the last sequence alone always fits)."""
    if len(group) == 1:
        return group[0][2]
    best = np.inf
    for part in _partitions(group):
        total = 0.0
        for block in part:
            if len(block) == 1:
                total += block[0][2]
                continue
            ids = np.asarray([x[0] for x in block])
            if CostModel.padded(c, lengths[ids]).sum() > c * cap:
                total = np.inf
                break
            total += model.microbatch_seconds(c, lengths[ids])
        best = min(best, total)
    return best
