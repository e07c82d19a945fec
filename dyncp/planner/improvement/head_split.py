"""Choosing each group's head split u x r = c: the envelope the search prices, the choice after.

A group of c ranks may exchange heads by all-to-all over u ranks and run a ring over the other
r = c / u (``dyncp.plan.Group.heads``). The structure search, the packing and the bounds all price
a micro-batch by its CP size alone, so the planner hands them :class:`SplitEnvelope`: a cost model
whose price at c is the cheapest allowed split's. Once the plan is built, :func:`choose_splits`
gives every group the split that makes its micro-batches fastest, priced exactly.

Why an envelope and not a search dimension: within a group the split changes how a micro-batch is
computed, not which ranks or tokens it uses (memory is the zigzag at c whatever u is), so choosing
it does not interact with the packing except through the price; the cheapest-split price is what
the packing should balance. A group running several micro-batches takes one u for all of them, so
its exact time can exceed the envelope's sum only when its micro-batches prefer different splits;
the plan's reported prediction is always the exact one.

The bounds stay valid: for every split u, ``seconds_u(c, S) >= fixed_u(c) + sum(b_u(c, S)) / c``
(the cost-model contract), so ``min_u seconds_u(c, S) >= min_u fixed_u(c) + sum(min_u b_u) / c``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from dyncp.cost_model.protocol import CostModelProtocol
from dyncp.plan import StepPlan, Topology, Wave

__all__ = ["SplitEnvelope", "choose_splits", "layout_histogram"]


class SplitEnvelope:
    """A cost model whose price at CP size c is the cheapest of the topology's head splits of c.

    Args:
        model: a cost model that prices a split with the keyword ``heads`` (``CostModel`` does).
        topology: the allowed head sizes (``Topology.splits``).
    """

    def __init__(self, model: CostModelProtocol, topology: Topology) -> None:
        self.model = model
        self.topology = topology
        self.ranks_per_node = model.ranks_per_node
        self.microbatch_overhead = model.microbatch_overhead
        self.wave_overhead = model.wave_overhead

    @property
    def name(self) -> str:
        return f"{self.model.name} (best head split)"

    def _min(self, method: str, cp: int, *args: object) -> np.ndarray:
        call = getattr(self.model, method)
        values = [np.asarray(call(cp, *args)) if u == 1 else np.asarray(call(cp, *args, heads=u))
                  for u in self.topology.splits(cp)]  # fmt: skip
        return np.minimum.reduce(values) if len(values) > 1 else values[0]

    def microbatch_seconds(self, cp: int, lengths: Sequence[int] | np.ndarray) -> float:
        return float(self._min("microbatch_seconds", cp, lengths))

    def packs_seconds(self, cp: int, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return self._min("packs_seconds", cp, lengths, starts)

    def alone_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        return self._min("alone_seconds", cp, lengths)

    def marginal_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        return self._min("marginal_seconds", cp, lengths)

    def work_rank_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        return self._min("work_rank_seconds", cp, lengths)

    def fixed_seconds(self, cp: int) -> float:
        return float(self._min("fixed_seconds", cp))

    def bound_rank_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray:
        return self._min("bound_rank_seconds", cp, lengths)


def choose_splits(plan: StepPlan, model: CostModelProtocol) -> StepPlan:
    """``plan`` with every group on its fastest allowed head split (ties: the smaller u).

    Groups whose size allows only u = 1 keep it; nothing else of the plan changes. The step is
    never slower for it under either timing (``dyncp.cost_model.evaluate``): a group that ends
    no later delays no wave (barrier) and no later group of its ranks (dataflow).
    """
    topo = plan.topology
    if topo.head_sizes == (1,):
        return plan
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    waves = []
    for wave in plan.waves:
        groups = []
        for g in wave.groups:
            splits = topo.splits(g.size)
            if len(splits) > 1:
                packs = [lengths[list(mb.seq_ids)] for mb in g.microbatches]
                flat = np.concatenate(packs)
                starts = np.cumsum([0] + [len(p) for p in packs[:-1]])
                seconds = [
                    float(model.packs_seconds(g.size, flat, starts).sum())
                    if u == 1
                    else float(model.packs_seconds(g.size, flat, starts, heads=u).sum())
                    for u in splits
                ]
                g = replace(g, heads=splits[int(np.argmin(seconds))])
            groups.append(g)
        waves.append(Wave(tuple(groups)))
    return replace(plan, waves=tuple(waves), stats=dict(plan.stats))


def layout_histogram(plan: StepPlan) -> dict[str, int]:
    """Sequences per group layout (``ring8``, ``a2a8``, ``a2a2xring4``, ...) in the plan."""
    counts: dict[str, int] = {}
    for _, group, mb in plan.microbatches():
        counts[group.layout_name] = counts.get(group.layout_name, 0) + len(mb.seq_ids)
    return counts
