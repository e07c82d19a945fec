"""Packing helpers shared by the policies: memory-bounded first-fit-decreasing and LPT balancing.

Both are deterministic: ties are broken by sequence id / bin index, never by hash order, so the
same inputs give the same plan on every rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from dyncp.plan import Group, MicroBatch, Topology

__all__ = ["pack_ffd", "lpt", "place_groups"]


def pack_ffd(
    ids: Sequence[int], lengths: Sequence[int] | np.ndarray, cp: int, topology: Topology
) -> list[list[int]]:
    """Pack sequences into micro-batches at CP size ``cp``, first-fit by decreasing length.

    A bin's memory is its padded tokens divided by cp, at most ``topology.capacity``. Raises
    ValueError naming a sequence too long for ``cp`` (callers choose cp >= its minimum).
    """
    cap = topology.capacity * cp
    unit = 1 if cp == 1 else 2 * cp
    order = sorted(ids, key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = -(-int(lengths[i]) // unit) * unit
        if need > cap:
            raise ValueError(
                f"sequence {i} of length {lengths[i]} does not fit a group of {cp} ranks at "
                f"capacity {topology.capacity} tokens per rank"
            )
        for b, free in enumerate(room):
            if need <= free:
                bins[b].append(i)
                room[b] -= need
                break
        else:
            bins.append([i])
            room.append(cap - need)
    return bins


def lpt(costs: Sequence[float], n_bins: int, initial: Sequence[float] | None = None) -> list[int]:
    """Longest-processing-time assignment: item index -> bin, items taken in decreasing cost.

    Each item goes to the bin with the least load (ties: lowest bin index).
    """
    loads = [(float(initial[b]) if initial is not None else 0.0, b) for b in range(n_bins)]
    heapq.heapify(loads)
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(loads)
        out[i] = b
        heapq.heappush(loads, (load + float(costs[i]), b))
    return out


def place_groups(
    sizes_and_batches: Sequence[tuple[int, list[list[int]]]], topology: Topology
) -> tuple[Group, ...]:
    """Lay out groups of power-of-two sizes on aligned rank blocks, largest first.

    Placing sizes in decreasing order at consecutive offsets keeps every block aligned (each
    offset is a sum of sizes no smaller than the current one). Raises ValueError if they need more
    ranks than the world has.
    """
    total = sum(size for size, _ in sizes_and_batches)
    if total > topology.world:
        raise ValueError(f"groups need {total} ranks, the world has {topology.world}")
    order = sorted(range(len(sizes_and_batches)), key=lambda g: (-sizes_and_batches[g][0], g))
    groups = []
    start = 0
    for g in order:
        size, batches = sizes_and_batches[g]
        groups.append(Group(start, size, tuple(MicroBatch(tuple(mb)) for mb in batches)))
        start += size
    return tuple(groups)
