"""Level-filled candidates of the greedy constructor: every wave filled up to one common level.

Each sequence takes the smallest CP size whose time fits the level; long ones first-fit into
groups of their size in the earliest wave with room, short ones where the most room is left.
"""

from __future__ import annotations

import heapq

import numpy as np

from dyncp.plan import StepPlan
from dyncp.planner.construction.base import ConstructorBase

__all__ = ["LEVEL_FACTORS", "LevelCandidates"]

# Common wave levels tried by build_level, as multiples of the ideal step.
LEVEL_FACTORS = (
    0.97,
    1.0,
    1.02,
    1.04,
    1.06,
    1.08,
    1.11,
    1.15,
    1.2,
    1.25,
    1.32,
    1.4,
    1.55,
    1.7,
    2.0,
)


class LevelCandidates(ConstructorBase):
    """The level-filled family (module docstring): ``build_level``."""

    def build_level(self, level: float) -> StepPlan:
        """Every wave filled up to one common ``level`` (seconds).

        Each sequence takes the smallest CP size whose time fits the level (or its fastest);
        long sequences first-fit into groups of their size in the earliest wave with room, new
        waves opening as needed; short ones go where the most room is left, and once nothing
        has room, onto the least-loaded single rank (raising its wave).
        """
        world = self.topology.world
        cols = np.arange(len(self.lengths))
        fits = self.seconds <= level
        k = np.where(fits.any(axis=0), fits.argmax(axis=0), self.alone.argmin(axis=0))
        t = self.seconds[k, cols]
        size = self.sizes[k]
        waves: list[list[list]] = []  # per wave: [size, ids, load] per group
        free: list[int] = []
        for i in sorted(np.flatnonzero(size > 1).tolist(), key=lambda i: (-size[i], -t[i], i)):
            c = int(size[i])
            home = next((g for gs in waves for g in gs if g[0] == c and g[2] + t[i] <= level), None)
            if home is None:
                w = next((w for w, f in enumerate(free) if f >= c), None)
                if w is None:
                    waves.append([])
                    free.append(world)
                    w = len(waves) - 1
                home = [c, [], 0.0]
                waves[w].append(home)
                free[w] -= c
            home[1].append(i)
            home[2] += t[i]
        sand = sorted(np.flatnonzero(size == 1).tolist(), key=lambda i: (-t[i], i))
        if sand and not any(free):
            waves.append([])
            free.append(world)
        for w, f in enumerate(free):
            waves[w] += [[1, [], 0.0] for _ in range(f)]
        groups = [g for gs in waves for g in gs]
        rooms = [(g[2] - level, j) for j, g in enumerate(groups)]  # min-heap of -room
        heapq.heapify(rooms)
        singles = [(0.0, j) for j, g in enumerate(groups) if g[0] == 1]
        for i in sand:
            # Every update pushes a fresh entry, so entries that disagree are stale: drop them.
            while rooms[0][0] != groups[rooms[0][1]][2] - level:
                heapq.heappop(rooms)
            neg_room, j = rooms[0]
            cost = self.seconds[self.costs.index(groups[j][0]), i]
            overflow = cost > -neg_room
            if overflow:  # no room anywhere: the least-loaded single rank takes it
                while singles[0][0] != groups[singles[0][1]][2]:
                    heapq.heappop(singles)
                j = singles[0][1]
                cost = t[i]
            groups[j][1].append(i)
            groups[j][2] += cost
            heapq.heappush(rooms, (groups[j][2] - level, j))
            if groups[j][0] == 1:
                heapq.heappush(singles, (groups[j][2], j))
        return self.assemble([[(g[0], g[1]) for g in gs if g[1]] for gs in waves])
