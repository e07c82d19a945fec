"""Structure search: waves, groups and CP sizes of the long sequences, short ones as fluid work.

Where a plan loses time is its structure -- how many waves, which groups each wave has, and which
group and size each long sequence gets -- not where each short sequence goes
(notes/planner-findings.md). So the search works on structures only and prices each with a fluid
model in microseconds:

- long sequences: those whose minimum CP size exceeds 1, or that alone at CP 1 take more than
  ``LONG_SHARE`` of the ideal step (total work / W: too coarse to pour as fluid). A structure puts
  each in a group of some size in some wave; a group may hold several long sequences, run one
  after the other (a group is a column of c ranks for the whole wave), so its load is the sum of
  their times alone at its size. The groups of a wave must fit in W ranks;
- short sequences are divisible work ``S`` (their additive seconds at CP 1 plus their token share
  of every pass's fixed cost, ``fixed_seconds``). Wave w's floor
  ``F_w`` is its most loaded group; at a level M >= F_w it offers ``cap_w(M) = f_w M + sum_g c_g
  e_c (M - load_g)``: its f_w free ranks, plus each group's idle time at the efficiency ``e_c``
  short work runs with on c ranks (CP-1 seconds per rank-second at c);
- the work first fills every wave up to its floor; what is left raises the wave that gains
  capacity fastest (its slope is constant above the floor), or opens a wave of W single ranks,
  whichever costs less. Predicted step = sum of levels + wave overheads + one pass
  (``pass_seconds``) for every wave with free ranks beyond the first and for the wave of
  singles: a rank that runs short work in k waves pays k passes however few tokens it holds.

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
from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.planner.costs import SequenceCosts

__all__ = ["Structure", "StructureSearch", "LONG_SHARE"]

# A CP-1 sequence taking more than this share of the ideal step alone is placed as a long one.
LONG_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Structure:
    """Long sequence ids, and for each its wave, its row in the cost tables and its group.

    ``group`` numbers the groups (sequences of one group share its wave and row); empty means
    every sequence has a group of its own.
    """

    ids: tuple[int, ...]
    wave: tuple[int, ...]
    row: tuple[int, ...]
    group: tuple[int, ...] = ()

    def groups(self) -> list[tuple[int, int, list[int]]]:
        """(wave, row, sequence ids) of every group, in order of first appearance."""
        group = self.group or tuple(range(len(self.ids)))
        out: dict[int, tuple[int, int, list[int]]] = {}
        for i, w, k, g in zip(self.ids, self.wave, self.row, group):
            out.setdefault(g, (w, k, []))[2].append(i)
        return list(out.values())


# A wave's contribution to the fluid price: (floor, slope, capacity up to its floor, whether it
# has free ranks).
_Terms = tuple[float, float, float, bool]


class StructureSearch:
    """Fluid-priced search over structures of one batch (module docstring)."""

    def __init__(
        self,
        costs: SequenceCosts,
        wave_overhead: float,
        pass_seconds: float = 0.0,
        long_share: float = LONG_SHARE,
        extra_long: np.ndarray | None = None,
    ) -> None:
        self.costs = costs
        self.world = costs.topology.world
        self.wave_overhead = wave_overhead
        # A new wave also costs every rank one more micro-batch's fixed cost (the tables charge
        # short sequences only their token share of it).
        self.pass_seconds = pass_seconds
        sizes = costs.sizes
        self.sizes = sizes
        n = len(costs.lengths)
        # Long: needs a ring, or alone at CP 1 takes a good share of the ideal step (too coarse
        # to be poured as fluid work).
        coarse = costs.alone[0] > long_share * costs.ideal_seconds() if sizes[0] == 1 else False
        self.long = np.flatnonzero((costs.min_cp > 1) | coarse)
        if extra_long is not None:  # placed explicitly too (``misfits``)
            self.long = np.union1d(self.long, np.asarray(extra_long, dtype=np.int64))
        short = np.ones(n, dtype=bool)
        short[self.long] = False
        self.short = np.flatnonzero(short)
        # Short work at size c costs its marginal seconds plus its token share of the fixed
        # cost of every pass at c (``fixed_seconds``: the per-micro-batch constant and the
        # per-step kernel and latency costs); the tables charge only the first.
        share = np.zeros((len(sizes), len(self.short)))
        model = costs.model
        for k, c in enumerate(sizes.tolist()):
            ok = costs.min_cp[self.short] <= c
            pad = CostModel.padded(c, costs.lengths[self.short[ok]]) / (c * costs.topology.capacity)
            share[k, ok] = pad * (model.fixed_seconds(c) - model.microbatch_overhead)
        fluid = costs.seconds[:, self.short] + share
        self.work = float(fluid[0].sum()) if sizes[0] == 1 else 0.0
        # Efficiency of short work on a group of c ranks: CP-1 seconds per rank-second there.
        self.eff = np.zeros(len(sizes))
        if len(self.short) and sizes[0] == 1:
            for k, c in enumerate(sizes.tolist()):
                dear = (fluid[k] * c).sum()
                self.eff[k] = self.work / dear if dear > 0 else 0.0
        self.alone = costs.alone
        self._size = [int(c) for c in sizes.tolist()]
        self._rate = [float(c * e) for c, e in zip(sizes.tolist(), self.eff.tolist())]
        self._spent = costs.seconds * sizes[:, None]  # rank-seconds per row
        self._times = {i: costs.alone[:, i].tolist() for i in self.long.tolist()}
        self._spent_list = {i: self._spent[:, i].tolist() for i in self.long.tolist()}
        self.evaluations = 0

    # ------------------------------------------------------------------------------ fluid
    def _terms(self, groups: list[tuple[int, float]]) -> _Terms | None:
        """A wave's terms from its groups' (row, load); None if they need more than W ranks."""
        used = 0
        rate = 0.0
        floor = 0.0
        weighted = 0.0
        for k, load in groups:
            used += self._size[k]
            rate += self._rate[k]
            weighted += self._rate[k] * load
            floor = load if load > floor else floor
        if used > self.world:
            return None
        slope = self.world - used + rate
        return floor, slope, slope * floor - weighted, used < self.world

    def _price(self, terms: list[_Terms]) -> tuple[float, list[float], bool]:
        """Step seconds, each wave's level and whether a wave of singles is added."""
        self.evaluations += 1
        if not terms:
            level = self.work / self.world
            return level + self.wave_overhead, [level], True
        levels = [t[0] for t in terms]
        rest = self.work - sum(t[2] for t in terms)
        extra = False
        if rest > 0:
            best = max(range(len(terms)), key=lambda w: (terms[w][1], -w))
            slope = terms[best][1]
            raise_cost = rest / slope if slope > 0 else float("inf")
            if raise_cost <= self.wave_overhead + self.pass_seconds + rest / self.world:
                levels[best] += raise_cost
            else:
                extra = True
                levels.append(rest / self.world)
        passes = max(sum(t[3] for t in terms) - 1, 0) + extra
        total = sum(levels) + len(levels) * self.wave_overhead + passes * self.pass_seconds
        return total, levels, extra

    def levels(self, s: Structure) -> tuple[float, list[float], bool]:
        """Fluid step seconds, the level of each wave, and whether a wave of singles is added."""
        if not s.ids:
            return self._price([])
        n_waves = max(s.wave) + 1
        per_wave: list[list[tuple[int, float]]] = [[] for _ in range(n_waves)]
        for w, k, ids in s.groups():
            per_wave[w].append((k, float(self.alone[k, ids].sum())))
        terms = [self._terms(gs) for gs in per_wave]
        if any(t is None for t in terms):
            self.evaluations += 1
            return float("inf"), [], False
        return self._price(terms)  # type: ignore[arg-type]

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
    def improve(self, s: Structure, deadline: float | None, max_passes: int = 6) -> Structure:
        """Best single move of each long sequence (size, stack, own group) while the cost falls."""
        if not s.ids:
            return s
        state = _State(self, s)
        for _ in range(max_passes):
            improved = False
            for i in state.by_time():
                if deadline is not None and time.perf_counter() >= deadline:
                    return state.structure()
                if state.best_move(i):
                    improved = True
            if not improved:
                break
        return state.structure()


class _State:
    """A structure being improved: groups and per-wave aggregates, edited in place.

    Wave aggregates: ``used`` ranks, ``rate`` (sum of c e_c over its groups), ``floor`` (largest
    group load) and ``weighted`` (sum of c e_c load), so a wave offers ``slope * floor -
    weighted`` seconds of short work up to its floor, ``slope = W - used + rate``. A move of one
    sequence changes at most two waves, so it is priced from these sums in plain float
    arithmetic (structures have tens of groups: numpy's per-call cost would dominate).
    """

    def __init__(self, search: StructureSearch, s: Structure) -> None:
        self.search = search
        self.size = search._size
        self.rate = search._rate
        self.top = len(self.size) - 1
        self.members: list[list[int]] = []
        self.g_wave: list[int] = []
        self.g_row: list[int] = []
        self.g_load: list[float] = []
        self.group_of: dict[int, int] = {}
        self.col: dict[int, list[float]] = {}  # per long sequence, its time alone per row
        self.spent = search._spent_list  # per long sequence, its rank-seconds per row
        for w, k, ids in s.groups():
            for i in ids:
                self.group_of[i] = len(self.members)
                self.col[i] = search.alone[:, i].tolist()
            self.members.append(list(ids))
            self.g_wave.append(w)
            self.g_row.append(k)
            self.g_load.append(sum(self.col[i][k] for i in ids))
        self.n_waves = max(self.g_wave) + 1
        self._aggregate()

    def _aggregate(self) -> None:
        n = self.n_waves
        self.used = [0] * n
        self.w_rate = [0.0] * n
        self.weighted = [0.0] * n
        self.floor = [0.0] * n
        self.in_wave: list[list[int]] = [[] for _ in range(n)]
        for g, load in enumerate(self.g_load):
            if not self.members[g]:
                continue
            w, k = self.g_wave[g], self.g_row[g]
            self.in_wave[w].append(g)
            self.used[w] += self.size[k]
            self.w_rate[w] += self.rate[k]
            self.weighted[w] += self.rate[k] * load
            self.floor[w] = max(self.floor[w], load)
        world = self.search.world
        live = [w for w in range(n) if self.in_wave[w]]
        slope = [world - self.used[w] + self.w_rate[w] for w in range(n)]
        self.cap = [
            slope[w] * self.floor[w] - self.weighted[w] if self.in_wave[w] else 0.0
            for w in range(n)
        ]
        self.floor_sum, self.cap_sum, self.n_live = sum(self.floor), sum(self.cap), len(live)
        self.n_free = sum(1 for w in live if self.used[w] < world)
        by_slope = sorted(live, key=lambda w: (-slope[w], w))
        self.top_wave = by_slope[0]
        self.first_slope = slope[by_slope[0]]
        self.second_slope = slope[by_slope[1]] if len(by_slope) > 1 else -1.0
        if any(self.used[w] > world for w in live):
            self.cost = float("inf")
            return
        self.cost = self._price(
            self.floor_sum, self.cap_sum, self.first_slope, self.n_live, self.n_free
        )

    def _price(self, floors: float, caps: float, slope: float, n_live: int, n_free: int) -> float:
        """``StructureSearch._price`` from the summed floors and capacities, the largest slope,
        the number of waves and of waves with free ranks."""
        search = self.search
        search.evaluations += 1
        rest = search.work - caps
        fixed = n_live * search.wave_overhead + max(n_free - 1, 0) * search.pass_seconds
        if rest <= 0:
            return floors + fixed
        raise_cost = rest / slope if slope > 0 else float("inf")
        new_wave = search.wave_overhead + search.pass_seconds + rest / search.world
        return floors + min(raise_cost, new_wave) + fixed

    # -- moves
    def by_time(self) -> list[int]:
        ids = sorted(self.group_of)
        return sorted(ids, key=lambda i: (-self.col[i][self.g_row[self.group_of[i]]], i))

    def best_move(self, i: int) -> bool:
        """Apply i's best improving move, if any; whether one was applied."""
        world = self.search.world
        size, rate = self.size, self.rate
        col = self.col[i]
        g = self.group_of[i]
        w, k = self.g_wave[g], self.g_row[g]
        t_i = col[k]
        solo = len(self.members[g]) == 1
        rest_floor = max((self.g_load[h] for h in self.in_wave[w] if h != g), default=0.0)
        # The waves once i has left g, plus an empty one (a new wave) at the end.
        n = self.n_waves
        used = [*self.used, 0]
        w_rate = [*self.w_rate, 0.0]
        weighted = [*self.weighted, 0.0]
        floor = [*self.floor, 0.0]
        live = [bool(gs) for gs in self.in_wave] + [False]
        weighted[w] -= rate[k] * t_i
        if solo:
            used[w] -= size[k]
            w_rate[w] -= rate[k]
            floor[w] = rest_floor
            live[w] = len(self.in_wave[w]) > 1
        else:
            floor[w] = max(rest_floor, self.g_load[g] - t_i)
        slope = [world - u + r for u, r in zip(used, w_rate)]
        cap = [sl * f - wt if lv else 0.0 for sl, f, wt, lv in zip(slope, floor, weighted, live)]
        f0, c0, n0 = sum(floor), sum(cap), sum(live)
        free = [lv and u < world for lv, u in zip(live, used)]
        m0 = sum(free)
        first, second, arg = -1.0, -1.0, -1  # largest live slopes (slopes are >= 0)
        for v in range(n + 1):
            if live[v]:
                if slope[v] > first:
                    first, second, arg = slope[v], first, v
                elif slope[v] > second:
                    second = slope[v]

        best_cost = self.cost - 1e-12
        best: tuple | None = None
        price = self._price
        for h in range(len(self.members)):  # onto another group
            if h == g or not self.members[h]:
                continue
            t = col[self.g_row[h]]
            if t == float("inf"):
                continue
            v = self.g_wave[h]
            fv = max(floor[v], self.g_load[h] + t)
            cv = slope[v] * fv - weighted[v] - rate[self.g_row[h]] * t
            cost = price(f0 - floor[v] + fv, c0 - cap[v] + cv, first, n0, m0)
            if cost < best_cost:
                best_cost, best = cost, ("stack", h)
        spent = self.spent[i]
        for v in range(n + 1):  # a group of its own, in any wave or a new one
            if not live[v] and v != w and v != n:
                continue
            if v == w:
                rows = (k - 1, k, k + 1)
            else:  # at its size, or at its cheapest size that fits under the wave's floor
                fit = [q for q in range(self.top + 1) if col[q] <= floor[v]]
                rows = (k, min(fit, key=lambda q: spent[q])) if fit else (k,)
            for kk in rows:
                if not 0 <= kk <= self.top or (v == w and solo and kk == k):
                    continue
                t = col[kk]
                if t == float("inf") or used[v] + size[kk] > world:
                    continue
                sv = slope[v] - size[kk] + rate[kk]
                fv = max(floor[v], t)
                cv = sv * fv - weighted[v] - rate[kk] * t
                top = max(second if v == arg else first, sv)
                m = m0 - free[v] + (used[v] + size[kk] < world)
                cost = price(f0 - floor[v] + fv, c0 - cap[v] + cv, top, n0 + (not live[v]), m)
                if cost < best_cost:
                    best_cost, best = cost, ("own", v, kk, t)
        for kk in (k - 1, k + 1):  # the whole group one size down or up (i stays in it)
            if not 0 <= kk <= self.top:
                continue
            load = sum(self.col[j][kk] for j in self.members[g])
            used_w = self.used[w] - size[k] + size[kk]
            if load == float("inf") or used_w > world:
                continue
            sv = world - used_w + self.w_rate[w] - rate[k] + rate[kk]
            fv = max(rest_floor, load)
            cv = sv * fv - self.weighted[w] + rate[k] * self.g_load[g] - rate[kk] * load
            top = max(self.second_slope if w == self.top_wave else self.first_slope, sv)
            floors = self.floor_sum - self.floor[w] + fv
            m = self.n_free - (self.used[w] < world) + (used_w < world)
            cost = price(floors, self.cap_sum - self.cap[w] + cv, top, self.n_live, m)
            if cost < best_cost:
                best_cost, best = cost, ("resize", kk, load)
        if best is None:
            return False
        self.predicted = best_cost
        self._apply(i, best)
        return True

    def _apply(self, i: int, move: tuple) -> None:
        g = self.group_of[i]
        if move[0] == "resize":
            self.g_row[g], self.g_load[g] = move[1], move[2]
        else:
            self.members[g].remove(i)
            self.g_load[g] = sum(self.col[j][self.g_row[g]] for j in self.members[g])
            if move[0] == "stack":
                h = move[1]
                self.members[h].append(i)
                self.g_load[h] += self.col[i][self.g_row[h]]
            else:
                _, v, kk, t = move
                h = len(self.members)
                self.members.append([i])
                self.g_wave.append(v)
                self.g_row.append(kk)
                self.g_load.append(t)
                self.n_waves = max(self.n_waves, v + 1)
            self.group_of[i] = h
        self._aggregate()

    def structure(self) -> Structure:
        ids = sorted(self.group_of)
        groups = [self.group_of[i] for i in ids]
        return _canonical(
            ids, [self.g_wave[g] for g in groups], [self.g_row[g] for g in groups], groups
        )


def _canonical(ids: list[int], wave: list[int], row: list[int], group: list[int]) -> Structure:
    """The structure with ids ascending, waves and groups numbered by first appearance."""
    order = sorted(range(len(ids)), key=lambda j: ids[j])
    wave_no: dict[int, int] = {}
    group_no: dict[int, int] = {}
    for j in order:
        wave_no.setdefault(wave[j], len(wave_no))
        group_no.setdefault(group[j], len(group_no))
    return Structure(
        tuple(int(ids[j]) for j in order),
        tuple(wave_no[wave[j]] for j in order),
        tuple(int(row[j]) for j in order),
        tuple(group_no[group[j]] for j in order),
    )
