"""The structure search's fluid model: long sequences in groups and waves, short ones as fluid work.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.planner.costs import SequenceCosts

__all__ = ["FluidModel", "LONG_SHARE", "Structure"]

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


class FluidModel:
    """One batch's long and short sequences and the fluid price of a structure of them (module
    docstring); the structure search (``structure``) is built on it."""

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
