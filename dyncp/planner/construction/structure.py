"""Structure search: starts and single moves over one batch's structures, priced by the fluid model.

Where a plan loses time is its structure -- how many waves, which groups each wave has, and which
group and size each long sequence gets -- not where each short sequence goes
(notes/planner-findings.md). So the search works on structures only, each priced in
microseconds by the fluid model (``fluid``: long sequences in groups, short ones divisible work).

Starts: size choices laid into waves one group per sequence (``start``), and column packings
(``columns``): at a target level, each long sequence at its cheapest size that finishes within
the level, longest first, stacked on the existing group that it fills best (within a waste
tolerance of rank-seconds) or given a group of its own, in the first wave with room. Without
stacking, a batch of many long sequences needs one wave per W ranks of groups, each as long as
its slowest group; stacked, they share one balanced wave.

``improve`` then applies the best of each long sequence's moves while the fluid cost falls: its
group one size up or down, onto another group (stacking), or into a group of its own in any wave
or a new one (at its size, or in another wave at its cheapest size within that wave's floor).
Moves are priced from per-wave aggregates (a move touches at most two waves), so a move costs
microseconds. ``misfits`` names the short sequences a structure has no room for (longer alone
than any wave they could go to); the caller searches again with them placed as long ones.
Deterministic: no randomness, ties by index.
"""

from __future__ import annotations

import time

import numpy as np

from dyncp.planner.construction.fluid import FluidModel, Structure, _canonical
from dyncp.planner.construction.structure_moves import _State

__all__ = ["StructureSearch"]


class StructureSearch(FluidModel):
    """Fluid-priced search over structures of one batch (module docstring)."""

    # ------------------------------------------------------------------------------ starts
    def start(self, rows: np.ndarray) -> Structure:
        """Long sequences at the given rows, each its own group, first fit by decreasing size."""
        size, alone = self.sizes, self.alone
        ids = sorted(self.long.tolist(), key=lambda i: (-size[rows[i]], -alone[rows[i], i], i))
        used: list[int] = []
        wave = []
        for i in ids:
            c = int(self.sizes[rows[i]])
            w = next((w for w, u in enumerate(used) if u + c <= self.world), None)
            if w is None:
                used.append(0)
                w = len(used) - 1
            used[w] += c
            wave.append(w)
        return _canonical(ids, wave, [int(rows[i]) for i in ids], list(range(len(ids))))

    def columns(self, level: float, tolerance: float) -> Structure:
        """Long sequences stacked into groups (columns of ranks) up to ``level`` seconds.

        Each takes the cheapest size (rank-seconds) whose time alone is within ``level``, or its
        fastest. Longest first (by size, then time), it joins the existing group (any wave) that
        it leaves with the least room below ``level``, among those where it costs at most
        ``1 + tolerance`` times its rank-seconds at its own size; else it opens a group of its
        size in the first wave with room; else (no room anywhere) it joins the group it fits
        best whatever the cost, or, if it fits none, opens a new wave.
        """
        long = self.long
        alone = self.alone[:, long]
        fits = alone <= level
        cost = np.where(fits, self._spent[:, long], np.inf)
        pick = np.where(fits.any(axis=0), cost.argmin(axis=0), alone.argmin(axis=0)).tolist()
        rows = dict(zip(long.tolist(), pick))
        times, spent = self._times, self._spent_list
        order = sorted(rows, key=lambda i: (-self._size[rows[i]], -times[i][rows[i]], i))
        g_wave: list[int] = []
        g_row: list[int] = []
        g_load: list[float] = []
        used: list[int] = []
        group_of: dict[int, int] = {}
        limit = 1 + tolerance
        for i in order:
            k = rows[i]
            c = self._size[k]
            t, rank_seconds = times[i], spent[i]
            affordable = limit * rank_seconds[k]
            cheap_room, cheap = float("inf"), -1
            fit_room, fit = float("inf"), -1
            for g, (kg, load) in enumerate(zip(g_row, g_load)):
                room = level - load - t[kg]
                if room < 0:  # also when t is inf
                    continue
                if room < fit_room:
                    fit_room, fit = room, g
                if rank_seconds[kg] <= affordable and room < cheap_room:
                    cheap_room, cheap = room, g
            w = next((w for w, u in enumerate(used) if u + c <= self.world), None)
            g = cheap if cheap >= 0 else (fit if w is None else -1)
            if g >= 0:
                g_load[g] += t[g_row[g]]
                group_of[i] = g
                continue
            if w is None:
                used.append(0)
                w = len(used) - 1
            used[w] += c
            group_of[i] = len(g_row)
            g_wave.append(w)
            g_row.append(k)
            g_load.append(t[k])
        ids = sorted(group_of)
        return _canonical(
            ids,
            [g_wave[group_of[i]] for i in ids],
            [g_row[group_of[i]] for i in ids],
            [group_of[i] for i in ids],
        )

    def misfits(self, s: Structure) -> np.ndarray:
        """Short sequences that fit nowhere in ``s`` as the fluid model pours: longer alone at
        CP 1 than every wave with a free rank (the wave of singles included), and left over
        when such sequences, longest first, take their share of the room the groups leave
        below their wave's level (at the group's size, tightest fit). Pouring treats short
        work as divisible; these would raise a wave instead, so the caller places them as long
        ones and searches again."""
        if not len(self.short) or not s.ids:
            return np.zeros(0, dtype=np.int64)
        _, levels, extra = self.levels(s)
        if not levels:
            return np.zeros(0, dtype=np.int64)
        n_long = len(levels) - int(extra)
        used = np.zeros(n_long)
        groups = s.groups()
        for w, k, _ in groups:
            used[w] += self._size[k]
        reach = max(
            [levels[w] for w in range(n_long) if used[w] < self.world] + levels[n_long:],
            default=0.0,
        )
        fits = self.costs.seconds[0, self.short] <= reach
        # The rest must share the groups' room: longest first, each into the group it fills
        # most tightly, the room it takes gone for the next (one room, not one per sequence).
        rows = [k for _, k, _ in groups]
        room = [levels[w] - float(self.alone[k, ids].sum()) for w, k, ids in groups]
        order = np.flatnonzero(~fits)
        order = order[np.argsort(-self.costs.seconds[0, self.short[order]], kind="stable")]
        for q in order.tolist():
            i = int(self.short[q])
            best: tuple[float, int] | None = None
            for g, k in enumerate(rows):
                left = room[g] - float(self.costs.seconds[k, i])
                if left >= 0 and (best is None or left < best[0]):
                    best = (left, g)
            if best is not None:
                room[best[1]] = best[0]
                fits[q] = True
        return self.short[~fits]

    def extend(self, s: Structure, levels: list[float], ids: np.ndarray) -> Structure:
        """``s`` with the sequences ``ids`` (long in this search, not placed in ``s``) each in a
        group of its own: in the wave with room whose level (``levels``, of ``s``) it fits
        at the fewest rank-seconds, at the cheapest size that fits it there; else at its
        fastest size in the first wave with room, or a new one. Longest first."""
        groups = [(w, k, list(members)) for w, k, members in s.groups()]
        n_waves = max([w for w, _, _ in groups], default=-1) + 1
        used = [0] * n_waves
        for w, k, _ in groups:
            used[w] += self._size[k]
        level = list(levels[:n_waves]) + [0.0] * (n_waves - len(levels[:n_waves]))
        for i in sorted(ids.tolist(), key=lambda i: (-self.alone[0, i], i)):
            best: tuple[float, int, int] | None = None
            for w in range(n_waves):
                for k in range(len(self._size)):
                    t = self.alone[k, i]
                    if t <= level[w] and used[w] + self._size[k] <= self.world:
                        key = (float(self._spent[k, i]), w, k)
                        if best is None or key < best:
                            best = key
            if best is None:
                k = int(np.argmin(self.alone[:, i]))
                w = next((w for w in range(n_waves) if used[w] + self._size[k] <= self.world), None)
                if w is None:
                    used.append(0)
                    level.append(float(self.alone[k, i]))
                    w, n_waves = n_waves, n_waves + 1
            else:
                _, w, k = best
            used[w] += self._size[k]
            groups.append((w, k, [i]))
        flat = [(i, w, k, g) for g, (w, k, members) in enumerate(groups) for i in members]
        return _canonical(
            [f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat], [f[3] for f in flat]
        )

    # ------------------------------------------------------------------------------ search
    def improve(
        self,
        s: Structure,
        deadline: float | None,
        max_passes: int = 6,
        max_evaluations: int | None = None,
    ) -> Structure:
        """Best single move of each long sequence (size, stack, own group) while the cost falls.

        Bounded by ``deadline`` (wall clock) or, for deterministic planning, by
        ``max_evaluations`` structure prices (``IMPROVE_EVALUATIONS``): a count, not a clock, so
        the result is the same on any machine."""
        if not s.ids:
            return s
        state = _State(self, s)
        stop = None if max_evaluations is None else self.evaluations + max_evaluations
        for _ in range(max_passes):
            improved = False
            for i in state.by_time():
                if deadline is not None and time.perf_counter() >= deadline:
                    return state.structure()
                if stop is not None and self.evaluations >= stop:
                    return state.structure()
                if state.best_move(i):
                    improved = True
            if not improved:
                break
        return state.structure()
