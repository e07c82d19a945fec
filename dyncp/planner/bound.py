"""Lower bound on the step seconds of any valid plan, reported with every plan.

    LB = max(LB_work, LB_longest)

    LB_work    = sum_i min_{c >= m_i} cp-rank-seconds of s_i's linear+attention work / W
                 + (sum_i padded(s_i, m_i) / (W * capacity)) * microbatch overhead
                 + one wave overhead
    LB_longest = max_i min_{c >= m_i} seconds of s_i alone in a micro-batch at c + one wave overhead

Why it is valid:
- every micro-batch at CP c costs each of its c ranks at least its sequences' linear+attention
  work (communication and the per-step kernel cost only add), so the ranks' total busy time is at
  least the sum of each sequence's cheapest work; the busiest rank is at least the mean;
- each micro-batch holds at most c * capacity padded tokens on c ranks, so the ranks run at least
  sum(padded tokens) / capacity micro-batch slots in total, each paying the constant;
- a micro-batch's time never decreases when a sequence is added (each ring step costs
  max(compute, transfer), both non-decreasing), so the longest sequence's micro-batch takes at
  least that sequence's best time alone;
- every plan has at least one wave.

DESIGN.md's first draft charged ceil(tokens / (W * capacity)) whole waves; that is not a bound when
a group may run several micro-batches in one wave, so the fractional micro-batch form is used.
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology

__all__ = ["lower_bound", "min_cp_sizes"]


def min_cp_sizes(lengths: np.ndarray, topology: Topology) -> np.ndarray:
    """Smallest allowed CP size holding each sequence alone; ValueError naming any that none can."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(len(lengths), dtype=np.int64)
    for cp in reversed(topology.group_sizes):
        padded = CostModel.padded(cp, lengths)
        out[padded <= cp * topology.capacity] = cp
    if (out == 0).any():
        bad = np.flatnonzero(out == 0)[:10].tolist()
        raise ValueError(
            f"sequences {bad} (lengths {lengths[bad].tolist()}) exceed the longest sequence any "
            f"allowed group holds ({topology.max_length()} tokens: group sizes "
            f"{list(topology.group_sizes)}, capacity {topology.capacity}); truncate or skip them"
        )
    return out


def lower_bound(lengths: np.ndarray, topology: Topology, model: CostModel) -> float:
    """Seconds no valid plan of ``lengths`` on ``topology`` can beat under ``model``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return 0.0
    m = min_cp_sizes(lengths, topology)
    work = np.full(len(lengths), np.inf)
    alone = np.full(len(lengths), np.inf)
    tokens = np.zeros(len(lengths))
    for cp in topology.group_sizes:
        ok = m <= cp
        if not ok.any():
            continue
        work[ok] = np.minimum(work[ok], model.work_rank_seconds(cp, lengths[ok]))
        alone[ok] = np.minimum(alone[ok], model.alone_seconds(cp, lengths[ok]))
        tokens[m == cp] = CostModel.padded(cp, lengths[m == cp])
    w = topology.world
    lb_work = work.sum() / w + tokens.sum() / (w * topology.capacity) * model.microbatch_overhead
    return float(max(lb_work, alone.max()) + model.wave_overhead)
