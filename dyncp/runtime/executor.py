"""Execute a StepPlan on this rank: the right group, the right shards, the right loss scale.

    pool = GroupPool()                                   # once, at start-up, on every rank
    report = execute(plan, pool, step_fn)                # every step, on every rank
    # then reduce gradients over the DP x CP axis (SUM), e.g. all_reduce on each .grad

For each wave the rank finds its group and runs that group's micro-batches in order, calling
``step_fn(ctx)`` with a :class:`MicroBatchContext` (ring layout, sequence ids, shard helpers and
the loss scale); ranks of one ring call it for the same micro-batches in the same order. A group
split into heads x ring (``Group.heads`` = u > 1) gets a
:class:`~dyncp.ring_attention.HybridLayout` on the pool's head and ring sub-groups instead; the
tokens each rank holds (``ctx.shard``, ``ctx.positions``) are the same zigzag at the group's size
whatever the split, so ``step_fn`` does not change.

Loss scaling: ``ctx.loss_scale = 1 / (label tokens of the whole global batch)``. If ``step_fn``
multiplies the *sum* of its token losses by it, the gradients summed over all DP x CP ranks are
exactly the gradients of the global batch's mean token loss on one device: every label token is
counted once, on the one rank whose shard holds it, with the same weight, whatever the CP sizes.

Safety, in the order it happens:

1. One plan per step: before the first collective, the ranks compare (call number, plan digest)
   in one all_gather on the pool's CPU control group; a rank on another plan or another step
   makes every rank raise :class:`PlanMismatchError` naming it and the digests.
2. The plan is validated, and every group it needs checked against the pool, before any ring
   collective, so a wrong plan makes every rank raise the same PlanError instead of hanging.
3. Between waves the ranks exchange their status (the synchronisation point where group
   membership changes). A rank whose ``step_fn`` raises leaves its error in the Store and raises
   at once; the others see it while they wait at the exchange, or after their ring collectives
   with it time out (the pool's timeout T), and raise :class:`StepFailed` naming it. A rank that
   hangs, exits or skips ``execute`` is named as the one that stopped responding. Every rank
   raises within 2 T of the failure. After a StepFailed the pool's groups may hold broken
   connections: tear the job down (or re-create the process groups) before the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dyncp.agreement import PlanAgreementError, PlanMismatchError, agree
from dyncp.plan import Group, PlanError, StepPlan, plan_digest
from dyncp.ring_attention import (
    HybridLayout,
    RingLayout,
    make_hybrid_layout,
    make_ring_layout,
    zigzag_positions,
    zigzag_shard,
)
from dyncp.runtime.failures import FailureBoard, is_communication_error
from dyncp.runtime.group_pool import GroupPool

__all__ = [
    "MicroBatchContext",
    "MicroBatchTiming",
    "PlanMismatchError",
    "RankReport",
    "StepFailed",
    "execute",
    "label_tokens",
]


class StepFailed(RuntimeError):
    """A rank failed the step (``step_fn`` raised, or it hung, exited or skipped ``execute``);
    raised on every rank of the axis.

    Attributes:
        ranks: the global ranks named as the cause (empty when no rank could be named).
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


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
        layout: the attention layout (pass it to ``ring_attention``): a RingLayout, or a
            HybridLayout when the group splits its heads (``heads`` > 1).
        loss_scale: multiply the summed token loss by this (see the module docstring).
        heads: the group's head-parallel degree u (1: a plain ring).
    """

    step_wave: int
    group_start: int
    cp: int
    rank_in_group: int
    seq_ids: tuple[int, ...]
    sample_ids: tuple[int, ...] | None
    seqlens: tuple[int, ...]
    layout: RingLayout | HybridLayout
    loss_scale: float
    heads: int = 1

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
    """One micro-batch as this rank ran it: what the cost model needs to check its prediction.

    ``heads``: the group's head-parallel degree u (1: a plain ring of ``cp`` ranks).
    """

    wave: int
    group_start: int
    cp: int
    seq_ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    seconds: float
    heads: int = 1


@dataclass(slots=True)
class RankReport:
    """Timings of one step on this rank (seconds)."""

    timings: list[MicroBatchTiming] = field(default_factory=list)
    wave_seconds: list[float] = field(default_factory=list)  # wall clock of each wave, sync incl.
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0  # waiting at wave boundaries for the slowest group
    step_seconds: float = 0.0

    @property
    def microbatches(self) -> list[tuple[int, int, float]]:
        """``(wave, cp, seconds)`` of each micro-batch this rank ran, in order."""
        return [(t.wave, t.cp, t.seconds) for t in self.timings]


def _check(plan: StepPlan, pool: GroupPool) -> None:
    plan.validate()
    if plan.topology.world != pool.world:
        raise PlanError(
            "topology",
            f"plan is for {plan.topology.world} ranks, the pool's DP x CP axis has {pool.world}",
        )
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            if not pool.has_block(g.start, g.size, g.heads):
                ranks = list(pool.ranks[g.start : g.start + g.size])
                split = "" if g.heads == 1 else f" split heads {g.heads} x ring {g.ring}"
                raise PlanError(
                    "group-pool",
                    f"wave {w} needs a group on ranks {ranks} (size {g.size}){split} that the "
                    f"pool did not build (sizes {list(pool.group_sizes)}, head sizes "
                    f"{list(pool.head_sizes)})",
                    (g.start,),
                )


def _layout_maker(
    group: Group, pool: GroupPool, rank: int
) -> Callable[[tuple[int, ...]], RingLayout | HybridLayout]:
    """Builds each micro-batch's layout on the group's pre-built groups (looked up once)."""
    if group.heads == 1:
        pg = pool.group(group.start, group.size)
        return lambda seqlens: make_ring_layout(seqlens=seqlens, cp=group.size, group=pg, rank=rank)
    head, ring = pool.hybrid_groups(group.start, group.size, group.heads)
    return lambda seqlens: make_hybrid_layout(
        seqlens=seqlens,
        cp=group.size,
        heads=group.heads,
        head_group=head,
        ring_group=ring,
        rank=rank,
    )


def execute(
    plan: StepPlan,
    pool: GroupPool,
    step_fn: Callable[[MicroBatchContext], object],
    *,
    labels_per_sequence: Sequence[int] | None = None,
    synchronize: Callable[[], None] | None = None,
    plan_check: Callable[[StepPlan], None] | None = None,
) -> RankReport:
    """Run this rank's share of ``plan``.

    Args:
        plan: the step's plan (identical on every rank; checked).
        pool: the pre-built groups.
        step_fn: forward + backward of one micro-batch; called with its context.
        labels_per_sequence: label tokens of each sequence (default: length - 1).
        synchronize: called before reading the clock (e.g. ``torch.cuda.synchronize``).
        plan_check: called with the plan on every rank after the checks below and before any
            ring collective; raises (PlanError) to refuse a plan the model cannot run, e.g.
            ``dyncp.integrations.hf.plan_check(model)`` (head splits with windowed layers).

    Raises:
        PlanMismatchError: some rank holds another plan, or is at another ``execute`` call (on
            every rank, before any other collective, naming the ranks and the digests).
        PlanError: the plan breaks the contract, needs a group the pool lacks or fails
            ``plan_check`` (before any ring collective, identically on every rank).
        StepFailed: a rank failed the step (on every rank within twice the pool's timeout,
            naming it and its error where known).
    """
    me = pool.position
    if me is None:
        raise ValueError("this rank is not on the pool's DP x CP axis")
    call_start = time.perf_counter()
    call = pool.calls
    pool.calls += 1
    board = FailureBoard(pool.store, call=call, world=pool.world, names=pool.ranks)
    label = f"execute call {call}"
    entry = time.monotonic()
    try:
        agree(pool.control_group, where=(call,), digest=plan_digest(plan), label=label)
    except PlanAgreementError as exc:
        board.report_ok(-1, me)
        until = max(entry + SURVIVOR_WAIT * pool.timeout, time.monotonic() + pool.timeout / 4)
        culprit = board.culprit(-1, suspects=None, until=until, label=label)
        raise StepFailed(culprit.message, culprit.ranks) from exc
    _check(plan, pool)
    if plan_check is not None:
        plan_check(plan)
    labels = label_tokens(plan.lengths) if labels_per_sequence is None else labels_per_sequence
    if len(labels) != len(plan.lengths):
        raise ValueError(f"{len(labels)} label counts for {len(plan.lengths)} sequences")
    total = sum(int(x) for x in labels)
    if total <= 0:
        raise ValueError("the global batch has no label tokens; nothing to train on")
    scale = 1.0 / total
    report = RankReport()
    # The agreement and the checks above are synchronisation the step pays once: they count in
    # the first wave's wall clock (and so in the wave cost a calibration fits).
    wave_start = step_start = call_start
    for w, wave in enumerate(plan.waves):
        if w:
            wave_start = time.perf_counter()
        group = next((g for g in wave.groups if g.start <= me < g.start + g.size), None)
        if group is not None:
            layout_for = _layout_maker(group, pool, pool.ranks[me])
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
                    layout=layout_for(seqlens),
                    loss_scale=scale,
                    heads=group.heads,
                )
                t0 = time.perf_counter()
                try:
                    step_fn(ctx)
                    if synchronize is not None:
                        synchronize()
                except Exception as exc:
                    _fail(board, pool, w, group.start, group.size, exc, time.perf_counter() - t0)
                seconds = time.perf_counter() - t0
                report.timings.append(
                    MicroBatchTiming(
                        w, group.start, group.size, mb.seq_ids, seqlens, seconds, group.heads
                    )
                )
                report.busy_seconds += seconds
        t0 = time.perf_counter()
        _exchange(board, pool, w)
        report.idle_seconds += time.perf_counter() - t0
        report.wave_seconds.append(time.perf_counter() - wave_start)
    report.step_seconds = time.perf_counter() - step_start
    return report


def _fail(
    board: FailureBoard,
    pool: GroupPool,
    wave: int,
    start: int,
    size: int,
    exc: Exception,
    waited: float,
) -> None:
    """``step_fn`` raised here: leave the error for the others and raise StepFailed now."""
    me = pool.position
    assert me is not None
    board.report_error(wave, me, exc, waited)
    label = f"execute call {board.call}"
    if is_communication_error(exc):  # a ring peer failed first: name it if it said so
        ring = tuple(range(start, start + size))
        until = time.monotonic() + pool.timeout / 4  # the ring's members time out together
        culprit = board.culprit(wave, suspects=ring, until=until, label=label)
        raise StepFailed(culprit.message, culprit.ranks) from exc
    raise StepFailed(
        f"{label}: rank {pool.ranks[me]} failed in wave {wave}: {type(exc).__name__}: {exc}",
        (pool.ranks[me],),
    ) from exc


def _exchange(board: FailureBoard, pool: GroupPool, wave: int) -> None:
    """The wave's synchronisation point: every rank got here, or StepFailed names who did not.

    One all_gather on the control group; while it is pending the Store is looked at now and
    then, so a rank that already reported an error releases the others at once.
    """
    me = pool.position
    assert me is not None
    label = f"execute call {board.call}"
    flag = torch.zeros(1, dtype=torch.int64)
    out = [torch.empty_like(flag) for _ in range(pool.world)]
    start = time.monotonic()
    try:
        work = dist.all_gather(out, flag, group=pool.control_group, async_op=True)
        pause, next_look = 2e-5, start + STORE_LOOK_SECONDS
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_look:
                next_look = now + STORE_LOOK_SECONDS
                if board.first() is not None:
                    board.report_ok(wave, me)
                    until = now + pool.timeout / 4
                    culprit = board.culprit(wave, suspects=None, until=until, label=label)
                    raise StepFailed(culprit.message, culprit.ranks)
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        work.wait()
    except RuntimeError as exc:
        if isinstance(exc, StepFailed):
            raise
        board.report_ok(wave, me)
        until = max(start + SURVIVOR_WAIT * pool.timeout, time.monotonic() + pool.timeout / 4)
        culprit = board.culprit(wave, suspects=None, until=until, label=label)
        raise StepFailed(culprit.message, culprit.ranks) from exc


#: After a collective on the control group failed, survivors are waited for until this many
#: timeouts after this rank entered it: a survivor blocked in the same collective is released
#: by the timeout (1) and then reports; the rest is margin for a loaded machine. Below 2: the bound.
SURVIVOR_WAIT = 1.5
#: How often a rank waiting at a wave's exchange looks in the Store for a reported failure.
STORE_LOOK_SECONDS = 0.05
