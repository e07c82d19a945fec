"""Assignment: a plan seen as fixed group slots holding sequences, the form improvers edit.

Local search and CP-SAT keep the plan's layout -- its waves, and in each wave its groups (start,
size) plus one empty single-rank slot per idle rank -- and move sequences between slots. A
sequence may sit in any slot at least as large as its minimum CP size, so moving it also changes
its CP size and its wave. ``to_plan`` packs each slot's sequences into micro-batches again; the
layout stays aligned and disjoint because slots never change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dyncp.plan import Group, MicroBatch, StepPlan, Wave
from dyncp.planner.construction.packing import pack_ffd
from dyncp.planner.costs import SequenceCosts

__all__ = ["Assignment"]


@dataclass(slots=True)
class Assignment:
    """Slots (wave, start, size) and the sequences in each.

    Attributes:
        wave, start, size: per slot.
        row: per slot, its size's row in the cost tables.
        items: per slot, sequence ids.
        costs: the batch's cost tables.
    """

    wave: np.ndarray
    start: np.ndarray
    size: np.ndarray
    row: np.ndarray
    items: list[list[int]]
    costs: SequenceCosts

    @classmethod
    def from_plan(cls, plan: StepPlan, costs: SequenceCosts) -> Assignment:
        wave, start, size, items = [], [], [], []
        for w, wv in enumerate(plan.waves):
            busy = np.zeros(plan.topology.world, dtype=bool)
            for g in wv.groups:
                wave.append(w)
                start.append(g.start)
                size.append(g.size)
                items.append([i for mb in g.microbatches for i in mb.seq_ids])
                busy[g.start : g.start + g.size] = True
            if 1 in plan.topology.group_sizes:
                for r in np.flatnonzero(~busy).tolist():  # idle ranks: empty single slots
                    wave.append(w)
                    start.append(r)
                    size.append(1)
                    items.append([])
        size_arr = np.asarray(size, dtype=np.int64)
        row = np.asarray([costs.index(int(s)) for s in size], dtype=np.int64)
        return cls(
            np.asarray(wave, dtype=np.int64),
            np.asarray(start, dtype=np.int64),
            size_arr,
            row,
            items,
            costs,
        )

    @property
    def n_waves(self) -> int:
        return int(self.wave.max()) + 1 if len(self.wave) else 0

    def loads(self) -> np.ndarray:
        """Additive load (seconds) of every slot."""
        t = self.costs.seconds
        return np.asarray(
            [float(t[r, ids].sum()) if ids else 0.0 for r, ids in zip(self.row, self.items)]
        )

    def objective(self, loads: np.ndarray | None = None) -> float:
        """Sum over waves of the largest slot load (the additive step-time model)."""
        loads = self.loads() if loads is None else loads
        levels = np.zeros(self.n_waves)
        np.maximum.at(levels, self.wave, loads)
        return float(levels.sum())

    def to_plan(self, template: StepPlan) -> StepPlan:
        """A plan with this assignment, packed into micro-batches (first-fit decreasing)."""
        topo = template.topology
        lengths = self.costs.lengths
        waves = []
        for w in range(self.n_waves):
            groups = []
            for j in np.flatnonzero(self.wave == w).tolist():
                if self.items[j]:
                    size = int(self.size[j])
                    batches = pack_ffd(self.items[j], lengths, size, topo)
                    mbs = tuple(MicroBatch(tuple(mb)) for mb in batches)
                    groups.append(Group(int(self.start[j]), size, mbs))
            if groups:
                groups.sort(key=lambda g: g.start)
                waves.append(Wave(tuple(groups)))
        return StepPlan(
            topo,
            template.lengths,
            tuple(waves),
            policy=template.policy,
            sample_ids=template.sample_ids,
        )
