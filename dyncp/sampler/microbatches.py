"""One rank's micro-batches of a step plan: the index lists a DataLoader fetches, with their meta.

The meta says where a micro-batch sits in the plan (wave, group, position) so that the collate can
shard it and the training loop can tell the step's last micro-batch; it travels to DataLoader
workers with the indices (``MicroBatchIndices`` pickles its meta).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dyncp.plan import StepPlan

__all__ = ["MicroBatchIndices", "MicroBatchMeta", "rank_microbatches"]


@dataclass(frozen=True, slots=True)
class MicroBatchMeta:
    """One micro-batch of one rank: where it sits in the step plan and what it holds.

    ``position`` counts this rank's micro-batches within the step; ``microbatch`` is the index
    within the group's micro-batches. An empty micro-batch (``is_empty``) stands for a step in
    which this rank has no work. ``truncated`` lists positions (into ``sample_indices``) of
    samples truncated to the planned ``seqlens``.
    """

    epoch: int
    step: int
    wave: int
    position: int
    last_in_step: bool
    group_start: int
    group_size: int
    rank_in_group: int
    microbatch: int
    sample_indices: tuple[int, ...]
    seq_ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    truncated: tuple[int, ...]
    plan_digest: int

    @property
    def cp(self) -> int:
        return self.group_size

    @property
    def group_ranks(self) -> range:
        return range(self.group_start, self.group_start + self.group_size)

    @property
    def is_empty(self) -> bool:
        return not self.sample_indices


class MicroBatchIndices(list):
    """Dataset indices of one micro-batch (what the DataLoader fetches), with its ``meta``."""

    def __init__(self, indices: Sequence[int], meta: MicroBatchMeta) -> None:
        super().__init__(indices)
        self.meta = meta

    def __reduce__(self) -> tuple[Any, ...]:
        return MicroBatchIndices, (list(self), self.meta)


def rank_microbatches(
    plan: StepPlan,
    *,
    rank: int,
    epoch: int,
    step: int,
    digest: int,
    is_truncated: np.ndarray | None = None,
) -> list[MicroBatchIndices]:
    """This rank's micro-batches of a step plan, in execution order (one empty one if none)."""
    ids = plan.sample_ids if plan.sample_ids is not None else range(len(plan.lengths))
    mine = [
        (w, g, m, mb)
        for w, wave in enumerate(plan.waves)
        for g in wave.groups
        if g.start <= rank < g.start + g.size
        for m, mb in enumerate(g.microbatches)
    ]
    out = []
    for p, (w, g, m, mb) in enumerate(mine):
        samples = tuple(int(ids[i]) for i in mb.seq_ids)
        meta = MicroBatchMeta(
            epoch=epoch,
            step=step,
            wave=w,
            position=p,
            last_in_step=p == len(mine) - 1,
            group_start=g.start,
            group_size=g.size,
            rank_in_group=rank - g.start,
            microbatch=m,
            sample_indices=samples,
            seq_ids=mb.seq_ids,
            seqlens=tuple(plan.lengths[i] for i in mb.seq_ids),
            truncated=tuple(
                j for j, i in enumerate(samples) if is_truncated is not None and is_truncated[i]
            ),
            plan_digest=digest,
        )
        out.append(MicroBatchIndices(samples, meta))
    if not out:  # no work for this rank in this step
        meta = MicroBatchMeta(
            epoch=epoch,
            step=step,
            wave=-1,
            position=0,
            last_in_step=True,
            group_start=rank,
            group_size=1,
            rank_in_group=0,
            microbatch=0,
            sample_indices=(),
            seq_ids=(),
            seqlens=(),
            truncated=(),
            plan_digest=digest,
        )
        out.append(MicroBatchIndices((), meta))
    return out
