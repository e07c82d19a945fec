"""Static CP (today's common practice) and its per-step variant, batch-adaptive CP.

static: one CP size for the whole run, the smallest that holds the longest admitted document
(``max_length``); sequences are packed first-fit-decreasing into micro-batches of that CP size and
the micro-batches are balanced (LPT on predicted seconds) over the W / cp data-parallel groups, all
in a single wave since the layout never changes.

batch-adaptive: the same construction at every allowed CP size that holds the step's longest
sequence; the fastest predicted plan wins.
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan, Topology, Wave
from dyncp.planner.batch import min_cp_sizes
from dyncp.planner.construction.packing import lpt, pack_ffd, place_groups

__all__ = ["fixed_cp_plan", "static_cp_size", "batch_adaptive_plan"]


def static_cp_size(max_length: int, topology: Topology) -> int:
    """Smallest allowed CP size that holds a document of ``max_length`` tokens."""
    cp = topology.min_cp(max_length)
    if cp is None:
        raise ValueError(
            f"max_length {max_length} exceeds what the largest group holds "
            f"({topology.max_length()} tokens at capacity {topology.capacity})"
        )
    return cp


def fixed_cp_plan(
    lengths: np.ndarray, topology: Topology, model: CostModel, cp: int, policy: str = "static"
) -> StepPlan:
    """One wave of groups of size ``cp`` on every block the topology allows (W/cp when cp divides
    the domain), FFD-packed micro-batches balanced by LPT."""
    lengths = np.asarray(lengths, dtype=np.int64)
    batches = pack_ffd(range(len(lengths)), lengths, cp, topology)
    costs = [model.microbatch_seconds(cp, lengths[mb]) for mb in batches]
    n_groups = len(topology.placements(cp))
    owner = lpt(costs, n_groups)
    per_group: list[list[list[int]]] = [[] for _ in range(n_groups)]
    for b in sorted(range(len(batches)), key=lambda b: (-costs[b], b)):
        per_group[owner[b]].append(batches[b])
    groups = place_groups([(cp, mbs) for mbs in per_group if mbs], topology)
    waves = (Wave(groups),) if groups else ()
    return StepPlan(topology, tuple(int(s) for s in lengths), waves, policy=policy)


def batch_adaptive_plan(
    lengths: np.ndarray, topology: Topology, model: CostModel, *, timing: str = "dataflow"
) -> StepPlan:
    """The fastest single-CP-size plan for this step, timed as ``timing``
    (``dyncp.cost_model.evaluate.TIMINGS``; one wave, so both timings agree up to rounding)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    need = int(min_cp_sizes(lengths, topology).max()) if len(lengths) else 1
    best: tuple[float, StepPlan] | None = None
    for cp in topology.group_sizes:
        if cp < need or (CostModel.padded(cp, lengths) > cp * topology.capacity).any():
            continue  # (with tiny capacities a larger group can hold less than a smaller one)
        plan = fixed_cp_plan(lengths, topology, model, cp, policy="batch-adaptive")
        seconds = evaluate_plan(plan, model, timing=timing).step_seconds
        if best is None or seconds < best[0]:
            best = (seconds, plan)
    assert best is not None
    return best[1]
