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

Dataflow: no barrier between waves. A rank runs its groups in wave order, and each group is
synchronised by its own collectives only (the rings inside ``step_fn``); a rank that finishes a
group moves on to its next one while other groups are still running, and everyone meets at the
gradient reduction after ``execute``. Deadlock-free: every rank's groups are ordered by wave,
and a group's collectives involve its members only. Take the earliest wave holding a group that
never completes; each of its members has completed its groups of earlier waves (by minimality),
so all of them reach it, and its collectives then complete -- a contradiction. Communicators of
different groups never wait on each other in opposite orders on two ranks, because every rank
issues them in the one wave order (the pattern behind NCCL's multi-communicator deadlocks).

Safety, in the order it happens:

1. One plan per step: before the first collective, the ranks compare (call number, plan digest)
   in one all_reduce (``dyncp.control.agreement``: latency logarithmic in the ranks on NCCL); a
   rank on another plan or another step makes every rank raise :class:`PlanMismatchError` naming it
   and the digests. ``agree=False`` skips it when the plan was already compared this step
   (a :class:`~dyncp.sampler.DynamicCPSampler` with its agreement on does that).
2. The plan is validated, and every group it needs checked against the pool, before any ring
   collective, so a wrong plan makes every rank raise the same PlanError instead of hanging
   (``validate=False`` checks this rank's groups only, for plans validated where they were made).
3. A rank whose ``step_fn`` raises leaves a signed report on the pool's failure board
   (``dyncp.control.failures``) and raises at once. Its group's other members learn of it when
   their collectives with it fail (the group's timeout T, or at once when its connections
   close), wait for the group's reports, and raise :class:`StepFailed` naming it (a rank that
   raised; else one that stayed silent -- hung, exited, skipped ``execute``; else one that
   arrived after the others' timeout). Ranks in other groups learn of it only when they next
   need a collective with a failed rank: at the latest at the step's gradient reduction, which
   :func:`~dyncp.runtime.reduce_gradients` / ``reduce_loss`` turn into the same StepFailed
   when given ``pool=``. How late: a rank that has finished its groups waits at the reduction
   for T after it arrived there, so it raises within its remaining share of the step plus 2 T
   of the failure, never later; it costs no Store request and no collective while the step is
   healthy. After a StepFailed the pool's groups may hold broken connections: tear the job down
   (or re-create the process groups) before the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dyncp.control.agreement import PendingAgreement, PlanAgreementError, PlanMismatchError
from dyncp.control.failures import (
    FailureBoard,
    is_communication_error,
    name_after_failed_wait,
)
from dyncp.plan import Group, MicroBatch, PlanError, StepPlan, pass_schedule, plan_digest
from dyncp.plan.slice import PlanSlice
from dyncp.ring_attention import (
    HybridLayout,
    RingLayout,
    make_hybrid_layout,
    make_ring_layout,
    zigzag_positions,
    zigzag_shard,
)
from dyncp.runtime.group_pool import GroupPool

__all__ = [
    "MicroBatchContext",
    "MicroBatchTiming",
    "PlanMismatchError",
    "RankReport",
    "StepFailed",
    "execute",
    "filler_context",
    "label_tokens",
    "loss_scale",
    "microbatch_context",
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


def loss_scale(plan: StepPlan, labels_per_sequence: Sequence[int] | None = None) -> float:
    """``1 / label tokens of the global batch``: each micro-batch's ``ctx.loss_scale``.

    Raises:
        ValueError: the label counts do not match the plan's sequences, or there are none.
    """
    labels = label_tokens(plan.lengths) if labels_per_sequence is None else labels_per_sequence
    if len(labels) != len(plan.lengths):
        raise ValueError(f"{len(labels)} label counts for {len(plan.lengths)} sequences")
    total = sum(int(x) for x in labels)
    if total <= 0:
        raise ValueError("the global batch has no label tokens; nothing to train on")
    return 1.0 / total


def microbatch_context(
    plan: StepPlan,
    wave: int,
    group: Group,
    mb: MicroBatch,
    rank_in_group: int,
    layout_for: Callable[[tuple[int, ...]], object],
    scale: float,
) -> MicroBatchContext:
    """What ``step_fn`` gets for micro-batch ``mb`` of ``group`` (``layout_for``: the ring layout
    of the rank's shard for the given sequence lengths)."""
    seqlens = tuple(plan.lengths[i] for i in mb.seq_ids)
    ids = None if plan.sample_ids is None else tuple(plan.sample_ids[i] for i in mb.seq_ids)
    return MicroBatchContext(
        step_wave=wave,
        group_start=group.start,
        cp=group.size,
        rank_in_group=rank_in_group,
        seq_ids=mb.seq_ids,
        sample_ids=ids,
        seqlens=seqlens,
        layout=layout_for(seqlens),
        loss_scale=scale,
        heads=group.heads,
    )


def filler_context(plan: StepPlan, position: int) -> Callable[[int], MicroBatchContext]:
    """The context of an empty pass in wave w on ``position``: what a lockstep ``execute``
    hands ``step_fn`` where this rank has no micro-batch.

    A real micro-batch, so that any ``step_fn`` runs it unchanged: the batch's shortest sequence
    (the cheapest forward+backward that still runs every block), alone at CP 1 on this rank
    (a local layout: no ring collective), with ``loss_scale = 0.0``. A ``step_fn`` that
    backwards ``loss * ctx.loss_scale`` then adds exactly zero to every gradient (as long as its
    loss is finite: 0 * inf is NaN), while the forward and backward still run every module's
    hooks (FSDP2's all-gathers and reduce-scatters). ``step_fn`` can tell a filler by
    ``ctx.loss_scale == 0.0`` (e.g. to keep it out of token counts); its loss is zero.
    """
    shortest = min(range(len(plan.lengths)), key=lambda i: (plan.lengths[i], i))
    seqlens = (int(plan.lengths[shortest]),)
    sample = None if plan.sample_ids is None else (plan.sample_ids[shortest],)

    def make(wave: int) -> MicroBatchContext:
        return MicroBatchContext(
            step_wave=wave,
            group_start=position,
            cp=1,
            rank_in_group=0,
            seq_ids=(shortest,),
            sample_ids=sample,
            seqlens=seqlens,
            layout=make_ring_layout(seqlens=seqlens, cp=1),
            loss_scale=0.0,
        )

    return make


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
    wave_seconds: list[float] = field(default_factory=list)  # this rank's wall clock per wave
    busy_seconds: float = 0.0  # in step_fn (waiting for group-mates inside collectives included)
    idle_seconds: float = 0.0  # in execute outside step_fn: agreement, checks, layouts
    step_seconds: float = 0.0
    empty_passes: int = 0  # ``lockstep`` only: filler passes run (not in ``timings``)

    @property
    def microbatches(self) -> list[tuple[int, int, float]]:
        """``(wave, cp, seconds)`` of each micro-batch this rank ran, in order."""
        return [(t.wave, t.cp, t.seconds) for t in self.timings]


def check_against_pool(plan: StepPlan | PlanSlice, pool: GroupPool, *, validate: bool) -> None:
    if validate:
        plan.validate()
    if plan.topology.world != pool.world:
        raise PlanError(
            "topology",
            f"plan is for {plan.topology.world} ranks, the pool's DP x CP axis has {pool.world}",
        )
    me = pool.position
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            if not validate and not g.start <= me < g.start + g.size:
                continue  # not this rank's: its maker validated the plan
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


def layout_maker(
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
    plan: StepPlan | PlanSlice,
    pool: GroupPool,
    step_fn: Callable[[MicroBatchContext], object],
    *,
    labels_per_sequence: Sequence[int] | None = None,
    synchronize: Callable[[], None] | None = None,
    agree: bool = True,
    validate: bool = True,
    plan_check: Callable[[StepPlan | PlanSlice], None] | None = None,
    lockstep: bool = False,
) -> RankReport:
    """Run this rank's share of ``plan``.

    Args:
        plan: the step's plan (identical on every rank; checked unless ``agree=False``), or
            this rank's :class:`~dyncp.plan.slice.PlanSlice` of it (the ranks then compare the
            slices' root, and only this rank's groups are checked: the maker validated the plan).
        pool: the pre-built groups.
        step_fn: forward + backward of one micro-batch; called with its context.
        labels_per_sequence: label tokens of each sequence (default: length - 1).
        synchronize: called before reading the clock (e.g. ``torch.cuda.synchronize``).
        agree: compare the plan's digest with every rank's first (False: it was compared this
            step already, e.g. by the sampler; one agreement per step is enough).
        validate: check the whole plan against the contract (False: this rank's groups only,
            for a plan validated where it was made).
        plan_check: called with the plan (or slice) on every rank after the checks below and
            before any ring collective; raises (PlanError) to refuse a plan the model cannot
            run, e.g. ``dyncp.integrations.hf.plan_check(model)`` (head splits with windowed
            layers; a slice shows it this rank's groups only).
        lockstep: run the plan as passes (:mod:`dyncp.plan.passes`), for collectives that span
            every rank in every forward+backward (FSDP2 with full sharding): in each wave this
            rank runs its group's micro-batches, then one *empty pass* for each pass its group
            (or its idleness) leaves it short, so that every rank calls ``step_fn`` the same
            number of times and the k-th calls meet. An empty pass calls ``step_fn`` with the
            context of a filler micro-batch (see :func:`filler_context`: the batch's shortest
            sequence at CP 1, ``loss_scale`` 0.0), so it adds exactly zero to every gradient.
            Needs the whole plan (not a PlanSlice). A failed collective is then blamed on any
            rank of the axis, not only the ring's.

    Raises:
        PlanMismatchError: some rank holds another plan, or is at another ``execute`` call (on
            every rank, before any other collective, naming the ranks and the digests).
        PlanError: the plan breaks the contract, needs a group the pool lacks or fails
            ``plan_check`` (before any ring collective; identically on every rank for a whole
            plan).
        StepFailed: a rank of one of this rank's groups failed the step (naming it and its
            error where known; see the module docstring for when and where the others learn).
    """
    me = pool.position
    if me is None:
        raise ValueError("this rank is not on the pool's DP x CP axis")
    call_start = time.perf_counter()
    call = pool.calls
    pool.calls += 1
    pool.last_call = (call, len(plan.waves))
    board = pool.board(f"c{call}")
    label = f"execute call {call}"
    entry, entry_wall = time.monotonic(), time.time()
    sliced = isinstance(plan, PlanSlice)
    if lockstep and sliced:
        raise ValueError(
            "lockstep needs the whole StepPlan (every group's micro-batch count), not a PlanSlice"
        )
    if not sliced and plan.pipeline is not None:
        raise ValueError(
            f"this plan runs over {plan.pipeline.stages} pipeline stages: run it with the "
            f"pipeline runtime (dyncp.runtime.execute_pipeline), not execute()"
        )
    if agree:
        try:
            PendingAgreement(
                pool.agreement_group,
                where=(call,),
                digest=plan.digest if sliced else plan_digest(plan),
                label=label,
                device=pool.agreement_device,
            ).result()
        except PlanAgreementError as exc:
            culprit = name_after_failed_wait(
                board, -1, me, exc, entered=entry, entered_wall=entry_wall, label=label
            )
            raise StepFailed(culprit.message, culprit.ranks) from exc
    check_against_pool(plan, pool, validate=validate and not sliced)
    if plan_check is not None:
        plan_check(plan)
    if sliced:
        if labels_per_sequence is not None:
            raise ValueError(
                "labels_per_sequence needs the whole plan; a PlanSlice carries the batch's label "
                "tokens (length - 1 per sequence)"
            )
        total = plan.header.labels
        if total <= 0:
            raise ValueError("the global batch has no label tokens; nothing to train on")
        scale = 1.0 / total
    else:
        scale = loss_scale(plan, labels_per_sequence)
    report = RankReport()
    # The agreement and the checks above are what the step pays once: they count in the first
    # wave's wall clock (and so in the wave cost a calibration fits).
    wave_start = step_start = call_start
    by_wave = None  # lockstep: this rank's passes of each wave (None: an empty pass)
    if lockstep:
        by_wave = [[] for _ in plan.waves]
        for p in pass_schedule(plan).of_rank(me):
            by_wave[p.wave].append(p.microbatch)
        filler = filler_context(plan, me)
    for w, wave in enumerate(plan.waves):
        if w:
            wave_start = time.perf_counter()
        group = next((g for g in wave.groups if g.start <= me < g.start + g.size), None)
        mbs = () if group is None else group.microbatches
        passes = mbs if by_wave is None else by_wave[w]
        if group is not None:
            layout_for = layout_maker(group, pool, pool.ranks[me])
        # whom a failed collective blames: the ring's ranks; in lockstep any rank (FSDP2's)
        if lockstep:
            start, size = 0, pool.world
        else:
            start, size = (me, 1) if group is None else (group.start, group.size)
        for mb in passes:
            if mb is None:
                ctx = filler(w)
            else:
                assert group is not None
                ctx = microbatch_context(plan, w, group, mb, me - group.start, layout_for, scale)
            t0, started = time.perf_counter(), time.monotonic()
            try:
                step_fn(ctx)
                if synchronize is not None:
                    synchronize()
            except Exception as exc:
                _fail(board, pool, w, start, size, exc, started, label)
            seconds = time.perf_counter() - t0
            report.busy_seconds += seconds
            if mb is None:
                report.empty_passes += 1
                continue
            assert group is not None
            report.timings.append(
                MicroBatchTiming(
                    w, group.start, group.size, mb.seq_ids, ctx.seqlens, seconds, group.heads
                )
            )
        report.wave_seconds.append(time.perf_counter() - wave_start)
    report.step_seconds = time.perf_counter() - step_start
    report.idle_seconds = report.step_seconds - report.busy_seconds
    return report


def _fail(
    board: FailureBoard,
    pool: GroupPool,
    wave: int,
    start: int,
    size: int,
    exc: Exception,
    started: float,
    label: str,
) -> None:
    """``step_fn`` raised here (it began at ``started``, monotonic): leave the error for the
    others and raise StepFailed now."""
    me = pool.position
    assert me is not None
    board.report_error(wave, me, exc)
    if is_communication_error(exc):  # a ring peer failed: wait for the ring's reports, name it
        ring = tuple(range(start, start + size))
        until = board.survivors_until(started)
        culprit = board.culprit(
            wave, suspects=ring, until=until, label=label, earlier=range(-1, wave)
        )
        raise StepFailed(culprit.message, culprit.ranks) from exc
    raise StepFailed(
        f"{label}: rank {pool.ranks[me]} failed in wave {wave}: {type(exc).__name__}: {exc}",
        (pool.ranks[me],),
    ) from exc


def reduction_failed(
    pool: GroupPool, exc: BaseException, *, entered: float, entered_wall: float
) -> StepFailed:
    """The step's reduction (after ``execute``) failed with ``exc``: report that this rank got
    there, wait for the others' reports and name who failed the last ``execute`` call."""
    me = pool.position
    assert me is not None
    call, waves = pool.last_call
    board = pool.board(f"c{call}")
    label = f"execute call {call} (found at the gradient reduction)"
    culprit = name_after_failed_wait(
        board,
        waves,  # the reduction's slot: after every wave
        me,
        exc,
        entered=entered,
        entered_wall=entered_wall,
        label=label,
        earlier=range(-1, waves),
    )
    return StepFailed(culprit.message, culprit.ranks)
