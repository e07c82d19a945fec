"""Execute a StepPlan on this rank: the right group, the right shards, the right loss scale.

    pool = GroupPool()                                   # once, at start-up, on every rank
    report = execute(plan, pool, step_fn)                # every step, on every rank
    # then reduce gradients over the DP x CP axis (SUM), e.g. all_reduce on each .grad

For each wave the rank finds its group and runs that group's micro-batches in order, calling
``step_fn(ctx)`` with a :class:`MicroBatchContext` (ring layout, sequence ids, shard helpers and
the loss scale); ranks of one ring call it for the same micro-batches in the same order.

Loss scaling: ``ctx.loss_scale = 1 / (label tokens of the whole global batch)``. If ``step_fn``
multiplies the *sum* of its token losses by it, the gradients summed over all DP x CP ranks are
exactly the gradients of the global batch's mean token loss on one device: every label token is
counted once, on the one rank whose shard holds it, with the same weight, whatever the CP sizes.

Safety: the plan is validated, and every group it needs checked against the pool, before any
collective is issued, so a wrong plan makes every rank raise the same error instead of hanging.
Between waves the ranks exchange their status (the synchronisation point where group membership
changes): if ``step_fn`` raised on some rank, every rank raises an error naming it. A rank blocked
on a failed ring peer is released by the process group's timeout, so a failure is bounded by it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dyncp.plan import PlanError, StepPlan
from dyncp.ring_attention import RingLayout, make_ring_layout, zigzag_positions, zigzag_shard
from dyncp.runtime.group_pool import GroupPool

__all__ = [
    "MicroBatchContext",
    "MicroBatchTiming",
    "RankReport",
    "StepFailed",
    "execute",
    "label_tokens",
]


class StepFailed(RuntimeError):
    """``step_fn`` raised on at least one rank; raised on every rank of the axis."""


def label_tokens(lengths: Sequence[int]) -> list[int]:
    """Next-token prediction inside each document: a sequence of s tokens has s - 1 labels."""
    return [int(s) - 1 for s in lengths]


@dataclass(frozen=True, slots=True)
class MicroBatchContext:
    """What ``step_fn`` needs for one micro-batch on this rank.

    Attributes:
        step_wave: index of the wave in the plan.
        group_start, cp: the group's first position on the DP x CP axis and its size.
        rank_in_group: this rank's index in the ring (which zigzag chunks it holds).
        seq_ids: the plan's sequence ids, in packing order; ``sample_ids`` their dataset rows.
        seqlens: their lengths.
        layout: the ring-attention layout (pass it to ``ring_attention``).
        loss_scale: multiply the summed token loss by this (see the module docstring).
    """

    step_wave: int
    group_start: int
    cp: int
    rank_in_group: int
    seq_ids: tuple[int, ...]
    sample_ids: tuple[int, ...] | None
    seqlens: tuple[int, ...]
    layout: RingLayout
    loss_scale: float

    def shard(self, packed: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
        """This rank's zigzag shard of a packed (tokens first) tensor of the micro-batch."""
        return zigzag_shard(
            packed, seqlens=self.seqlens, cp=self.cp, rank=self.rank_in_group, pad_value=pad_value
        )

    def positions(self) -> torch.Tensor:
        """Position of each local token inside its sequence (for RoPE)."""
        return zigzag_positions(seqlens=self.seqlens, cp=self.cp, rank=self.rank_in_group)


@dataclass(frozen=True, slots=True)
class MicroBatchTiming:
    """One micro-batch as this rank ran it: what the cost model needs to check its prediction."""

    wave: int
    group_start: int
    cp: int
    seq_ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    seconds: float


@dataclass(slots=True)
class RankReport:
    """Timings of one step on this rank (seconds)."""

    microbatches: list[tuple[int, int, float]] = field(default_factory=list)  # (wave, cp, s)
    timings: list[MicroBatchTiming] = field(default_factory=list)
    wave_seconds: list[float] = field(default_factory=list)  # wall clock of each wave, sync incl.
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0  # waiting at wave boundaries for the slowest group
    step_seconds: float = 0.0


def _check(plan: StepPlan, pool: GroupPool) -> None:
    plan.validate()
    if plan.topology.world != pool.world:
        raise PlanError(
            "topology",
            f"plan is for {plan.topology.world} ranks, the pool's DP x CP axis has {pool.world}",
        )
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            if not pool.has_block(g.start, g.size):
                ranks = list(pool.ranks[g.start : g.start + g.size])
                raise PlanError(
                    "group-pool",
                    f"wave {w} needs a group on ranks {ranks} (size {g.size}) that the pool did "
                    f"not build (sizes {list(pool.group_sizes)})",
                    (g.start,),
                )


def execute(
    plan: StepPlan,
    pool: GroupPool,
    step_fn: Callable[[MicroBatchContext], object],
    *,
    labels_per_sequence: Sequence[int] | None = None,
    synchronize: Callable[[], None] | None = None,
) -> RankReport:
    """Run this rank's share of ``plan``.

    Args:
        plan: the step's plan (identical on every rank).
        pool: the pre-built groups.
        step_fn: forward + backward of one micro-batch; called with its context.
        labels_per_sequence: label tokens of each sequence (default: length - 1).
        synchronize: called before reading the clock (e.g. ``torch.cuda.synchronize``).

    Raises:
        PlanError: the plan breaks the contract or needs a group the pool lacks (before any
            communication, identically on every rank).
        StepFailed: ``step_fn`` raised on some rank (on every rank, naming it).
    """
    _check(plan, pool)
    labels = label_tokens(plan.lengths) if labels_per_sequence is None else labels_per_sequence
    if len(labels) != len(plan.lengths):
        raise ValueError(f"{len(labels)} label counts for {len(plan.lengths)} sequences")
    total = sum(int(x) for x in labels)
    if total <= 0:
        raise ValueError("the global batch has no label tokens; nothing to train on")
    scale = 1.0 / total
    me = pool.position
    if me is None:
        raise ValueError("this rank is not on the pool's DP x CP axis")
    report = RankReport()
    step_start = time.perf_counter()
    for w, wave in enumerate(plan.waves):
        wave_start = time.perf_counter()
        error: str | None = None
        group = next((g for g in wave.groups if g.start <= me < g.start + g.size), None)
        if group is not None:
            pg = pool.group(group.start, group.size)
            for mb in group.microbatches:
                seqlens = tuple(plan.lengths[i] for i in mb.seq_ids)
                ctx = MicroBatchContext(
                    step_wave=w,
                    group_start=group.start,
                    cp=group.size,
                    rank_in_group=me - group.start,
                    seq_ids=mb.seq_ids,
                    sample_ids=None
                    if plan.sample_ids is None
                    else tuple(plan.sample_ids[i] for i in mb.seq_ids),
                    seqlens=seqlens,
                    layout=make_ring_layout(
                        seqlens=seqlens, cp=group.size, group=pg, rank=pool.ranks[me]
                    ),
                    loss_scale=scale,
                )
                t0 = time.perf_counter()
                try:
                    step_fn(ctx)
                    if synchronize is not None:
                        synchronize()
                except Exception as exc:  # reported to every rank below
                    error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                    break
                seconds = time.perf_counter() - t0
                report.microbatches.append((w, group.size, seconds))
                report.timings.append(
                    MicroBatchTiming(w, group.start, group.size, mb.seq_ids, seqlens, seconds)
                )
                report.busy_seconds += seconds
        t0 = time.perf_counter()
        statuses: list[str | None] = [None] * pool.world
        try:
            dist.all_gather_object(statuses, error, group=pool.axis_group)
        except RuntimeError as exc:  # a peer died or timed out: the exchange itself broke
            raise StepFailed(
                f"wave {w}: the step status exchange failed ({exc}); this rank's error: "
                f"{error or 'none'}"
            ) from exc
        report.idle_seconds += time.perf_counter() - t0
        report.wave_seconds.append(time.perf_counter() - wave_start)
        failed = {pool.ranks[r]: s for r, s in enumerate(statuses) if s is not None}
        if failed:
            first = min(failed)
            raise StepFailed(
                f"step_fn failed on rank(s) {sorted(failed)} in wave {w}; rank {first}: "
                f"{failed[first]}"
            )
    report.step_seconds = time.perf_counter() - step_start
    return report
