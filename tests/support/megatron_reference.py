"""The megatron policy as first written: a Python loop over every group for every document.

Kept as the reference that ``dyncp.planner.baselines.megatron`` (which chooses groups with one
vectorised pass per CP size) must match plan for plan, and as the baseline of
bench/megatron_bench.py.
"""

from __future__ import annotations

import numpy as np

from dyncp.plan import StepPlan, Topology, padded_length
from dyncp.planner.baselines.megatron import (
    WORKLOAD_CAP_DELTA,
    WaveGroup,
    full_world_wave,
    plan_wave_by_wave,
)

__all__ = ["reference_megatron_plan"]


def _form_wave(
    order: list[int], lengths: np.ndarray, min_cp: np.ndarray, topology: Topology
) -> tuple[list[WaveGroup], list[int]]:
    """One wave from ``order`` (longest first); returns its groups and the leftover ids."""
    cap_tokens = topology.capacity
    world = topology.world
    sizes = topology.group_sizes
    tall = int(lengths[order[0]])
    cap = tall * cap_tokens * (1.0 + WORKLOAD_CAP_DELTA)

    first = order[0]
    g0 = WaveGroup(int(min_cp[first]))
    g0.ids.append(first)
    g0.tokens = padded_length(tall, g0.size)
    g0.load = tall * tall / g0.size
    groups = [g0]
    free = world - g0.size
    peak = g0.load
    leftovers: list[int] = []

    for i in order[1:]:
        s = int(lengths[i])
        best: tuple[float, int, WaveGroup | None] | None = None
        for cp in sizes:
            if cp < min_cp[i]:
                continue
            work = s * s / cp
            pad = padded_length(s, cp)
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
            g = WaveGroup(cp)
            groups.append(g)
            free -= cp
        g.ids.append(i)
        g.tokens += padded_length(s, cp)
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
                if sum(padded_length(int(lengths[i]), new) for i in g.ids) > new * cap_tokens:
                    continue
                g.size, g.tokens = new, sum(padded_length(int(lengths[i]), new) for i in g.ids)
                g.load = sum(int(lengths[i]) ** 2 / new for i in g.ids)
                free -= new - smallest
                grown = True
                break
        if not grown:
            return full_world_wave(order, lengths, topology)
    return groups, leftovers


def reference_megatron_plan(lengths: np.ndarray, topology: Topology) -> StepPlan:
    """The plain-loop megatron policy (documents x groups per wave)."""
    return plan_wave_by_wave(lengths, topology, _form_wave, "megatron")
