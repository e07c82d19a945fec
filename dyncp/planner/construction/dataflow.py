"""Dataflow re-layout: the same groups, on the ranks that are free first.

Under the dataflow timing (``dyncp.cost_model.evaluate``) a group starts when its last member is
free, so *which* ranks a group of a later wave occupies matters, where under a barrier it does
not: a wave's groups are laid out on blocks in an order chosen when every wave started together,
and a long group may land on ranks still busy with the previous wave's longest group while ranks
freed early idle.

``relayout`` keeps every wave's groups (their sizes, head splits and micro-batches, so every
micro-batch's seconds) and moves them to other blocks the topology allows, wave by wave in order:
largest size first, the groups of one size, longest first, go to the blocks of that size whose
ranks are free earliest (the k-th longest group on the k-th earliest block: for one size this
pairing minimises the latest end among those blocks). Blocks with a rank already taken in the
wave are skipped; if a size runs out of blocks (menus whose sizes do not nest) the plan is left
as it is. A heuristic: the caller prices the result and keeps it only when it is faster.

Cost: a sort of each size's blocks per wave (vectorised), so it stays cheap at thousands of ranks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dyncp.cost_model.evaluate import PlanCost
from dyncp.plan import Group, StepPlan, Wave

__all__ = ["relayout"]


def relayout(plan: StepPlan, cost: PlanCost, wave_overhead: float) -> tuple[float, StepPlan] | None:
    """``plan`` with each wave's groups moved to the blocks free earliest (module docstring) and
    its dataflow step seconds, or None when nothing moved or a size ran out of blocks. ``cost``
    is ``plan``'s cost under either timing (only its micro-batch seconds are used)."""
    if len(plan.waves) < 2:  # every group of a single wave starts at 0 wherever it is
        return None
    topo = plan.topology
    free = np.zeros(topo.world)
    blocks: dict[int, np.ndarray] = {}
    waves: list[Wave] = []
    moved = False
    for wave, seconds in zip(plan.waves, cost.microbatch_seconds):
        spans, j = [], 0
        for group in wave.groups:
            n = len(group.microbatches)
            spans.append(float(np.asarray(seconds[j : j + n]).sum()))  # as time_waves sums
            j += n
        taken = np.zeros(topo.world, dtype=bool)
        by_size: dict[int, list[int]] = {}
        for g, group in enumerate(wave.groups):
            by_size.setdefault(group.size, []).append(g)
        placed: list[tuple[Group, float]] = []
        for size in sorted(by_size, reverse=True):
            if size not in blocks:
                blocks[size] = np.asarray(topo.placements(size), dtype=np.int64)
            starts = blocks[size]
            cols = starts[:, None] + np.arange(size)[None, :]
            open_ = ~taken[cols].any(axis=1)
            starts, cols = starts[open_], cols[open_]
            members = by_size[size]
            if len(starts) < len(members):
                return None
            ready = free[cols].max(axis=1)
            order = np.lexsort((starts, ready))[: len(members)]  # earliest blocks, ties: lowest
            longest = sorted(members, key=lambda g: (-spans[g], wave.groups[g].start))
            for g, b in zip(longest, order.tolist()):
                group = wave.groups[g]
                start = int(starts[b])
                moved |= start != group.start
                taken[start : start + size] = True
                placed.append((replace(group, start=start), spans[g]))
        for group, span in placed:  # the new starts, timed as dataflow runs them
            ranks = slice(group.start, group.start + group.size)
            free[ranks] = free[ranks].max() + wave_overhead + span
        waves.append(Wave(tuple(sorted((g for g, _ in placed), key=lambda grp: grp.start))))
    if not moved:
        return None
    return float(free.max()), replace(plan, waves=tuple(waves), stats=dict(plan.stats))
