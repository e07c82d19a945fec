"""The baseline policies as candidates of the dyncp pipeline: dyncp is never slower than them.

dyncp's search is heuristic, so on some batches a simple rule wins (issue 24: on sparse batches,
about two documents per rank on 4-GPU nodes, Megatron's scheduler beat dyncp's plan in 19 of 30
steps). The baselines cost milliseconds at 64 ranks, so the pipeline builds them too and keeps
the fastest plan under the planner's model and timing: whatever the search finds, the plan handed
out is at most as slow as the best baseline's.

Candidates, cheapest first (measured build seconds at 4,096 ranks / 32,768 sequences, one core:
dp-balanced 0.01, static 0.35, batch-adaptive 0.9, megatron 1.5):

- ``dp-balanced`` and ``static``: the one CP size that holds ``max_length`` (the planner's
  longest admitted document; without one, the batch's longest sequence);
- ``batch-adaptive``: the fastest single CP size for this batch;
- ``megatron``: dyncp's model of Megatron-LM's dev-branch dynamic-CP greedy.

With a wall-clock deadline a baseline is built only when its estimated build time fits before
the deadline (the estimate: its last measured build time per sequence, or
``SECONDS_PER_SEQUENCE`` before the first); in deterministic mode every baseline is built, so the
result does not depend on the clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan, Topology
from dyncp.planner.baselines.dp_balanced import dp_balanced_plan
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.static import batch_adaptive_plan, fixed_cp_plan, static_cp_size
from dyncp.planner.batch import Batch

__all__ = ["BASELINES", "SECONDS_PER_SEQUENCE", "BaselineCandidates"]

#: The baselines built, cheapest first.
BASELINES = ("dp-balanced", "static", "batch-adaptive", "megatron")
#: Build seconds per sequence assumed before a baseline has been measured: the slowest one
#: (megatron: 1.48 s for 32,768 sequences on 4,096 ranks, this project's 2-core machine, loaded).
SECONDS_PER_SEQUENCE = 50e-6


class BaselineCandidates:
    """Builds the baseline plans of a batch within a deadline; remembers their build times.

    Args:
        topology: ranks and capacity of the plans.
        max_length: the longest admitted document (sets the static CP size), or None (then the
            batch's longest sequence sets it).
    """

    def __init__(self, topology: Topology, *, max_length: int | None = None) -> None:
        self.topology = topology
        self.max_length = max_length
        self.per_sequence: dict[str, float] = {}
        #: Baselines that could not plan a batch (e.g. ``megatron`` plans on powers of two, which
        #: may not hold a batch a menu of other sizes does), with the last reason.
        self.unfit: dict[str, str] = {}

    def _builders(self, batch: Batch, model: CostModel) -> dict[str, Callable[[], StepPlan]]:
        topo, lengths = self.topology, batch.lengths
        longest = self.max_length if self.max_length is not None else int(lengths.max())
        cp = static_cp_size(max(longest, int(lengths.max())), topo)
        return {
            "dp-balanced": lambda: dp_balanced_plan(lengths, topo, cp),
            "static": lambda: fixed_cp_plan(lengths, topo, model, cp),
            "batch-adaptive": lambda: batch_adaptive_plan(batch, topo, model),
            "megatron": lambda: megatron_plan(batch, topo),
        }

    def plans(
        self, lengths: Batch | np.ndarray, model: CostModel, *, deadline: float | None = None
    ) -> Iterator[tuple[str, StepPlan]]:
        """(name, plan) of each baseline built; with a ``deadline`` (``time.perf_counter()``
        seconds) only those expected to finish before it. A baseline that cannot plan the
        batch is no candidate (``unfit`` says why). ``lengths``: or their ``Batch`` (its facts
        are shared with the baselines)."""
        if len(lengths) == 0:
            return
        builders = self._builders(Batch.of(lengths, self.topology), model)
        n = len(lengths)
        for name in BASELINES:
            if deadline is not None:
                expected = n * self.per_sequence.get(name, SECONDS_PER_SEQUENCE)
                if time.perf_counter() + expected > deadline:
                    continue
            t0 = time.perf_counter()
            try:
                plan = builders[name]()
            except ValueError as exc:  # e.g. megatron's powers of two on a menu of divisors
                self.unfit[name] = str(exc)
                continue
            self.per_sequence[name] = (time.perf_counter() - t0) / n
            yield name, plan
