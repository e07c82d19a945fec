"""One structure being improved by the structure search: groups and per-wave sums, edited in place.

``StructureSearch.improve`` (``structure``) tries each long sequence's moves -- its group a size
up or down, onto another group, into a group of its own in any wave or a new one -- and applies
the best while the fluid price falls; a move touches at most two waves, so it is priced from
per-wave sums in plain float arithmetic.
"""

from __future__ import annotations

from dyncp.planner.construction.fluid import FluidModel, Structure, _canonical

__all__: list[str] = []


class _State:
    """A structure being improved: groups and per-wave aggregates, edited in place.

    Wave aggregates: ``used`` ranks, ``rate`` (sum of c e_c over its groups), ``floor`` (largest
    group load) and ``weighted`` (sum of c e_c load), so a wave offers ``slope * floor -
    weighted`` seconds of short work up to its floor, ``slope = W - used + rate``. A move of one
    sequence changes at most two waves, so it is priced from these sums in plain float
    arithmetic (structures have tens of groups: numpy's per-call cost would dominate).
    """

    def __init__(self, search: FluidModel, s: Structure) -> None:
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
