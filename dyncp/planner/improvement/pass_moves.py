"""The moves that align one wave's passes: grow groups into idle ranks, split, merge, move packs.

A wave takes as many passes as its busiest group has micro-batches (``dyncp.plan.passes``); a
rank whose group has fewer, or that is in no group, runs empty passes there. ``WaveDraft`` is one
wave as mutable groups of micro-batches (lists of sequence ids), and its methods are the moves
that make every rank's count equal, in the order the design gives (DESIGN.md, "Big models"):

- ``grow``: a group takes over idle ranks by becoming a larger allowed group that covers only
  itself and idle ranks (its micro-batches then run at the larger CP size);
- ``open_idle``: new, still empty groups on idle blocks, for ``rebalance`` to fill;
- ``rebalance(k)``: every group to ``k`` micro-batches: a group above ``k`` merges two of its
  packs that fit together, or hands one to a group below ``k`` that can hold it; a group below
  ``k`` splits one of its packs in two (halves, or its cheapest sequence peeled off), or takes
  one sequence out of another group's pack of several (that group's count does not change);
- what is left over stays an empty pass (nothing else fits).

Every move keeps the plan valid by construction: a pack is placed only on a group where it fits
(``Topology.fits``: within capacity, hence each sequence within its minimum CP size), groups stay
on the topology's placements and disjoint, and sequences only move, never appear or vanish.
Which of the drafts is best is not decided here (``dyncp.planner.improvement.pass_align``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dyncp.plan import Group, MicroBatch, Topology, Wave

__all__ = ["DraftGroup", "WaveDraft"]

#: Seconds of one pack of sequence ids on a group of (size, heads).
Seconds = Callable[[int, int, tuple[int, ...]], float]
#: Each sequence's padded tokens in a group of a size (``dyncp.plan.padding``).
Memory = Callable[[int], list[int]]


@dataclass(slots=True)
class DraftGroup:
    """A group being aligned: its block, head split and packs (sequence ids)."""

    start: int
    size: int
    heads: int
    packs: list[list[int]] = field(default_factory=list)

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size)


class WaveDraft:
    """One wave's groups, changed by the moves of the module docstring."""

    def __init__(
        self,
        wave: Wave,
        topology: Topology,
        lengths: tuple[int, ...],
        seconds: Seconds,
        memory: Memory | None = None,
    ) -> None:
        """``memory`` (optional): padded tokens per size, cached by the caller, so that
        ``fits`` sums integers instead of padding every sequence again (the same rule)."""
        self.topology, self.lengths, self.seconds = topology, lengths, seconds
        self.memory = memory
        self.groups = [
            DraftGroup(g.start, g.size, g.heads, [list(mb.seq_ids) for mb in g.microbatches])
            for g in wave.groups
        ]

    def copy(self) -> WaveDraft:
        other = object.__new__(WaveDraft)
        other.topology, other.lengths, other.seconds = self.topology, self.lengths, self.seconds
        other.memory = self.memory
        # Packs are never changed in place (a move replaces a pack by a new list), so a copy
        # shares them: copying each pack made most of alignment's time at 512 ranks.
        other.groups = [DraftGroup(g.start, g.size, g.heads, list(g.packs)) for g in self.groups]
        return other

    # ------------------------------------------------------------------------------ facts
    def idle(self) -> set[int]:
        """Ranks in no group of the wave."""
        busy = {r for g in self.groups for r in g.ranks}
        return set(range(self.topology.world)) - busy

    def fits(self, ids: list[int], size: int) -> bool:
        """Whether ``ids`` fit a group of ``size`` (``Topology.fits``: padded tokens per rank
        within capacity)."""
        if self.memory is None:
            return self.topology.fits([self.lengths[i] for i in ids], size)
        padded = self.memory(size)
        return -(-sum(padded[i] for i in ids) // size) <= self.topology.capacity

    def pack_seconds(self, g: DraftGroup, ids: list[int]) -> float:
        return self.seconds(g.size, g.heads, tuple(ids))

    def passes(self) -> int:
        return max((len(g.packs) for g in self.groups), default=0)

    def empty(self) -> int:
        """Empty rank-passes of the wave (idle ranks count every pass)."""
        k = self.passes()
        return k * self.topology.world - sum(g.size * len(g.packs) for g in self.groups)

    def _heads_at(self, g: DraftGroup, size: int) -> int:
        return g.heads if g.heads in self.topology.splits(size) else 1

    # ------------------------------------------------------------------------------ moves
    def grow(self) -> None:
        """Grow groups into idle ranks, most packs first, one allowed size at a time."""
        topo = self.topology
        grown = True
        while grown:
            grown = False
            idle = self.idle()
            if not idle:
                return
            for g in sorted(self.groups, key=lambda g: (-len(g.packs), g.start)):
                for size in (c for c in topo.group_sizes if c > g.size):
                    block = self._block(g, size, idle)
                    if block is None or not all(self.fits(p, size) for p in g.packs):
                        continue
                    g.start, g.heads, g.size = block, self._heads_at(g, size), size
                    grown = True
                    break
                if grown:
                    break

    def _block(self, g: DraftGroup, size: int, idle: set[int]) -> int | None:
        """Start of an allowed block of ``size`` that holds ``g`` and otherwise idle ranks."""
        for start in self.topology.placements(size):
            if start <= g.start and g.start + g.size <= start + size:
                others = set(range(start, start + size)) - set(g.ranks)
                if others <= idle:
                    return start
        return None

    def open_idle(self) -> None:
        """New empty groups on the idle ranks, largest allowed blocks first."""
        topo = self.topology
        idle = self.idle()
        for size in reversed(topo.group_sizes):
            for start in topo.placements(size):
                block = set(range(start, start + size))
                if block <= idle:
                    self.groups.append(DraftGroup(start, size, 1, []))
                    idle -= block

    def drop_unused(self) -> None:
        self.groups = [g for g in self.groups if g.packs]

    def rebalance(self, k: int, *, peel: bool = False) -> bool:
        """Every group to ``k`` packs as far as the moves allow; False when a group stays above
        ``k`` (``k`` is then not reachable: the wave keeps more passes). ``peel``: a split takes
        the cheapest sequence off a pack instead of halving it (a pass the others barely use
        stays short)."""
        for g in sorted(self.groups, key=lambda g: -len(g.packs)):
            while len(g.packs) > k:
                if not (self._merge(g) or self._hand_off(g, k)):
                    return False
        for g in sorted(self.groups, key=lambda g: (len(g.packs), g.start)):
            while len(g.packs) < k:
                if not (self._split(g, peel) or self._take_one(g, peel)):
                    break
        return True

    def _merge(self, g: DraftGroup) -> bool:
        """Merge the two cheapest packs of ``g`` that fit together."""
        order = sorted(range(len(g.packs)), key=lambda j: self.pack_seconds(g, g.packs[j]))
        for x, i in enumerate(order):
            for j in order[x + 1 :]:
                if self.fits(g.packs[i] + g.packs[j], g.size):
                    g.packs[i] = g.packs[i] + g.packs[j]
                    del g.packs[j]
                    return True
        return False

    def _hand_off(self, g: DraftGroup, k: int) -> bool:
        """Move one of ``g``'s packs to the group below ``k`` with the least work that holds it."""
        takers = sorted(
            (h for h in self.groups if h is not g and len(h.packs) < k),
            key=lambda h: (sum(self.pack_seconds(h, p) for p in h.packs), h.start),
        )
        for pack in sorted(g.packs, key=lambda p: self.pack_seconds(g, p)):
            for h in takers:
                if self.fits(pack, h.size):
                    g.packs.remove(pack)
                    h.packs.append(pack)
                    return True
        return False

    def _split(self, g: DraftGroup, peel: bool = False) -> bool:
        """Split ``g``'s most expensive pack of several sequences into two balanced packs, or
        (``peel``) take the shortest sequence of its packs of several off as a pack of its own."""
        several = [p for p in g.packs if len(p) > 1]
        if not several:
            return False
        if peel:
            pack, i = min(((p, i) for p in several for i in p), key=lambda x: self.lengths[x[1]])
            g.packs[_index(g.packs, pack)] = [x for x in pack if x != i]
            g.packs.append([i])
            return True
        pack = max(several, key=lambda p: self.pack_seconds(g, p))
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0.0, 0.0]
        for i in sorted(pack, key=lambda i: (-self.lengths[i], i)):
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(i)
            loads[side] += self.pack_seconds(g, [i])
        g.packs.remove(pack)
        g.packs += [sorted(halves[0]), sorted(halves[1])]
        return True

    def _take_one(self, g: DraftGroup, peel: bool = False) -> bool:
        """A new pack on ``g`` of one sequence taken from another group's pack of several, from
        the busiest such pack, the longest sequence that fits on ``g`` (``peel``: the
        shortest)."""
        donors = [
            (self.pack_seconds(h, p), h.start, p, h)
            for h in self.groups
            if h is not g
            for p in h.packs
            if len(p) > 1
        ]
        for _, _, p, h in sorted(donors, key=lambda d: (-d[0], d[1])):
            sign = 1 if peel else -1
            for i in sorted(p, key=lambda i: (sign * self.lengths[i], i)):
                if self.fits([i], g.size):
                    h.packs[_index(h.packs, p)] = [x for x in p if x != i]
                    g.packs.append([i])
                    return True
        return False

    # ------------------------------------------------------------------------------ result
    def order_packs(self) -> None:
        """Each group's packs most expensive first, so the passes pair the long packs of every
        group (a sum of per-pass maxima is smallest when the lists are sorted alike)."""
        for g in self.groups:
            g.packs.sort(key=lambda p: (-self.pack_seconds(g, p), p))

    def to_wave(self) -> Wave:
        groups = sorted((g for g in self.groups if g.packs), key=lambda g: g.start)
        return Wave(
            tuple(
                Group(g.start, g.size, tuple(MicroBatch(tuple(p)) for p in g.packs), g.heads)
                for g in groups
            )
        )


def _index(packs: list[list[int]], pack: list[int]) -> int:
    """Position of the very list ``pack`` in ``packs`` (by identity: packs are shared between
    drafts and replaced, never changed in place)."""
    return next(j for j, p in enumerate(packs) if p is pack)
