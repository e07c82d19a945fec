"""Megatron Core's ``dp_balanced`` sequence packing: the fixed-CP baseline as Megatron runs it.

Behaviour follows ``DpBalancedScheduler.get_groups_and_subsamples`` in Megatron-LM's
megatron/core/datasets/data_schedule.py (dev branch, unchanged from June to August 2026); the code
is dyncp's own. With a fixed CP size c and ``dp = world / c`` data-parallel ranks:

1. the global batch is packed **in arrival order** (no sorting): a pack takes sequences until the
   next one would push it past ``c x capacity`` tokens (``--max-seqlen-per-dp-cp-rank`` times the
   CP size) or past ``max_sequences`` sequences (Megatron's optional THD cap), then a new pack opens
   (next fit);
2. the number of packs is made a multiple of dp: the last sequence of the latest pack holding more
   than one is moved into a pack of its own, until the count divides;
3. pack ``i * dp + d`` becomes micro-batch ``i`` of data-parallel rank ``d``: every DP rank runs
   the same number of micro-batches (packs / dp), round robin, with no balancing of their work.

Each DP rank is one CP group of c consecutive ranks running its micro-batches one after another;
the step ends when the slowest group is done (a single wave: the layout never changes).
Differences from Megatron, forced by dyncp's plan contract: the pack limit counts each sequence's
zigzag padding (a multiple of 2c), where Megatron counts raw tokens and pads afterwards; and a
batch with too few sequences to give every DP rank the same number of packs (where Megatron stops
with "Not enough samples to move") leaves the last round's remaining DP ranks idle.

``max_sequences=1`` gives one sequence per micro-batch: a fixed number of micro-batches per DP rank
equal to its share of the samples, each paying the full ring and per-micro-batch costs.
"""

from __future__ import annotations

import numpy as np

from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave, padded_length

__all__ = ["dp_balanced_packs", "dp_balanced_plan"]


def dp_balanced_packs(
    lengths: np.ndarray, *, cp: int, dp: int, capacity: int, max_sequences: int | None = None
) -> list[list[int]]:
    """Sequence ids per pack, in Megatron's order (pack ``i * dp + d`` is DP rank d's i-th).

    When the batch holds too few sequences to give every DP rank the same number of packs
    (Megatron stops with an error there), the count is left short of a multiple of dp.

    Raises:
        ValueError: a sequence does not fit a pack.
    """
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1 or None, got {max_sequences}")
    limit = cp * capacity
    padded = [padded_length(int(s), cp) for s in lengths]
    too_long = [i for i, p in enumerate(padded) if p > limit]
    if too_long:
        raise ValueError(
            f"sequence {too_long[0]} ({int(lengths[too_long[0]])} tokens) exceeds a CP-{cp} "
            f"pack of {limit} tokens (capacity {capacity} x {cp}); raise the CP size"
        )
    packs: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, p in enumerate(padded):
        if current and (
            tokens + p > limit or (max_sequences is not None and len(current) >= max_sequences)
        ):
            packs.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += p
    if current:
        packs.append(current)
    missing = -len(packs) % dp
    source = len(packs) - 1
    while missing:
        while source >= 0 and len(packs[source]) == 1:
            source -= 1
        if source < 0:  # every pack holds one sequence: Megatron stops here, see the docstring
            break
        packs.append([packs[source].pop()])
        missing -= 1
    return packs


def dp_balanced_plan(
    lengths: np.ndarray, topology: Topology, cp: int, *, max_sequences: int | None = None
) -> StepPlan:
    """One wave of world/cp groups of size ``cp``, each running its round-robin packs in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp not in topology.group_sizes:
        raise ValueError(f"CP size {cp} is not allowed; allowed: {topology.group_sizes}")
    starts = topology.placements(cp)
    dp = len(starts)
    packs = dp_balanced_packs(
        lengths, cp=cp, dp=dp, capacity=topology.capacity, max_sequences=max_sequences
    )
    groups = tuple(
        Group(starts[d], cp, tuple(MicroBatch(tuple(p)) for p in packs[d::dp]))
        for d in range(min(dp, len(packs)))
    )
    return StepPlan(topology, tuple(int(s) for s in lengths), (Wave(groups),), policy="dp-balanced")
