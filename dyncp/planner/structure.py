"""Structure search: waves and CP sizes of the long sequences, with the short ones as fluid work.

Where a plan loses time is its structure -- how many waves, and which wave and group size each
long sequence gets -- not where each short sequence goes (notes/planner-findings.md). So the
search works on structures only and prices each with a fluid model in microseconds:

- long sequences: those whose minimum CP size exceeds 1, or that alone at CP 1 take more than
  ``LONG_SHARE`` of the ideal step (total work / W: too coarse to pour as fluid). A structure
  gives each a wave and a size; in its wave it holds a group of that size for its time alone
  (``alone``), and the groups of a wave must fit in W ranks;
- short sequences are divisible work ``S`` (their additive seconds at CP 1). Wave w's floor
  ``F_w`` is its slowest long group; at a level M >= F_w it offers ``cap_w(M) = f_w M + sum_i c_i
  e_c (M - alone_i)``: its f_w free ranks, plus each long group's idle time at the efficiency
  ``e_c`` short work runs with on c ranks (CP-1 seconds per rank-second at c);
- the work first fills every wave up to its floor; what is left raises the wave that gains
  capacity fastest (its slope is constant above the floor), or opens a wave of W single ranks,
  whichever costs less. Predicted step = sum of levels + wave overheads.

The search starts from several size choices (the constructor's: stretch rules, every long
sequence at its cheapest or its fastest size, or at its cheapest size under a floor), lays them
into waves first-fit by size, then improves by single moves -- a sequence to the next size up or
down, to another wave, or to a new wave -- while the fluid cost falls. A new wave also costs
every rank one more pass (``pass_seconds``). ``realise`` turns the best structures into plans: long
sequences in their groups, short ones poured up to the fluid levels (``fill``), then local search.
Deterministic: no randomness, ties by index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dyncp.planner.costs import SequenceCosts

__all__ = ["Structure", "StructureSearch", "LONG_SHARE"]

# A CP-1 sequence taking more than this share of the ideal step alone is placed as a long one.
LONG_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Structure:
    """Long sequence ids, and for each its wave and its row in the cost tables."""

    ids: tuple[int, ...]
    wave: tuple[int, ...]
    row: tuple[int, ...]


class StructureSearch:
    """Fluid-priced search over structures of one batch (module docstring)."""

    def __init__(
        self,
        costs: SequenceCosts,
        wave_overhead: float,
        pass_seconds: float = 0.0,
        long_share: float = LONG_SHARE,
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
        short = np.ones(n, dtype=bool)
        short[self.long] = False
        self.short = np.flatnonzero(short)
        self.work = float(costs.seconds[0, self.short].sum()) if sizes[0] == 1 else 0.0
        # Efficiency of short work on a group of c ranks: CP-1 seconds per rank-second there.
        self.eff = np.zeros(len(sizes))
        if len(self.short) and sizes[0] == 1:
            base = costs.seconds[0, self.short].sum()
            for k, c in enumerate(sizes.tolist()):
                dear = (costs.seconds[k, self.short] * c).sum()
                self.eff[k] = base / dear if dear > 0 else 0.0
        self.alone = costs.alone
        self.evaluations = 0

    # ------------------------------------------------------------------------------ fluid
    def levels(self, s: Structure) -> tuple[float, list[float], bool]:
        """Fluid step seconds, the level of each wave, and whether a wave of singles is added."""
        return self._levels(np.asarray(s.ids, np.int64), np.asarray(s.wave), np.asarray(s.row))

    def _levels(
        self, ids: np.ndarray, wave: np.ndarray, row: np.ndarray
    ) -> tuple[float, list[float], bool]:
        self.evaluations += 1
        world = self.world
        if len(ids) == 0:
            rest_level = self.work / world
            return rest_level + self.wave_overhead, [rest_level], True
        n_waves = int(wave.max()) + 1
        t = self.alone[row, ids]
        c = self.sizes[row]
        floor = np.zeros(n_waves)
        np.maximum.at(floor, wave, t)
        used = np.bincount(wave, weights=c, minlength=n_waves)
        if (used > world).any():
            return float("inf"), [], False
        c_eff = c * self.eff[row]
        free_cap = float(((world - used) * floor).sum() + (c_eff * (floor[wave] - t)).sum())
        slope = (world - used) + np.bincount(wave, weights=c_eff, minlength=n_waves)
        level = floor.tolist()
        rest = self.work - free_cap
        extra = False
        if rest > 0:
            best = int(np.argmax(slope))
            raise_cost = rest / slope[best] if slope[best] > 0 else float("inf")
            new_wave = self.wave_overhead + self.pass_seconds + rest / world
            if raise_cost <= new_wave:
                level[best] += raise_cost
            else:
                extra = True
                level.append(rest / world)
        total = sum(level) + len(level) * self.wave_overhead + extra * self.pass_seconds
        return total, level, extra

    # ------------------------------------------------------------------------------ search
    def start(self, rows: np.ndarray) -> Structure:
        """Long sequences at the given rows, laid into waves first fit by decreasing size."""
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
        return Structure(tuple(ids), tuple(wave), tuple(int(rows[i]) for i in ids))

    def improve(self, s: Structure, deadline: float | None, max_passes: int = 6) -> Structure:
        """Single moves (size up/down, another wave, a new wave) while the fluid cost falls."""
        ids = np.asarray(s.ids, dtype=np.int64)
        wave = np.asarray(s.wave, dtype=np.int64)
        row = np.asarray(s.row, dtype=np.int64)
        best, _, _ = self._levels(ids, wave, row)
        top = len(self.sizes) - 1
        for _ in range(max_passes):
            improved = False
            for j in np.argsort(-self.alone[row, ids], kind="stable").tolist():
                if deadline is not None and time.perf_counter() >= deadline:
                    return _structure(ids, wave, row)
                i = int(ids[j])
                options = []
                for dk in (-1, 1):
                    k = int(row[j]) + dk
                    if 0 <= k <= top and np.isfinite(self.alone[k, i]):
                        options.append((int(wave[j]), k))
                for w in range(int(wave.max()) + 2):
                    if w != wave[j]:
                        options.append((w, int(row[j])))
                for w, k in options:
                    cand_wave, cand_row = wave.copy(), row.copy()
                    cand_wave[j], cand_row[j] = w, k
                    cand_wave = np.unique(cand_wave, return_inverse=True)[1]
                    cost, _, _ = self._levels(ids, cand_wave, cand_row)
                    if cost < best - 1e-12:
                        best, wave, row, improved = cost, cand_wave, cand_row, True
                        break
            if not improved:
                break
        return _structure(ids, wave, row)


def _structure(ids: np.ndarray, wave: np.ndarray, row: np.ndarray) -> Structure:
    return Structure(tuple(ids.tolist()), tuple(wave.tolist()), tuple(row.tolist()))
