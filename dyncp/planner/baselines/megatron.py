"""Megatron-LM's dev-branch dynamic-CP greedy (packing-aware), re-implemented as a baseline.

Behaviour follows the dev branch's packing-aware dynamic-CP greedy (``next_hdp_group_packing_aware``
in megatron/core/datasets/data_schedule_utils.py); the code is dyncp's own. It is not the
scheduler of any megatron-core release: megatron-core 0.16.1 ships ``BalancedCPScheduler``, run
itself by the simulator's ``megatron-core`` policy (``dyncp.sim.release``). The policy keeps its
name ``megatron`` so that reports, commands and plan digests stay valid. Per wave (Megatron: one
"DCP micro-batch"):

1. sequences are taken longest first; the longest remaining opens a group at its minimum CP size
   (next power of two of length / capacity);
2. each further sequence tries every allowed size >= its minimum: joining an existing group of that
   size whose packed tokens per rank still fit, or opening a new group on free ranks; the option
   with the smallest resulting maximum rank workload wins, where workload = len^2 / cp -- the only
   cost Megatron knows -- provided it stays under ``tall * capacity * 1.05`` (tall: the longest
   sequence of the wave); otherwise the sequence waits for a later wave;
3. while ranks stay idle, the first group of the smallest size doubles (its work spread over
   twice the ranks); if no group can grow, the wave becomes one group of all ranks (here: the
   largest allowed size holding the wave's longest sequence) packing what fits; the rest waits.

Each group runs one packed micro-batch per wave; waves repeat until every sequence is placed.
Step 2 keeps, per CP size, the groups' packed tokens and workloads in arrays, so that choosing a
group is one vectorised pass instead of a Python loop over every group (the same choice: the
smallest resulting maximum workload, the earliest group on ties).
Differences from Megatron, forced by dyncp's plan contract: memory counts zigzag padding (a
multiple of 2c per sequence, so plans validate), and groups are laid out on aligned blocks
(Megatron uses contiguous, possibly unaligned, ranks; the sizes and the work are the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from dyncp.plan import StepPlan, Topology, Wave, padded_length
from dyncp.planner.batch import Batch
from dyncp.planner.construction.packing import place_waves

__all__ = [
    "megatron_plan",
    "plan_wave_by_wave",
    "WaveGroup",
    "full_world_wave",
    "WORKLOAD_CAP_DELTA",
    "powers_of_two",
]

WORKLOAD_CAP_DELTA = 0.05


class WaveGroup:
    """One group of a wave as it is being formed: its CP size, sequence ids, padded tokens and
    ``len^2 / cp`` workload (shared with the tests' plain-loop reference)."""

    __slots__ = ("size", "ids", "tokens", "load")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ids: list[int] = []
        self.tokens = 0  # padded tokens of the pack
        self.load = 0.0  # len^2 / cp summed, identical on every member rank


class _SizeGroups:
    """The groups of one CP size in creation order, with tokens and workloads as arrays."""

    __slots__ = ("groups", "tokens", "loads")

    def __init__(self) -> None:
        self.groups: list[WaveGroup] = []
        self.tokens = np.zeros(16, dtype=np.int64)
        self.loads = np.zeros(16, dtype=np.float64)

    def add(self, g: WaveGroup) -> int:
        n = len(self.groups)
        if n == len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.zeros(n, dtype=np.int64)])
            self.loads = np.concatenate([self.loads, np.zeros(n, dtype=np.float64)])
        self.groups.append(g)
        return n

    def best(self, limit: int, work: float, peak: float) -> tuple[float, int] | None:
        """(projected peak, index) of the group that takes ``work`` with the smallest resulting
        peak among those whose tokens stay within ``limit`` (earliest on ties), or None."""
        n = len(self.groups)
        if not n:
            return None
        projected = np.maximum(peak, self.loads[:n] + work)
        projected[self.tokens[:n] > limit] = np.inf
        j = int(np.argmin(projected))
        value = float(projected[j])
        return None if value == np.inf else (value, j)


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
    by_size = {cp: _SizeGroups() for cp in sizes}
    by_size[g0.size].add(g0)
    by_size[g0.size].tokens[0], by_size[g0.size].loads[0] = g0.tokens, g0.load
    free = world - g0.size
    peak = g0.load
    leftovers: list[int] = []

    for i in order[1:]:
        s = int(lengths[i])
        best: tuple[float, int, int] | None = None  # (projected, cp, group index or -1: new)
        for cp in sizes:
            if cp < min_cp[i]:
                continue
            work = s * s / cp
            pad = padded_length(s, cp)
            found = by_size[cp].best(cp * cap_tokens - pad, work, peak)
            if found is not None and found[0] <= cap and (best is None or found[0] < best[0]):
                best = (found[0], cp, found[1])
            if free >= cp:
                projected = max(peak, work)
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, cp, -1)
        if best is None:
            leftovers.append(i)
            continue
        projected, cp, j = best
        same = by_size[cp]
        if j < 0:
            g = WaveGroup(cp)
            groups.append(g)
            j = same.add(g)
            free -= cp
        g = same.groups[j]
        g.ids.append(i)
        g.tokens += padded_length(s, cp)
        g.load += s * s / cp
        same.tokens[j], same.loads[j] = g.tokens, g.load
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


def full_world_wave(
    order: list[int], lengths: np.ndarray, topology: Topology
) -> tuple[list[WaveGroup], list[int]]:
    """Fallback: one group as large as allowed takes, longest first, whatever fits.

    Megatron uses all ranks; here the largest allowed size that still holds the wave's longest
    sequence (the world itself when it is an allowed size), so every wave makes progress.
    """
    tall = int(lengths[order[0]])
    size = max(c for c in topology.group_sizes if padded_length(tall, c) <= c * topology.capacity)
    g = WaveGroup(size)
    leftovers = []
    for i in order:
        pad = padded_length(int(lengths[i]), size)
        if g.tokens + pad <= size * topology.capacity:
            g.ids.append(i)
            g.tokens += pad
        else:
            leftovers.append(i)
    return [g], leftovers


class _FormedGroup(Protocol):
    size: int
    ids: list[int]


#: One wave from the remaining ids (longest first): its groups and the ids left for later waves.
FormWave = Callable[
    [list[int], np.ndarray, np.ndarray, Topology], tuple[Sequence[_FormedGroup], list[int]]
]


def plan_wave_by_wave(
    lengths: Batch | np.ndarray, topology: Topology, form_wave: FormWave, policy: str
) -> StepPlan:
    """The plan Megatron-style schedulers build: waves formed one after another from the
    sequences left, longest first, each group one packed micro-batch placed on aligned ranks.
    Shared by ``megatron``, ``megatron-min-cp`` and the tests' plain-loop reference; they differ
    only in ``form_wave``. ``lengths``: or their ``Batch``, reused when on ``topology``."""
    batch = Batch.of(lengths, topology)
    lengths, min_cp = batch.lengths, batch.min_cp
    remaining = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    waves = []
    while remaining:
        groups, remaining = form_wave(remaining, lengths, min_cp, topology)
        placed = place_waves([(g.size, [g.ids]) for g in groups], topology)
        waves += [Wave(gs) for gs in placed]
    return StepPlan(topology, tuple(int(s) for s in lengths), tuple(waves), policy=policy)


def powers_of_two(topology: Topology) -> Topology:
    """The topology with only the menu's powers of two: Megatron's CP sizes are powers of two
    (its rule, kept in the baseline whatever menu dyncp gets).

    Raises:
        ValueError: the menu holds no power of two (nothing for Megatron to use).
    """
    sizes = tuple(c for c in topology.group_sizes if c & (c - 1) == 0)
    if not sizes:
        raise ValueError(
            f"Megatron's CP sizes are powers of two; the menu {list(topology.group_sizes)} "
            "holds none"
        )
    if sizes == topology.group_sizes:
        return topology
    return replace(topology, group_sizes=sizes, head_sizes=(1,))


def megatron_plan(lengths: Batch | np.ndarray, topology: Topology) -> StepPlan:
    """Plan a step the way Megatron Core's dynamic-CP scheduler would (powers of two only).
    ``lengths``: or their ``Batch`` (reused when the menu holds only powers of two)."""
    plan = plan_wave_by_wave(lengths, powers_of_two(topology), _form_wave, "megatron")
    plan.topology = topology
    return plan
