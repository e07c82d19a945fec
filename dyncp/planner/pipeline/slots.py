"""Slots: any plan read as pipelined slots, and the slot count aligned to what the schedule needs.

A pipelined plan (``dyncp.plan.pipeline``) runs its waves as *slots*, one micro-batch per group.
An ordinary plan becomes one by its pass schedule (``dyncp.plan.passes``): pass ``p`` of a wave is
a slot in which every group with a ``p``-th micro-batch runs it and the other columns are idle.
That keeps every group's members together and every column's micro-batches in their order, so
the groups and packs the unpipelined search chose carry over unchanged.

Interleaved 1F1B needs a slot count that is a multiple of the stages (``Pipeline.slot_multiple``)
and any pipeline wants at least ``stages`` slots (fewer leave stages idle through the whole
warm-up). :func:`split_to` adds slots one at a time by halving the most expensive slot that can be
halved: each of its groups whose micro-batch holds two or more sequences splits it in two halves
of nearly equal predicted seconds (largest first onto the lighter half), the first halves stay
in the slot and the second halves open the next one. Halving the slot that bounds the pipeline's
per-slot time is what shortens both its warm-up and its steady state the most; a slot whose
micro-batches are all single sequences cannot be split.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Group, MicroBatch, Pipeline, StepPlan, Wave, padded_length
from dyncp.plan.passes import pass_schedule
from dyncp.planner.construction.packing import pack_ffd

__all__ = [
    "repack",
    "to_slots",
    "slot_seconds",
    "split_steps",
    "split_to",
    "target_slots",
    "with_order",
]


def to_slots(plan: StepPlan, pipeline: Pipeline) -> StepPlan:
    """``plan`` as a pipelined plan: each of its passes a slot (module docstring). The groups,
    packs and each column's micro-batch order are ``plan``'s; the slot count is not aligned."""
    schedule = pass_schedule(plan)
    waves = []
    for wave, passes in zip(plan.waves, schedule.per_wave):
        for p in range(passes):
            groups = tuple(
                Group(g.start, g.size, (g.microbatches[p],), g.heads)
                for g in wave.groups
                if p < len(g.microbatches)
            )
            waves.append(Wave(groups))
    return with_waves(plan, tuple(waves), pipeline=pipeline)


def repack(plan: StepPlan, capacity: int) -> StepPlan:
    """``plan`` (unpipelined) with every group's sequences packed again, first-fit decreasing,
    into micro-batches of at most ``capacity`` tokens a rank (a sequence too long for that
    stays alone): the same groups on the same columns, more and smaller packs, so more slots.
    The cheap form of a smaller micro-batch token budget (the groups' CP sizes are kept)."""
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    small = replace(plan.topology, capacity=capacity)
    waves = []
    for wave in plan.waves:
        groups = []
        for g in wave.groups:
            ids = [i for mb in g.microbatches for i in mb.seq_ids]
            fits = [i for i in ids if padded_length(int(lengths[i]), g.size) <= g.size * capacity]
            kept = set(fits)
            alone = [[i] for i in ids if i not in kept]
            packs = alone + pack_ffd(fits, lengths, g.size, small)
            groups.append(
                Group(g.start, g.size, tuple(MicroBatch(tuple(sorted(p))) for p in packs), g.heads)
            )
        waves.append(Wave(tuple(groups)))
    return with_waves(plan, tuple(waves), pipeline=None)


def with_waves(
    plan: StepPlan, waves: tuple[Wave, ...], *, pipeline: Pipeline | None | str = "same"
) -> StepPlan:
    """``plan``'s batch, topology, policy and sample ids with other ``waves`` (no stats: they
    describe the old waves); ``pipeline``: the new plan's (default: ``plan``'s)."""
    return StepPlan(
        plan.topology,
        plan.lengths,
        waves,
        policy=plan.policy,
        sample_ids=plan.sample_ids,
        pipeline=plan.pipeline if pipeline == "same" else pipeline,
    )


def with_order(plan: StepPlan, order: list[int] | tuple[int, ...]) -> StepPlan:
    """``plan`` (pipelined) with its slots in ``order`` (a permutation of the slot indices)."""
    if sorted(order) != list(range(len(plan.waves))):
        raise ValueError(
            f"order must be a permutation of the {len(plan.waves)} slot indices, got {list(order)}"
        )
    return with_waves(plan, tuple(plan.waves[i] for i in order))


def slot_seconds(plan: StepPlan, model: CostModel) -> np.ndarray:
    """Each slot's longest group: the predicted forward+backward seconds (whole model) of its
    slowest micro-batch, what a column of the slot's slowest group spends on it. Priced with
    one ``packs_seconds`` call per (CP size, head split), not one call per micro-batch."""
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    out = np.zeros(len(plan.waves))
    by_layout: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            for mb in g.microbatches:
                slots, ids = by_layout.setdefault((g.size, g.heads), ([], []))
                slots.append(w)
                ids.append(len(mb.seq_ids))
                ids.extend(mb.seq_ids)
    for (size, heads), (slots, flat) in by_layout.items():
        counts, seqs, k = [], [], 0
        while k < len(flat):
            n = flat[k]
            counts.append(n)
            seqs.extend(flat[k + 1 : k + 1 + n])
            k += 1 + n
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        seconds = model.packs_seconds(size, lengths[seqs], starts, heads=heads)
        np.maximum.at(out, np.asarray(slots, dtype=np.int64), seconds)
    return out


def target_slots(slots: int, pipeline: Pipeline) -> int:
    """The slot count to reach from ``slots``: at least ``stages``, rounded up to the schedule's
    multiple."""
    k = pipeline.slot_multiple()
    want = max(slots, pipeline.stages)
    return -(-want // k) * k


class _AloneSeconds:
    """Each sequence's seconds alone at a group's (CP size, head split), priced for the whole
    batch once per layout on first use: one vectorised cost-model call per layout instead of
    one per group halved (the split of a 512-column plan halves thousands of groups)."""

    def __init__(self, lengths: np.ndarray, model: CostModel) -> None:
        self.lengths, self.model = lengths, model
        self.tables: dict[tuple[int, int], np.ndarray] = {}

    def of(self, group: Group, ids: tuple[int, ...]) -> list[float]:
        key = (group.size, group.heads)
        table = self.tables.get(key)
        if table is None:
            table = self.model.alone_seconds(group.size, self.lengths, heads=group.heads)
            self.tables[key] = table
        return table[list(ids)].tolist()


def _halves(group: Group, alone: _AloneSeconds) -> tuple[Group, Group] | None:
    """``group``'s one micro-batch split in two of nearly equal seconds, or None (one sequence)."""
    ids = group.microbatches[0].seq_ids
    if len(ids) < 2:
        return None
    seconds = alone.of(group, ids)
    order = sorted(range(len(ids)), key=lambda k: (-seconds[k], ids[k]))
    parts: tuple[list[int], list[int]] = ([], [])
    load = [0.0, 0.0]
    for k in order:
        side = 0 if load[0] <= load[1] else 1
        parts[side].append(ids[k])
        load[side] += seconds[k]
    return tuple(  # type: ignore[return-value]
        Group(group.start, group.size, (MicroBatch(tuple(sorted(p))),), group.heads) for p in parts
    )


def _split_slot(wave: Wave, alone: _AloneSeconds) -> tuple[Wave, Wave] | None:
    """``wave`` (a slot) as two slots, each splittable group's micro-batch halved; None when
    none can be."""
    first, second = [], []
    for g in wave.groups:
        halves = _halves(g, alone)
        if halves is None:
            first.append(g)
        else:
            first.append(halves[0])
            second.append(halves[1])
    if not second:
        return None
    return Wave(tuple(first)), Wave(tuple(second))


def split_steps(plan: StepPlan, slots: int, model: CostModel) -> list[tuple[Wave, ...]]:
    """The waves of ``plan`` (pipelined) after each split of :func:`split_to` on the way to
    ``slots`` slots: entry ``i`` holds ``len(plan.waves) + i`` slots (each split adds one). It
    ends early where no slot can be split any more. A caller that wants several counts of the
    same split (``search.slotted``: as far as it goes, then aligned down) splits once."""
    if plan.pipeline is None:
        raise ValueError("split_to needs a pipelined plan (to_slots first)")
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    alone = _AloneSeconds(lengths, model)
    waves = list(plan.waves)
    steps = [tuple(waves)]
    seconds = list(slot_seconds(plan, model))
    # ids of waves that cannot be split: unique, as ``steps`` keeps every wave made alive (an
    # id reused by a new wave after the old one was freed would block it by mistake)
    blocked: set[int] = set()
    while len(waves) < slots:
        candidates = [w for w in range(len(waves)) if id(waves[w]) not in blocked]
        done = False
        for w in sorted(candidates, key=lambda w: (-seconds[w], w)):
            pair = _split_slot(waves[w], alone)
            if pair is None:
                blocked.add(id(waves[w]))
                continue
            waves[w : w + 1] = list(pair)
            part = StepPlan(plan.topology, plan.lengths, pair, pipeline=None)
            seconds[w : w + 1] = list(slot_seconds(part, model))
            done = True
            break
        if not done:
            break
        steps.append(tuple(waves))
    return steps


def split_to(plan: StepPlan, slots: int, model: CostModel, *, partial: bool = False) -> StepPlan:
    """``plan`` (pipelined) with at least ``slots`` slots, added by halving the most expensive
    splittable slot (module docstring); the halves sit next to each other in the order.
    ``partial``: stop where no slot can be split any more instead of raising.

    Raises:
        ValueError: no slot can be split any more (every micro-batch one sequence) before
            ``slots`` is reached (unless ``partial``).
    """
    waves = split_steps(plan, slots, model)[-1]
    if len(waves) < slots and not partial:
        raise ValueError(
            f"cannot reach {slots} slots: {len(waves)} slots whose micro-batches are all "
            "single sequences (the batch has too few sequences to split)"
        )
    return with_waves(plan, waves)
