"""The quick construction: a plan in a few vectorised passes over the batch, for fallbacks at scale.

The greedy constructor's deterministic search (``greedy``: every candidate, their local
search) took 177 s for the 66,860 sequences of one step at 4,096 ranks, far beyond the step it
plans (``SEARCH_SECONDS_PER_SEQUENCE``). A rank that falls back plans its step itself, inside
the step, so the plan service's fallback needs a plan whose cost grows like the batch's size,
with small constants. This construction is that plan, a pure
function of the batch (no clock, ties broken by index):

1. CP sizes by the stretch rule (``StretchCandidates.choose_sizes(1.0)``: the size cheapest in
   rank-seconds, raised while the sequence alone outlasts the ideal step and a larger group is
   faster).
2. Long sequences (size > 1), largest size first: each size's sequences are balanced by LPT
   over as many groups as their seconds fill at the ideal step's level (at least one), and
   each group, heaviest first, is laid on the allowed block of its size whose ranks are free
   first (list scheduling, as ``dyncp.runtime.execute`` runs groups: a group starts when its
   last member is free). A group's wave is one past the latest wave on its ranks, so the
   groups of a wave are disjoint and each rank runs its groups in wave order.
3. Short sequences (size 1) on single ranks after their long groups, longest first, by LPT in
   rounds on the ranks' free times (``_lpt_rounds``: one sort per round, not one heap
   operation per sequence).
4. Micro-batches: each group's sequences first-fit by decreasing length within capacity
   (vectorised over the single ranks, one position at a time).

What it gives up against the search: the structure search's choice of waves and stacked long
groups, the re-layouts, the local search and the baselines; ``bench/fallback_bench.py``
measures the predicted step against the normal planner's.
"""

from __future__ import annotations

import numpy as np

from dyncp.plan import Group, MicroBatch, StepPlan, Wave
from dyncp.planner.construction.packing import lpt, pack_ffd
from dyncp.planner.construction.stretch import StretchCandidates

__all__ = ["SEARCH_SECONDS_PER_SEQUENCE", "QuickConstructor", "quick_chosen"]

#: Seconds per sequence the deterministic search takes (every candidate, then the local search)
#: at 4,096 ranks: 177 s for the 66,860 sequences of 2 x 4,096 x 8,192 Wikipedia tokens
#: (``bench/control_plane_bench.py --offline --policy dyncp --fallback``, issue 39). Per sequence
#: it grows with the world (``bench/fallback_bench.py --search 64,512,4096``, one run on a loaded
#: machine: 2.3, 6.1 and 9.9 ms), so the rate at the largest world measured makes ``"auto"``
#: search only batches whose search fits the limit at every world up to it.
SEARCH_SECONDS_PER_SEQUENCE = 2.65e-3


def quick_chosen(construction: str, sequences: int, limit: float) -> bool:
    """Whether a planner with ``construction`` (``PlannerConfig.construction``) builds a batch
    of ``sequences`` quickly within ``limit`` seconds (a pure function of its arguments)."""
    if construction == "auto":
        return sequences * SEARCH_SECONDS_PER_SEQUENCE > limit
    return construction == "quick"


class QuickConstructor(StretchCandidates):
    """The quick construction of one batch (module docstring): ``best()`` returns its plan."""

    def best(self, deadline: float | None = None) -> StepPlan:
        """The plan (``deadline`` is ignored: the construction has no anytime part)."""
        topo = self.topology
        n = len(self.lengths)
        if n == 0:
            return StepPlan(topo, (), (), policy="dyncp")
        k = self.choose_sizes(1.0, 0)
        t = self.seconds[k, np.arange(n)]
        free = np.zeros(topo.world)
        depth = np.zeros(topo.world, dtype=np.int64)
        waves: list[list[Group]] = []
        level = self.ideal_seconds()
        single = int(self.sizes[0]) == 1
        for kk in range(len(self.sizes) - 1, 0 if single else -1, -1):
            ids = np.flatnonzero(k == kk)
            if len(ids):
                self._lay_long(int(self.sizes[kk]), ids, t, level, free, depth, waves)
        if single:
            short = np.flatnonzero(k == 0)
            if len(short):
                self._lay_short(short, t[short], free, depth, waves)
        lengths = tuple(self.lengths.tolist())
        return StepPlan(
            topo,
            lengths,
            tuple(Wave(tuple(sorted(gs, key=lambda g: g.start))) for gs in waves),
            policy="dyncp",
        )

    def _lay_long(
        self,
        size: int,
        ids: np.ndarray,
        t: np.ndarray,
        level: float,
        free: np.ndarray,
        depth: np.ndarray,
        waves: list[list[Group]],
    ) -> None:
        """Groups of ``size`` balanced by LPT, each on the block of its size free first."""
        seconds = t[ids]
        members, loads = _balanced(ids, seconds, level)
        count = len(members)
        starts = np.asarray(self.topology.placements(size), dtype=np.int64)
        block = starts[:, None] + np.arange(size)
        # The blocks of one size tile their ranks, so placing a group changes only its own
        # block's free time and depth among them: both are kept per block.
        begin = free[block].max(axis=1)
        level_of = depth[block].max(axis=1)
        assert len(np.unique(block)) == block.size, "blocks of one size overlap"
        overhead = self.model.wave_overhead
        lengths = self.lengths
        for g in sorted(range(count), key=lambda g: (-loads[g], g)):
            b = int(np.argmin(begin))
            w = int(level_of[b])
            batches = pack_ffd(members[g], lengths, size, self.topology)
            group = Group(int(starts[b]), size, tuple(MicroBatch(tuple(m)) for m in batches))
            _wave(waves, w).append(group)
            begin[b] += overhead + loads[g]
            level_of[b] = w + 1
            free[block[b]] = begin[b]
            depth[block[b]] = w + 1

    def _lay_short(
        self,
        ids: np.ndarray,
        seconds: np.ndarray,
        free: np.ndarray,
        depth: np.ndarray,
        waves: list[list[Group]],
    ) -> None:
        """Short sequences on single ranks after their long groups, by LPT in rounds."""
        order = np.lexsort((ids, -seconds))  # longest first, ties by id
        ids, seconds = ids[order], seconds[order]
        self._single_groups(ids, _lpt_rounds(free.copy(), seconds), depth, waves)

    def _single_groups(
        self, ids: np.ndarray, rank: np.ndarray, depth: np.ndarray, waves: list[list[Group]]
    ) -> None:
        """Each rank's short sequences as one group of size 1 in the wave after its last
        group, packed first-fit-decreasing into micro-batches of at most ``capacity``."""
        need = self.lengths[ids]  # no padding at size 1
        order = np.lexsort((ids, -need, rank))  # by rank, longest first, ties by id
        ids, rank, need = ids[order], rank[order], need[order]
        starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
        position = np.arange(len(ids)) - np.repeat(starts, np.diff(np.r_[starts, len(ids)]))
        bins = np.zeros(len(ids), dtype=np.int64)
        room = np.full((self.topology.world, 1), self.topology.capacity, dtype=np.int64)
        by_position = np.argsort(position, kind="stable")  # each position's items, by rank
        edges = np.searchsorted(position[by_position], np.arange(int(position.max()) + 2))
        for lo, hi in zip(edges[:-1], edges[1:]):
            at = by_position[lo:hi]
            r, want = rank[at], need[at]
            fits = room[r] >= want[:, None]
            found = fits.any(axis=1)
            if not found.all():  # a new bin on every rank (most stay full-room columns)
                room = np.hstack([room, np.full((len(room), 1), self.topology.capacity)])
                fits = room[r] >= want[:, None]
            b = np.argmax(fits, axis=1)
            room[r, b] -= want
            bins[at] = b
        order = np.lexsort((position, bins, rank))
        ids, rank, bins = ids[order], rank[order], bins[order]
        cut = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (bins[1:] != bins[:-1])])
        flat, ends = ids.tolist(), [*cut[1:].tolist(), len(ids)]
        pieces = [MicroBatch(tuple(flat[a:b])) for a, b in zip(cut.tolist(), ends)]
        owners = rank[cut]
        first = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]]).tolist()
        for lo, hi in zip(first, [*first[1:], len(pieces)]):
            r = int(owners[lo])
            _wave(waves, int(depth[r])).append(Group(r, 1, tuple(pieces[lo:hi])))
            depth[r] += 1


def _balanced(
    ids: np.ndarray, seconds: np.ndarray, level: float
) -> tuple[list[list[int]], np.ndarray]:
    """``ids`` in as few groups as LPT balances to at most ``level`` (or the longest one
    alone, when that is longer): the members and seconds of each group."""
    cap = max(level, float(seconds.max()))
    count = int(min(len(ids), max(1, np.ceil(seconds.sum() / cap))))
    costs = seconds.tolist()
    while True:
        owner = np.asarray(lpt(costs, count), dtype=np.int64)
        loads = np.bincount(owner, weights=seconds, minlength=count)
        if count == len(ids) or loads.max() <= cap * (1 + 1e-9):
            break
        count = min(len(ids), max(count + 1, int(np.ceil(count * loads.max() / cap))))
    members: list[list[int]] = [[] for _ in range(count)]
    for j, b in enumerate(owner.tolist()):
        members[b].append(int(ids[j]))
    return members, loads


def _wave(waves: list[list[Group]], w: int) -> list[Group]:
    """Wave ``w``'s groups (waves are opened in order: ``w`` is at most one past the last)."""
    if w == len(waves):
        waves.append([])
    return waves[w]


def _lpt_rounds(loads: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """The rank of each sequence (``seconds`` longest first) by LPT in rounds: LPT gives each
    sequence to the least loaded rank; a round gives the next m sequences, longest first, to
    the m least loaded ranks (ties by rank), where m counts the ranks within the round's
    longest sequence of the least load -- those LPT could pick before the least loaded rank
    passes them -- and at least one. One sort of the ranks per round instead of one heap
    operation per sequence; the sequences of a round differ less than the loads they even."""
    world = len(loads)
    rank = np.empty(len(seconds), dtype=np.int64)
    index = np.arange(world)
    lo = 0
    while lo < len(seconds):
        m = int(np.count_nonzero(loads <= loads.min() + seconds[lo]))
        part = seconds[lo : lo + m]
        least = np.lexsort((index, loads))[: len(part)]
        rank[lo : lo + len(part)] = least
        loads[least] += part
        lo += len(part)
    return rank
