"""Packing helpers shared by the policies: memory-bounded first-fit-decreasing and LPT balancing.

Both are deterministic: ties are broken by sequence id / bin index, never by hash order, so the
same inputs give the same plan on every rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from dyncp.plan import Group, MicroBatch, Topology, padding_multiple

__all__ = ["pack_ffd", "lpt", "place_groups", "place_waves"]


def pack_ffd(
    ids: Sequence[int], lengths: Sequence[int] | np.ndarray, cp: int, topology: Topology
) -> list[list[int]]:
    """Pack sequences into micro-batches at CP size ``cp``, first-fit by decreasing length.

    A bin's memory is its padded tokens divided by cp, at most ``topology.capacity``. Raises
    ValueError naming a sequence too long for ``cp`` (callers choose cp >= its minimum).
    """
    cap = topology.capacity * cp
    unit = padding_multiple(cp)
    # Longest first, ties by id: a stable sort by length (reversed, which keeps the order of
    # equals) of the ids in order -- no key tuple per sequence.
    order = sorted(sorted(ids), key=lambda i: int(lengths[i]), reverse=True)
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
    """Lay out groups on disjoint blocks the topology's placement rules allow, in one wave.

    Raises:
        ValueError: the groups need more ranks than the world has, or no layout of them on the
            allowed blocks was found (:func:`place_waves` spills those into further waves).
    """
    total = sum(size for size, _ in sizes_and_batches)
    if total > topology.world:
        raise ValueError(f"groups need {total} ranks, the world has {topology.world}")
    waves = place_waves(sizes_and_batches, topology)
    if not waves:
        return ()
    if len(waves) > 1:
        raise ValueError(
            f"groups of sizes {sorted(size for size, _ in sizes_and_batches)} do not fit the "
            f"allowed blocks of world {topology.world} (domains of {topology.domain}) at once"
        )
    return waves[0]


def place_waves(
    sizes_and_batches: Sequence[tuple[int, list[list[int]]]], topology: Topology
) -> list[tuple[Group, ...]]:
    """Groups laid out on allowed blocks: one wave, or more when they do not fit at once.

    Largest first. On a menu whose sizes each divide the next (powers of two, or 1-3-6-12-72),
    placing each size at the lowest free block fits any groups of at most ``world`` ranks in all
    (each offset is a sum of sizes the current one divides), so one wave always results. Other
    menus (divisors of 72: 8 and 9 do not nest) need a search: :func:`_layout` tries every free
    block per group, with a node budget; groups still without a block open the next wave. Waves
    are tuples of groups sorted by start; the same input gives the same layout on every rank.
    """
    items = sorted(range(len(sizes_and_batches)), key=lambda g: (-sizes_and_batches[g][0], g))
    waves: list[tuple[Group, ...]] = []
    while items:
        starts = _layout([sizes_and_batches[g][0] for g in items], topology)
        placed = [
            Group(
                starts[k],
                sizes_and_batches[g][0],
                tuple(MicroBatch(tuple(mb)) for mb in sizes_and_batches[g][1]),
            )
            for k, g in enumerate(items)
            if starts[k] is not None
        ]
        if not placed:
            raise ValueError(
                f"a group of size {sizes_and_batches[items[0]][0]} has no block in world "
                f"{topology.world}"
            )
        waves.append(tuple(sorted(placed, key=lambda grp: grp.start)))
        items = [g for k, g in enumerate(items) if starts[k] is None]
    return waves


#: Search nodes :func:`_layout` may visit before it settles for the greedy layout.
LAYOUT_BUDGET = 4000


def _layout(sizes: list[int], topology: Topology) -> list[int | None]:
    """Starts for ``sizes`` (non-increasing) on disjoint allowed blocks; None where none fit.

    First the greedy layout (lowest free block each); if it leaves a group out, a depth-first
    search over every free block of each group (equal sizes at increasing starts, one empty
    domain tried for all empty ones) looks for a complete layout within ``LAYOUT_BUDGET`` nodes.
    """
    distinct = sorted(set(sizes))
    domain = topology.domain
    chain = all(b % a == 0 for a, b in zip(distinct, distinct[1:]))
    nested = chain and all(domain % c == 0 for c in distinct if c <= domain)
    if nested and sum(sizes) <= topology.world:  # consecutive offsets are aligned (place_waves)
        return [0, *np.cumsum(sizes[:-1], dtype=np.int64).tolist()]
    free = [True] * topology.world
    blocks = {c: topology.placements(c) for c in distinct}

    def fits(s: int, c: int) -> bool:
        return all(free[s : s + c])

    def take(s: int, c: int, value: bool) -> None:
        free[s : s + c] = [value] * c

    greedy: list[int | None] = []
    scan = dict.fromkeys(distinct, 0)  # blocks before scan[c] were taken: free only shrinks
    for c in sizes:
        b, found = scan[c], None
        while b < len(blocks[c]):
            if fits(blocks[c][b], c):
                found = blocks[c][b]
                break
            b += 1
        scan[c] = b
        greedy.append(found)
        if found is not None:
            take(found, c, False)
    if all(s is not None for s in greedy) or sum(sizes) > topology.world:
        return greedy
    free[:] = [True] * topology.world
    out: list[int | None] = [None] * len(sizes)
    nodes = 0

    def search(k: int) -> bool:
        nonlocal nodes
        if k == len(sizes):
            return True
        nodes += 1
        if nodes > LAYOUT_BUDGET:
            return False
        c = sizes[k]
        low = out[k - 1] + 1 if k and sizes[k - 1] == c else 0  # type: ignore[operator]
        tried_empty = False
        for s in blocks[c]:
            if s < low or not fits(s, c):
                continue
            if c <= domain:
                d0 = s - s % domain
                empty = all(free[d0 : d0 + domain])
                if empty and tried_empty:
                    continue
                tried_empty = tried_empty or empty
            take(s, c, False)
            out[k] = s
            if search(k + 1):
                return True
            take(s, c, True)
            out[k] = None
        return False

    return out if search(0) else greedy
