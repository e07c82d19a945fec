"""The megatron policy as first written: a Python loop over every group for every document.

Kept as the reference that ``dyncp.planner.megatron`` (which chooses groups with one vectorised
pass per CP size) must match plan for plan, and as the baseline of bench/megatron_bench.py.
"""

from __future__ import annotations

import numpy as np

from dyncp.plan import StepPlan, Topology, Wave
from dyncp.planner.bound import min_cp_sizes
from dyncp.planner.megatron import WORKLOAD_CAP_DELTA
from dyncp.planner.packing import place_groups

__all__ = ["reference_megatron_plan"]


class _WaveGroup:
    __slots__ = ("size", "ids", "tokens", "load")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ids: list[int] = []
        self.tokens = 0  # padded tokens of the pack
        self.load = 0.0  # len^2 / cp summed, identical on every member rank


def _padded(length: int, cp: int) -> int:
    return length if cp == 1 else -(-length // (2 * cp)) * 2 * cp


def _form_wave(
    order: list[int], lengths: np.ndarray, min_cp: np.ndarray, topology: Topology
) -> tuple[list[_WaveGroup], list[int]]:
    """One wave from ``order`` (longest first); returns its groups and the leftover ids."""
    cap_tokens = topology.capacity
    world = topology.world
    sizes = topology.group_sizes
    tall = int(lengths[order[0]])
    cap = tall * cap_tokens * (1.0 + WORKLOAD_CAP_DELTA)

    first = order[0]
    g0 = _WaveGroup(int(min_cp[first]))
    g0.ids.append(first)
    g0.tokens = _padded(tall, g0.size)
    g0.load = tall * tall / g0.size
    groups = [g0]
    free = world - g0.size
    peak = g0.load
    leftovers: list[int] = []

    for i in order[1:]:
        s = int(lengths[i])
        best: tuple[float, int, _WaveGroup | None] | None = None
        for cp in sizes:
            if cp < min_cp[i]:
                continue
            work = s * s / cp
            pad = _padded(s, cp)
            for g in groups:
                if g.size != cp or g.tokens + pad > cp * cap_tokens:
                    continue
                projected = max(peak, g.load + work)
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, cp, g)
            if free >= cp:
                projected = max(peak, work)
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, cp, None)
        if best is None:
            leftovers.append(i)
            continue
        projected, cp, g = best
        if g is None:
            g = _WaveGroup(cp)
            groups.append(g)
            free -= cp
        g.ids.append(i)
        g.tokens += _padded(s, cp)
        g.load += s * s / cp
        peak = projected

    while free > 0:
        smallest = min(g.size for g in groups)
        bigger = [c for c in sizes if c > smallest]
        grown = False
        if bigger and bigger[0] - smallest <= free:
            new = bigger[0]
            for g in groups:
                if g.size != smallest:
                    continue
                if sum(_padded(int(lengths[i]), new) for i in g.ids) > new * cap_tokens:
                    continue
                g.size, g.tokens = new, sum(_padded(int(lengths[i]), new) for i in g.ids)
                g.load = sum(int(lengths[i]) ** 2 / new for i in g.ids)
                free -= new - smallest
                grown = True
                break
        if not grown:
            return _full_world_wave(order, lengths, topology)
    return groups, leftovers


def _full_world_wave(
    order: list[int], lengths: np.ndarray, topology: Topology
) -> tuple[list[_WaveGroup], list[int]]:
    """Fallback: one group as large as allowed takes, longest first, whatever fits.

    Megatron uses all ranks; here the largest allowed size that still holds the wave's longest
    sequence (the world itself when it is an allowed size), so every wave makes progress.
    """
    tall = int(lengths[order[0]])
    size = max(c for c in topology.group_sizes if _padded(tall, c) <= c * topology.capacity)
    g = _WaveGroup(size)
    leftovers = []
    for i in order:
        pad = _padded(int(lengths[i]), size)
        if g.tokens + pad <= size * topology.capacity:
            g.ids.append(i)
            g.tokens += pad
        else:
            leftovers.append(i)
    return [g], leftovers


def reference_megatron_plan(lengths: np.ndarray, topology: Topology) -> StepPlan:
    """The plain-loop megatron policy (documents x groups per wave)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    min_cp = min_cp_sizes(lengths, topology)
    remaining = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    waves = []
    while remaining:
        groups, remaining = _form_wave(remaining, lengths, min_cp, topology)
        waves.append(Wave(place_groups([(g.size, [g.ids]) for g in groups], topology)))
    return StepPlan(topology, tuple(int(s) for s in lengths), tuple(waves), policy="megatron")
