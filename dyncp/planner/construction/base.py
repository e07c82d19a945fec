"""The state every candidate family of the greedy constructor shares: batch, cost tables, assembly.

``GreedyConstructor`` (``greedy``) is one object made of its candidate families (``stretch``,
``level``, ``structured``, the pouring engine ``pouring``), each a class in a module of its own;
they meet here, on the state they all read (the batch's lengths, topology, model and cost tables)
and on ``assemble``, which turns any family's groups into a ``StepPlan``.
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.evaluate import check_timing
from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan, Topology, Wave
from dyncp.planner.construction.packing import pack_ffd, place_waves
from dyncp.planner.costs import SequenceCosts

__all__ = ["ConstructorBase"]


class ConstructorBase:
    """One batch's state, shared by the constructor's candidate families.

    Args:
        lengths: sequence lengths of the step.
        topology: ranks and capacity.
        model: the cost model used both to choose and to price.
        timing: how candidates are timed and compared (``dyncp.cost_model.evaluate.TIMINGS``).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        topology: Topology,
        model: CostModel,
        *,
        timing: str = "dataflow",
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.topology = topology
        self.model = model
        self.timing = check_timing(timing)
        self.costs = SequenceCosts(self.lengths, topology, model)
        self.sizes = self.costs.sizes
        self.min_cp = self.costs.min_cp
        self.seconds = self.costs.seconds
        self.alone = self.costs.alone
        self.tried = 0
        self.moves = 0
        self.deadline: float | None = None

    def assemble(self, specs: list[list[tuple[int, list[int]]]]) -> StepPlan:
        """A StepPlan from per-wave (CP size, sequence ids) groups: FFD micro-batches on allowed
        blocks (a wave whose groups do not fit the blocks at once continues in the next wave)."""
        topo = self.topology
        lengths = self.lengths.tolist()  # plain ints: pack_ffd reads one per sequence
        waves = tuple(
            Wave(groups)
            for spec in specs
            if spec
            for groups in place_waves(
                [(c, pack_ffd(ids, lengths, c, topo)) for c, ids in spec], topo
            )
        )
        return StepPlan(topo, tuple(int(s) for s in self.lengths), waves, policy="dyncp")

    def ideal_seconds(self) -> float:
        return self.costs.ideal_seconds()
