"""Megatron Core's first dynamic-CP scheduler (June 2026): every sequence at its minimum CP size.

Megatron-LM's published dynamic-CP measurements (examples/dynamic_context_parallel, June 9, 2026)
ran the scheduler of commit 959a542a11 (``next_hdp_group`` with ``dcp_make_buckets_equal`` in
megatron/core/datasets/data_schedule_utils.py), which a later commit (d2e7ec5b88, June 27) replaced
with the packing-aware greedy that ``dyncp.planner.baselines.megatron`` models. This module
re-implements the earlier one as a baseline (dyncp's own code). Per wave (Megatron: one
micro-batch):

1. the remaining sequences, longest first, are cut into k consecutive buckets of about equal
   work (k = the number of distinct minimum CP sizes among them; work = len^2 / cp);
2. the head of the first bucket whose size has a group or enough free ranks is placed at its
   **minimum** CP size (next power of two of length / capacity): on free ranks as a new group
   while enough ranks are free, else into the least-loaded group of that size with room; the wave
   ends when neither is possible, or -- once a sequence smaller than the wave's first has been
   placed -- when every rank's load is within 5% of the largest;
3. ranks left idle are filled by doubling the first-made group of the smallest size, repeatedly.

Each group runs one packed micro-batch per wave; the sequences not placed start the next wave.
Differences from Megatron, forced by dyncp's plan contract: memory counts zigzag padding (a
multiple of 2c per sequence), and groups are laid out on aligned blocks (Megatron uses the
least-loaded free ranks; group sizes and work are the same).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from dyncp.plan import StepPlan, Topology, padded_length
from dyncp.planner.baselines.megatron import plan_wave_by_wave, powers_of_two

__all__ = ["megatron_min_cp_plan", "BALANCE_DELTA", "BUCKET_SLACK"]

BALANCE_DELTA = 0.05  # next_hdp_group(delta=0.05)
BUCKET_SLACK = 1.1  # dcp_make_buckets_equal: a bucket closes past 1.1 x the target work


def _buckets(order: list[int], lengths: np.ndarray, min_cp: np.ndarray) -> list[deque[int]]:
    """Consecutive runs of ``order`` (longest first) of about equal len^2 / cp work each."""
    work = [float(lengths[i]) ** 2 / int(min_cp[i]) for i in order]
    k = len({int(min_cp[i]) for i in order})
    target = sum(work) / k
    buckets: list[deque[int]] = []
    current: list[int] = []
    current_work = 0.0
    remaining_k = k
    for pos, (i, w) in enumerate(zip(order, work)):
        if current and (
            current_work + w > target * BUCKET_SLACK
            or len(order) - pos <= remaining_k - len(buckets)
        ):
            buckets.append(deque(current))
            current, current_work = [], 0.0
            remaining_k -= 1
        current.append(i)
        current_work += w
    if current:
        buckets.append(deque(current))
    return buckets


class _Group:
    __slots__ = ("size", "ids", "per_rank_tokens", "load")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ids: list[int] = []
        self.per_rank_tokens = 0.0
        self.load = 0.0


def _form_wave(
    order: list[int], lengths: np.ndarray, min_cp: np.ndarray, topology: Topology
) -> tuple[list[_Group], list[int]]:
    """One wave from ``order`` (longest first); returns its groups and the leftover ids."""
    world, capacity = topology.world, topology.capacity
    buckets = _buckets(order, lengths, min_cp)
    groups: list[_Group] = []
    free = world
    first_needed: int | None = None
    check_balance = False
    while buckets:
        chosen = None
        for b, bucket in enumerate(buckets):
            if not bucket:
                continue
            needed = int(min_cp[bucket[0]])
            if free >= needed or any(g.size == needed for g in groups):
                chosen = b
                break
        if chosen is None:
            break
        i = buckets[chosen][0]
        needed = int(min_cp[i])
        share = padded_length(int(lengths[i]), needed) / needed
        if free >= needed:  # a new group on free ranks always has the least load (none)
            group = _Group(needed)
            groups.append(group)
            free -= needed
        else:
            fits = [g for g in groups if g.size == needed and g.per_rank_tokens + share <= capacity]
            if not fits:
                break
            group = min(fits, key=lambda g: g.load)
        group.ids.append(i)
        group.per_rank_tokens += share
        group.load += float(lengths[i]) ** 2 / needed
        buckets[chosen].popleft()
        while buckets and not buckets[0]:
            buckets.pop(0)
        first_needed = needed if first_needed is None else first_needed
        check_balance = check_balance or needed < first_needed
        if check_balance and buckets:
            loads = [g.load for g in groups for _ in range(g.size)] + [0.0] * free
            if max(loads) - min(loads) <= BALANCE_DELTA * max(loads):
                break
    leftovers = [i for bucket in buckets for i in bucket]
    while free > 0:  # double the first-made group of the smallest size
        smallest = min(g.size for g in groups)
        group = next(g for g in groups if g.size == smallest)
        grown = min(2 * smallest, world)
        if grown not in topology.group_sizes or grown - smallest > free:
            break  # a world that is not a power of two: the rest stays idle this wave
        free -= grown - smallest
        group.size = grown
    return groups, leftovers


def megatron_min_cp_plan(lengths: np.ndarray, topology: Topology) -> StepPlan:
    """Plan a step the way Megatron Core's June 2026 dynamic-CP scheduler would."""
    plan = plan_wave_by_wave(lengths, powers_of_two(topology), _form_wave, "megatron-min-cp")
    plan.topology = topology
    return plan
