"""Baselines under pipeline parallelism: Megatron dev's dynamic CP with PP, and static CP with PP.

``megatron-pp`` follows Megatron-LM's dev branch, whose dynamic-CP scheduler feeds the pipeline
schedule: every DCP micro-batch spans all DP x CP ranks (``megatron_plan``: one wave per DCP
micro-batch, each group one packed micro-batch -- already a slot), the micro-batches run in the
order they were formed (longest sequences first), and under interleaving their count is aligned
to the VPP micro-batch group size (``microbatch_group_size_per_vp_stage``, the stages by
default) by ``align_sample_id_groups``: from the last micro-batch backwards, one with at least two
CP groups is cut at the first group boundary at or past half the ranks; the groups past it stay
in its place, the groups before it become a new micro-batch at the end, and each half fills the
ranks it left empty by growing its CP groups (here: the smallest group doubles while the freed
ranks allow, as ``megatron``'s own wave filling does). A micro-batch of one group cannot be cut;
the walk wraps around until the count is reached. The code is dyncp's own.

``static-pp``: static CP (``fixed_cp_plan``: one CP size, FFD packs balanced over the DP groups)
read as slots (``dyncp.planner.pipeline.slots.to_slots``: the k-th pack of every group in slot
k), in the packs' order, the count aligned to the schedule's multiple by halving the most
expensive slot (``split_to``).
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Group, Pipeline, StepPlan, Topology, Wave, padded_length
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.static import fixed_cp_plan
from dyncp.planner.batch import Batch
from dyncp.planner.construction.packing import place_waves
from dyncp.planner.pipeline.slots import split_to, to_slots, with_waves

__all__ = [
    "PIPELINE_BASELINES",
    "align_groups",
    "megatron_pp_from",
    "megatron_pp_plan",
    "static_pp_from",
    "static_pp_plan",
]

#: The pipelined baselines, by name.
PIPELINE_BASELINES = ("megatron-pp", "static-pp")


def _grow(groups: list[Group], lengths: np.ndarray, topology: Topology) -> tuple[Group, ...]:
    """``groups`` (one slot) grown into the ranks none of them holds: the first group of the
    smallest size doubles to the next allowed size while the free ranks allow and its pack
    still fits; laid out again on aligned blocks (the ungrown slot if that needs two waves)."""
    sizes = [g.size for g in groups]
    free = topology.world - sum(sizes)
    menu = topology.group_sizes
    while free > 0:
        grown = False
        for s in sorted(set(sizes)):
            bigger = [c for c in menu if c > s]
            if not bigger or bigger[0] - s > free:
                continue
            new = bigger[0]
            for k, g in enumerate(groups):
                if sizes[k] != s:
                    continue
                ids = g.microbatches[0].seq_ids
                tokens = sum(padded_length(int(lengths[i]), new) for i in ids)
                if tokens <= new * topology.capacity:
                    sizes[k] = new
                    free -= new - s
                    grown = True
                    break
            if grown:
                break
        if not grown:
            break
    if sizes == [g.size for g in groups]:
        return tuple(groups)
    placed = place_waves(
        [(size, [list(g.microbatches[0].seq_ids)]) for size, g in zip(sizes, groups)], topology
    )
    return placed[0] if len(placed) == 1 else tuple(groups)


def _cut(wave: Wave, lengths: np.ndarray, topology: Topology) -> tuple[Wave, Wave] | None:
    """Megatron's ``split_group`` on one slot: (groups past the cut, groups before it), each
    grown into its free ranks; None for a slot of one group."""
    groups = sorted(wave.groups, key=lambda g: g.start)
    if len(groups) < 2:
        return None
    half = topology.world // 2
    k = next((k for k, g in enumerate(groups) if g.start >= half), len(groups) - 1)
    k = max(k, 1)
    head, tail = groups[:k], groups[k:]
    return Wave(_grow(tail, lengths, topology)), Wave(_grow(head, lengths, topology))


def align_groups(plan: StepPlan, multiple: int) -> StepPlan:
    """Megatron dev's ``align_sample_id_groups`` on a pipelined plan (module docstring): the
    slot count raised to a multiple of ``multiple``.

    Raises:
        ValueError: no slot has two groups left to cut before the count is reached.
    """
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    waves = list(plan.waves)
    remainder = (-len(waves)) % multiple
    i = len(waves) - 1
    misses = 0
    while remainder > 0:
        if i < 0:
            i = len(waves) - 1
        pair = _cut(waves[i], lengths, plan.topology)
        if pair is None:
            misses += 1
            if misses > len(waves):
                raise ValueError(
                    f"cannot align {len(waves)} micro-batches to a multiple of {multiple}: no "
                    "micro-batch has two CP groups left to split (too few sequences)"
                )
        else:
            waves[i] = pair[0]
            waves.append(pair[1])
            remainder -= 1
            misses = 0
        i -= 1
    return with_waves(plan, tuple(waves))


def megatron_pp_from(plan: StepPlan, pipeline: Pipeline) -> StepPlan:
    """Megatron dev's PP plan from ``megatron_plan``'s plan of the batch (module docstring)."""
    slots = align_groups(to_slots(plan, pipeline), pipeline.slot_multiple())
    slots.policy = "megatron-pp"
    return slots


def megatron_pp_plan(
    lengths: Batch | np.ndarray, topology: Topology, pipeline: Pipeline
) -> StepPlan:
    """Megatron dev's dynamic CP under ``pipeline`` (module docstring)."""
    return megatron_pp_from(megatron_plan(lengths, topology), pipeline)


def static_pp_from(plan: StepPlan, pipeline: Pipeline, model: CostModel) -> StepPlan:
    """Static CP with PP from ``fixed_cp_plan``'s plan of the batch (module docstring)."""
    slots = to_slots(plan, pipeline)
    k = pipeline.slot_multiple()
    slots = split_to(slots, -(-len(slots.waves) // k) * k, model)
    slots.policy = "static-pp"
    return slots


def static_pp_plan(
    lengths: Batch | np.ndarray, topology: Topology, model: CostModel, cp: int, pipeline: Pipeline
) -> StepPlan:
    """Static CP at size ``cp`` under ``pipeline`` (module docstring)."""
    return static_pp_from(fixed_cp_plan(lengths, topology, model, cp), pipeline, model)
