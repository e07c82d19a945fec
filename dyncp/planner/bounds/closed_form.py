"""Lower bound on the step seconds of any valid plan, reported with every plan.

    LB = max_i min_{c >= m_i} max( alone_i(c), mean_busy_i(c) ) + one wave overhead

    alone_i(c)     = seconds of s_i alone in a micro-batch at CP size c
    mean_busy_i(c) = ( sum_j cheapest_j - cheapest_i + work_i(c) ) / W
                     + (sum_j padded(s_j, m_j) / (W * capacity)) * microbatch overhead
    work_i(c)      = c-rank-seconds of s_i's linear + attention work at CP size c
    cheapest_i     = min_{c >= m_i} work_i(c)

This is at least DESIGN.md's max(total cheapest work / W + constants, longest sequence alone at its
fastest size), and tighter when the longest sequence is fast only on a group so large that its
rank-seconds raise the mean busy time.

Why it is valid:
- every micro-batch at CP c costs each of its c ranks at least its sequences' linear+attention
  work (communication and the per-step kernel cost only add), so the ranks' total busy time is at
  least the sum of each sequence's cheapest work; the busiest rank is at least the mean;
- each micro-batch holds at most c * capacity padded tokens on c ranks, so the ranks run at least
  sum(padded tokens) / capacity micro-batch slots in total, each paying the constant;
- a micro-batch's time never decreases when a sequence is added (each ring step costs
  max(compute, transfer), both non-decreasing), so the longest sequence's micro-batch takes at
  least that sequence's best time alone;
- every plan has at least one wave, and one wave overhead is paid before any of it ends;
- a plan runs each sequence at one CP size c, so both bounds hold for that c at once, hence the
  minimum over c of their maximum, for every sequence;
- the same holds for pairs of the longest-running sequences (``_pair_bound``): two groups whose
  sizes add up to more than W share a rank, so their micro-batches run one after the other;
- none of this assumes sizes that are powers of two or a particular placement: c ranges over the
  topology's menu, and groups of one wave hold disjoint ranks whatever the placement rules
  (``dyncp.plan.menu``), which only remove plans. So the bound holds for any menu.

Both timings of ``dyncp.cost_model.evaluate``: every part uses only that a rank's busy time
(its micro-batches) and any one micro-batch fit in the step minus one wave overhead, and that two
groups sharing a rank run one after the other. Barrier: S is the sum over waves of (slowest
group + o), a rank is busy at most the slowest group of each wave, and groups sharing a rank
are in different waves. Dataflow: each rank runs its groups one after another, each paying o
plus its micro-batches, so S >= o + any rank's busy time, and two groups on one rank take at
least 2 o + both. So the bound holds under both, with no ``timing`` argument.

DESIGN.md's first draft charged ceil(tokens / (W * capacity)) whole waves; that is not a bound when
a group may run several micro-batches in one wave, so the fractional micro-batch form is used.
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.batch import min_cp_sizes

__all__ = ["lower_bound"]

# How many of the longest-running sequences the pair bound looks at (pairs: n*(n-1)/2).
PAIR_CANDIDATES = 8


def lower_bound(lengths: np.ndarray, topology: Topology, model: CostModel) -> float:
    """Seconds no valid plan of ``lengths`` on ``topology`` can beat under ``model``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return 0.0
    m = min_cp_sizes(lengths, topology)
    sizes = topology.group_sizes
    work = np.full((len(sizes), len(lengths)), np.inf)
    alone = np.full((len(sizes), len(lengths)), np.inf)
    tokens = np.zeros(len(lengths))
    for k, cp in enumerate(sizes):
        ok = m <= cp
        if not ok.any():
            continue
        work[k, ok] = model.work_rank_seconds(cp, lengths[ok])
        alone[k, ok] = model.alone_seconds(cp, lengths[ok])
        tokens[m == cp] = CostModel.padded(cp, lengths[m == cp])
    w = topology.world
    cheapest = work.min(axis=0)
    constants = tokens.sum() / (w * topology.capacity) * model.microbatch_overhead
    # For each sequence and each CP size it could run at: the step is at least its time alone
    # there and at least the mean busy time with it there; the plan picks one size per sequence.
    mean_busy = (cheapest.sum() - cheapest[None, :] + work) / w + constants
    per_sequence = np.maximum(alone, mean_busy).min(axis=0)
    pairs = _pair_bound(lengths, topology, model, alone, work, cheapest, constants)
    return float(max(per_sequence.max(), pairs) + model.wave_overhead)


def _pair_bound(
    lengths: np.ndarray,
    topology: Topology,
    model: CostModel,
    alone: np.ndarray,
    work: np.ndarray,
    cheapest: np.ndarray,
    constants: float,
    top: int = PAIR_CANDIDATES,
) -> float:
    """The per-sequence bound for pairs of the longest-running sequences.

    Two sequences on groups of sizes a + b > W always share a rank, so they run one after the
    other: at least alone(a) + alone(b), or, at equal sizes, their shared micro-batch if it fits.
    Otherwise they may overlap: at least the longer alone. Either way the mean busy time with
    both at those sizes is a bound too; the plan picks one pair of sizes, hence the minimum.
    """
    n = len(lengths)
    if n < 2:
        return 0.0
    sizes = np.asarray(topology.group_sizes)
    w = topology.world
    base = cheapest.sum() / w + constants
    best_alone = alone.min(axis=0)
    order = np.argsort(-best_alone, kind="stable")[:top].tolist()
    out = 0.0
    for x, i in enumerate(order):
        for j in order[x + 1 :]:
            busy = base + ((work[:, i] - cheapest[i])[:, None] + (work[:, j] - cheapest[j])) / w
            serial = alone[:, i][:, None] + alone[:, j][None, :]
            for k, cp in enumerate(sizes.tolist()):
                pair = lengths[[i, j]]
                both = np.isfinite(alone[k, i]) and np.isfinite(alone[k, j])
                if both and CostModel.padded(cp, pair).sum() <= cp * topology.capacity:
                    serial[k, k] = min(serial[k, k], model.microbatch_seconds(cp, pair))
            overlap = np.maximum(alone[:, i][:, None], alone[:, j][None, :])
            apart = sizes[:, None] + sizes[None, :] > w
            value = np.maximum(np.where(apart, serial, overlap), busy)
            out = max(out, float(value.min()))
    return out
