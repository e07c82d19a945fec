"""Per-sequence cost tables shared by the greedy constructor, local search and CP-SAT.

Computed once per batch (vectorised over sequences, one row per allowed CP size), so every later
stage prices a move with a table lookup instead of a cost-model call.
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.batch import min_cp_sizes

__all__ = ["SequenceCosts"]


class SequenceCosts:
    """Cost tables of one batch.

    Attributes:
        sizes: allowed CP sizes, ascending.
        min_cp: each sequence's minimum CP size.
        seconds: ``seconds[k, i]``, what sequence i adds to a micro-batch at ``sizes[k]`` (the
            cost model's marginal seconds plus its token share of the per-micro-batch constant);
            inf where the size cannot hold it. Additive, so a group's load is a sum.
        alone: ``alone[k, i]``, exact seconds of sequence i as its own micro-batch (ring
            constants included); the yardstick for "a larger group runs it faster".
    """

    def __init__(self, lengths: np.ndarray, topology: Topology, model: CostModel) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.topology = topology
        self.model = model
        self.sizes = np.asarray(topology.group_sizes, dtype=np.int64)
        n = len(self.lengths)
        self.min_cp = min_cp_sizes(self.lengths, topology) if n else np.zeros(0, np.int64)
        self.seconds = np.full((len(self.sizes), n), np.inf)
        self.alone = np.full((len(self.sizes), n), np.inf)
        for k, cp in enumerate(self.sizes.tolist()):
            ok = self.min_cp <= cp
            if not ok.any():
                continue
            s = self.lengths[ok]
            share = CostModel.padded(cp, s) / (cp * topology.capacity)
            self.seconds[k, ok] = model.marginal_seconds(cp, s) + share * model.microbatch_overhead
            self.alone[k, ok] = model.alone_seconds(cp, s)
        self._index = {c: k for k, c in enumerate(self.sizes.tolist())}

    def index(self, size: int) -> int:
        """Row of ``size`` in the tables."""
        return self._index[size]

    def ideal_seconds(self) -> float:
        """Perfect balance: each sequence's cheapest rank-seconds over W, or the longest alone."""
        if len(self.lengths) == 0:
            return 0.0
        rank_seconds = (self.seconds * self.sizes[:, None]).min(axis=0)
        return max(float(rank_seconds.sum()) / self.topology.world, float(self.alone.min(0).max()))
