"""Stretch-rule candidates of the greedy constructor: CP sizes by a stretch rule, then sand poured.

Each long sequence gets the CP size cheapest in rank-seconds, raised while the sequence alone
would outlast ``stretch`` x the ideal step and a larger group runs it faster (or doubled
``boost`` times); long sequences first-fit into groups up to a level, groups laid into waves
largest first; short sequences poured into the spare time under each wave's level, the rest into
a final wave balanced by LPT.
"""

from __future__ import annotations

import heapq

import numpy as np

from dyncp.plan import StepPlan
from dyncp.planner.construction.base import ConstructorBase
from dyncp.planner.construction.packing import lpt

__all__ = ["STRUCTURES", "StretchCandidates"]

# (stretch, boost) structures tried: how far a long sequence may outlast the ideal step before it
# gets a larger group, and how many times all long sequences' CP sizes are doubled.
STRUCTURES = ((1.0, 0), (0.5, 0), (0.25, 0), (1.0, 1), (1.0, 2))


class StretchCandidates(ConstructorBase):
    """The stretch-rule family (module docstring): ``choose_sizes``, ``levels``, ``build``."""

    # ------------------------------------------------------------------------------ step 1
    def choose_sizes(self, stretch: float, boost: int = 0) -> np.ndarray:
        """Index into ``sizes`` of each sequence's CP size.

        Cheapest rank-seconds first; then a sequence longer than ``stretch`` x the ideal step
        (total work / W) moves to the next size while that runs it faster alone (exact cost,
        ring constants included); ``boost`` doubles the CP size of every long sequence that
        many times.
        """
        n = len(self.lengths)
        cols = np.arange(n)
        rank_seconds = self.seconds * self.sizes[:, None]
        k = np.argmin(rank_seconds, axis=0)
        limit = stretch * rank_seconds[k, cols].sum() / self.topology.world
        top = len(self.sizes) - 1
        for _ in range(top):
            nxt = np.minimum(k + 1, top)
            grow = (self.seconds[k, cols] > limit) & (self.alone[nxt, cols] < self.alone[k, cols])
            if not grow.any():
                break
            k = np.where(grow, nxt, k)
        if boost:
            long = self.sizes[k] > 1
            k = np.where(long, np.minimum(k + boost, top), k)
        return k

    # ------------------------------------------------------------------------------ step 2
    def long_groups(self, k: np.ndarray, level: float) -> list[tuple[int, list[int], float]]:
        """(size, sequence ids, seconds) of groups of long sequences filled up to ``level``."""
        groups: list[tuple[int, list[int], float]] = []
        cols = np.arange(len(k))
        t = self.seconds[k, cols]
        for kk in sorted(set(k[self.sizes[k] > 1].tolist()), reverse=True):
            ids = sorted(np.flatnonzero(k == kk).tolist(), key=lambda i: (-t[i], i))
            bins: list[list[int]] = []
            loads: list[float] = []
            for i in ids:
                for b, load in enumerate(loads):
                    if load + t[i] <= level:
                        bins[b].append(i)
                        loads[b] += t[i]
                        break
                else:
                    bins.append([i])
                    loads.append(t[i])
            groups += [(int(self.sizes[kk]), b, load) for b, load in zip(bins, loads)]
        return groups

    def _waves_needed(self, groups: list[tuple[int, list[int], float]]) -> int:
        ranks = sum(size for size, _, _ in groups)
        return -(-ranks // self.topology.world)

    def levels(self, k: np.ndarray) -> list[float]:
        """Group levels worth trying: the longest sequence, and the least that needs one wave."""
        cols = np.arange(len(k))
        long = self.sizes[k] > 1
        if not long.any():
            return [0.0]
        t = self.seconds[k, cols][long]
        lo, hi = float(t.max()), float(t.sum())
        out = [lo]
        one_wave = self._waves_needed(self.long_groups(k, hi)) == 1
        if one_wave and self._waves_needed(self.long_groups(k, lo)) > 1:
            for _ in range(30):
                mid = 0.5 * (lo + hi)
                if self._waves_needed(self.long_groups(k, mid)) == 1:
                    hi = mid
                else:
                    lo = mid
            out.append(hi)
        return out

    # ------------------------------------------------------------------------------ steps 3-4
    def build(self, k: np.ndarray, level: float) -> StepPlan:
        topo = self.topology
        world = topo.world
        cols = np.arange(len(k))
        t = self.seconds[k, cols]
        groups = self.long_groups(k, level) if level > 0 else []
        # Lay groups into waves: first fit by decreasing size (power-of-two sizes pack exactly).
        wave_groups: list[list[tuple[int, list[int], float]]] = []
        wave_used: list[int] = []
        for g in sorted(groups, key=lambda g: (-g[0], -g[2], g[1][0])):
            for w, used in enumerate(wave_used):
                if used + g[0] <= world:
                    wave_groups[w].append(g)
                    wave_used[w] += g[0]
                    break
            else:
                wave_groups.append([g])
                wave_used.append(g[0])
        # Sand: spare time under each long wave's level, on its free ranks (at CP 1) and in its
        # long groups (at their CP size: dearer, but those ranks would idle), most room first;
        # what does not fit goes to a final wave of single ranks.
        bins: list[tuple[float, int, int]] = []  # (-room, wave, slot)
        bin_size: list[list[int]] = []
        bin_items: list[list[list[int]]] = []
        for w, gs in enumerate(wave_groups):
            lvl = max(g[2] for g in gs)
            sizes = [g[0] for g in gs] + [1] * (world - wave_used[w])
            rooms = [lvl - g[2] for g in gs] + [lvl] * (world - wave_used[w])
            bin_size.append(sizes)
            bin_items.append([[] for _ in sizes])
            bins += [(-room, w, b) for b, room in enumerate(rooms) if room > 0]
        heapq.heapify(bins)
        sand = np.flatnonzero(self.sizes[k] == 1).tolist()
        sand.sort(key=lambda i: (-t[i], i))
        rest: list[int] = []
        for i in sand:
            placed = False
            if bins:
                room, w, b = bins[0]
                cost = self.seconds[self.costs.index(bin_size[w][b]), i]
                if cost <= -room:
                    heapq.heapreplace(bins, (room + cost, w, b))
                    bin_items[w][b].append(i)
                    placed = True
            if not placed:
                rest.append(i)
        specs = [
            [(size, ids + bin_items[w][b]) for b, (size, ids, _) in enumerate(gs)]
            + [(1, ids) for ids in bin_items[w][len(gs) :] if ids]
            for w, gs in enumerate(wave_groups)
        ]
        if rest:
            owner = lpt([t[i] for i in rest], world)
            per_rank: list[list[int]] = [[] for _ in range(world)]
            for j, i in enumerate(rest):
                per_rank[owner[j]].append(i)
            specs.append([(1, ids) for ids in per_rank if ids])
        return self.assemble(specs)
