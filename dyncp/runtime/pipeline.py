"""Execute a pipelined StepPlan on this process: its stage's operations, its hand-offs, its rings.

    groups = PipelineGroups(PipelineLayout(stages=P, columns=W))   # once, on every process
    report = execute_pipeline(plan, groups, chunks, activation=Activation(hidden=H))
    reduce_stage_gradients(chunks, groups)      # SUM over the stage's axis (pipeline_reduce)

The process (stage s, column w) runs ``stage_order(plan.pipeline, slots, s)``: for each
operation ``(kind, slot j, chunk c)`` of virtual stage ``q = c * P + s``, if column w is in a
group g of slot j (else it is idle there: no compute, no message):

* F: receive the input from virtual stage q - 1 (nothing at q = 0), call ``chunks[c](x, ctx)``,
  send the output to q + 1; at the last virtual stage the output is the micro-batch's loss
  (already multiplied by ``ctx.loss_scale``), kept for the backward and the report.
* B: receive the output's gradient from q + 1 (the loss needs none), backward, send the input's
  gradient to q - 1.

``ctx`` is the executor's :class:`~dyncp.runtime.MicroBatchContext` of slot j's micro-batch on
group g (built by ``executor.microbatch_context`` on this stage's pool, once per slot): the
stage's ring layout, the zigzag shard helpers, ``step_wave = j``, ``loss_scale``. Loss scaling is
execute()'s contract unchanged: ``loss_scale = 1 / label tokens of the global batch``, so the
gradients of each stage's parameters summed over that stage's DP x CP axis are the gradients of
the global batch's mean token loss on one process.

Shapes come from the plan, never from a message: a hand-off of slot j on a column of group g
holds the column's zigzag shard of the micro-batch at CP = g.size, padded as the plan contract
pads it (``Topology.memory_tokens``: each sequence to a multiple of 2c, divided by c), times
``activation.hidden``. Megatron-LM, when sequence lengths vary between micro-batches
(``variable_seq_lengths``), exchanges the shapes before every transfer (``_communicate_shapes``
in ``pipeline_parallel/p2p_communication.py``); dyncp knows them all from the plan.

User models: ``chunks`` is this process's sequence of ``pipeline.virtual`` callables (e.g.
``nn.Module``), chunk c holding the layers of virtual stage ``c * P + s``
(``stage_layers(num_layers, pipeline)[q]``), called as ``chunks[c](x, ctx)``: ``x`` is None at
virtual stage 0 (embed the micro-batch's tokens, ``ctx.shard(tokens)``), else the received
hidden states (a leaf requiring grad); every chunk but the last returns hidden states of shape
``(local tokens, hidden)``, the last returns the scaled loss (norm, LM head, cross-entropy of the
labels ``ctx.shard(labels, pad_value=IGNORE)``, times ``ctx.loss_scale``).
``dyncp.testing.tiny_chunks`` cuts the test decoder that way.

What comes from ``torch.distributed.pipelining`` and why the rest does not: its schedules
(``Schedule1F1B``, ``ScheduleInterleaved1F1B``) order the operations exactly as
``dyncp.plan.stage_order`` does for equal micro-batches (the unit tests compare the two on torch's
own per-rank action lists, ``pipeline_order`` / ``_calculate_single_rank_operations``; torch's
IR of Schedule1F1B numbers the last rank's forwards from 1, an off-by-one of the IR only, and
its interleaved order differs when slots == stages, where dyncp takes Megatron's all-forwards
warm-up). Its stages cannot run dyncp's micro-batches: a ``PipelineStage`` fixes its input and
output shapes once (inferred at the first step, or given), and micro-batches of different sizes
are not supported (pytorch issue 126600, closed as "we do not support this"; 159942, open),
while every dyncp micro-batch has its own token count and CP size. So the transfers are built on
``torch.distributed.batch_isend_irecv`` with the plan's shapes.

Deadlock freedom, for every valid plan. A process blocks only (a) waiting for a message it
receives, (b) in a ring collective of the slot's group, inside one operation, and (c) at the
end, waiting for its sends. A send never blocks: it is posted when its operation ends and
waited on only at (c), on a channel of its own (``dyncp.runtime.pipeline_groups``): on gloo a
posted send completes whatever its sender does next, on NCCL it sits alone on its channel's
stream, behind no receive. Facts:

1. Every column of a stage runs the same order ``O_s``, skipping the slots it is idle in, and a
   column idle in slot j is idle there on every stage (the plan's groups describe all stages):
   a message is expected exactly where one is sent.
2. Every channel is received in the order it is sent. Forwards enumerate (slot, chunk) in one
   sequence on every stage, backwards in another (``stage_order``'s enumeration does not
   depend on the stage), and a channel carries one direction out of one stage to a receiver
   that consumes it in the same sequence (the chunk shifted by one where it wraps around);
   skipping idle slots drops the same messages at both ends.
3. The orders admit a schedule: replaying all stages in unit time, an operation running one
   step after its stage's previous operation and its input's operation, runs every operation.
   Call its step t(op): t increases along ``O_s``, and an input is produced at a smaller t.

Facts 2 and 3 are checked, not assumed: ``pipeline_layout.check_orders`` replays the orders and
compares both ends of every channel for each (virtual, slots) before the first operation runs
(once per PipelineGroups; a failing order is a PlanError on every process).

By induction on t, every operation completes on every column that runs it. Assume all
operations of steps below t have; take one of step t on (s, w). The process's previous
operation has a smaller step (3), so the process reaches it. The operation that sends its input
has a smaller step, so that message and every earlier one of its channel have been posted, and
by (2) the receive is matched by exactly that message. Its ring collectives: every member column
of the group runs the same operation at the same place of ``O_s`` (1) and reaches it by the
same argument; a process runs one operation at a time, so all members issue each group's
collectives in one order, and collectives of different groups never wait on each other in
opposite orders (every column issues them in ``O_s``). Finally every posted send is received,
since every operation completes, so (c) returns.

Failures are named as ``execute`` names them, on a failure board spanning the grid
(``PipelineGroups.board``): an operation that raises writes its report (stage, column, operation
and error) and raises :class:`~dyncp.runtime.StepFailed` at once; a process whose receive or ring
times out (or breaks as the failed process exits) reads the board and raises StepFailed naming
the process that raised, not the neighbour it was waiting for. A neighbour learns within the
channel's timeout T; a process k hops away within k T in the worst case.

Timings: :class:`PipelineReport` carries each operation's measured ``start``, ``ready`` (its
input arrived), ``sent`` (its output posted) and ``end`` on this process (``time.perf_counter``
relative to the step's start, after ``synchronize``), and the step's clock origin;
``dyncp.runtime.pipeline_measure`` reads the grid's reports as what calibration learns from and
what a predicted pipelined timeline is compared with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dyncp.control.agreement import PendingAgreement, PlanAgreementError
from dyncp.control.failures import (
    FailureBoard,
    Report,
    is_communication_error,
    name_after_failed_wait,
)
from dyncp.plan import Group, StepPlan, plan_digest
from dyncp.plan.pipeline import FORWARD, PipelineOp, stage_order
from dyncp.runtime.executor import (
    MicroBatchContext,
    StepFailed,
    check_against_pool,
    layout_maker,
    loss_scale,
    microbatch_context,
)
from dyncp.runtime.pipeline_groups import PipelineGroups
from dyncp.runtime.pipeline_layout import Hop, check_orders, route

__all__ = [
    "Activation",
    "Chunk",
    "OpTiming",
    "PipelineReport",
    "execute_pipeline",
]

#: One model chunk of this process: ``chunk(x, ctx)`` (see the module docstring).
Chunk = Callable[[torch.Tensor | None, MicroBatchContext], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class Activation:
    """What crosses a stage boundary: ``(local tokens, hidden)`` of ``dtype`` on ``device``.

    The token count is the plan's (per micro-batch and CP size); these are the model's.
    """

    hidden: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 1:
            raise ValueError(f"Activation hidden must be an integer >= 1, got {self.hidden!r}")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"Activation dtype must be a floating torch.dtype, got {self.dtype!r}")


@dataclass(frozen=True, slots=True)
class OpTiming:
    """One operation as this process ran it: seconds since the step's start (perf_counter).

    ``ready``: when its input had arrived (its receive returned; ``start`` where it receives
    nothing), so ``end - ready`` is the operation's compute (its rings included) and
    ``ready - start`` the wait for its input; ``sent``: when its output was posted to the next
    stage, read just before posting (``end`` where it sends nothing), so a receiver's ``ready``
    is later on the machine's one clock (``dyncp.runtime.pipeline_measure``).
    """

    kind: str
    slot: int
    chunk: int
    cp: int
    start: float
    end: float
    ready: float
    sent: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def compute_seconds(self) -> float:
        return self.end - self.ready


@dataclass(slots=True)
class PipelineReport:
    """One step on one process of the pipeline grid.

    Attributes:
        stage, column: where this process sits.
        ops: every operation it ran (idle slots left out), in order, with measured times.
        losses: the scaled loss of each micro-batch whose last virtual stage ran here
            (detached; empty on other stages), in operation order.
        step_seconds: the whole call; ``busy_seconds``: in operations (receives included).
        origin: the step's start on ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock
            for every process of a machine, so timelines of processes compare there).
        began: seconds after the start when the first operation could run (after the plan
            agreement and the checks).
    """

    stage: int
    column: int
    ops: list[OpTiming] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    step_seconds: float = 0.0
    busy_seconds: float = 0.0
    origin: float = 0.0
    began: float = 0.0


def execute_pipeline(
    plan: StepPlan,
    groups: PipelineGroups,
    chunks: Sequence[Chunk],
    *,
    activation: Activation,
    labels_per_sequence: Sequence[int] | None = None,
    synchronize: Callable[[], None] | None = None,
    agree: bool = True,
    validate: bool = True,
) -> PipelineReport:
    """Run this process's share of a pipelined ``plan`` (see the module docstring).

    Args:
        plan: the step's plan, with ``pipeline`` set (the same on every process).
        groups: the grid's communicators.
        chunks: this process's ``plan.pipeline.virtual`` model chunks, chunk c of virtual
            stage ``c * stages + stage``.
        activation: hidden size, dtype and device of the stage hand-offs.
        labels_per_sequence: label tokens of each sequence (default: length - 1).
        synchronize: called before reading the clock (e.g. ``torch.cuda.synchronize``).
        agree: compare the plan's digest over the grid first.
        validate: check the whole plan against the contract (else this process's groups).

    Raises:
        ValueError: the plan has no pipeline or does not match the grid or the chunks.
        PlanError: the plan breaks the contract or needs a group the stage pool lacks (on
            every process, before any collective but the agreement).
        StepFailed: a process of the grid failed the step (named; see the module docstring).
    """
    pool, stage, column, me = groups.pool, groups.stage, groups.column, groups.position
    if pool is None or stage is None or column is None or me is None:
        raise ValueError("this process is not on the pipeline grid")
    pipe, layout = plan.pipeline, groups.layout
    if pipe is None:
        raise ValueError("this plan has no pipeline stages: run it with execute()")
    if pipe.stages != layout.stages or plan.topology.world != layout.columns:
        raise ValueError(
            f"the plan runs {pipe.stages} stages x {plan.topology.world} columns; the grid is "
            f"{layout.stages} stages x {layout.columns} columns"
        )
    if len(chunks) != pipe.virtual:
        raise ValueError(
            f"the plan gives each process {pipe.virtual} model chunk(s) (virtual stages); "
            f"{len(chunks)} given"
        )
    call_start = time.perf_counter()
    call = groups.calls
    groups.calls += 1
    slots = len(plan.waves)
    groups.last_call = (call, slots)
    board = groups.board(f"p{call}")
    label = f"pipeline call {call}"
    if agree:
        entry, entry_wall = time.monotonic(), time.time()
        try:
            PendingAgreement(
                groups.agreement_group,
                where=(call,),
                digest=plan_digest(plan),
                label=label,
                device=groups.agreement_device,
            ).result()
        except PlanAgreementError as exc:
            culprit = name_after_failed_wait(
                board, -1, me, exc, entered=entry, entered_wall=entry_wall, label=label
            )
            raise StepFailed(culprit.message, culprit.ranks) from exc
    check_against_pool(plan, pool, validate=validate)
    if (pipe.virtual, slots) not in groups.orders_checked:  # the proof's facts 2 and 3
        check_orders(pipe, slots)
        groups.orders_checked.add((pipe.virtual, slots))
    scale = loss_scale(plan, labels_per_sequence)
    run = _StageRun(plan, groups, chunks, activation, scale, board, label)
    report = PipelineReport(stage, column, origin=call_start)
    report.began = time.perf_counter() - call_start
    for op in stage_order(pipe, slots, stage):
        group = run.group_of(op.slot)
        if group is None:
            continue  # idle in this slot: no compute, no message (the column is idle everywhere)
        t0, started = time.perf_counter(), time.monotonic()
        try:
            run.posted = None
            ready = run.operation(op, group, report.losses, synchronize)
            if synchronize is not None:
                synchronize()
        except Exception as exc:
            run.fail(op, exc, started)
        t1 = time.perf_counter()
        report.busy_seconds += t1 - t0
        report.ops.append(
            OpTiming(
                op.kind,
                op.slot,
                op.chunk,
                group.size,
                t0 - call_start,
                t1 - call_start,
                (t0 if ready is None else ready) - call_start,
                (t1 if run.posted is None else run.posted) - call_start,
            )
        )
    started = time.monotonic()
    try:
        for work in run.sends:
            work.wait()
    except Exception as exc:
        run.fail(None, exc, started)
    report.step_seconds = time.perf_counter() - call_start
    return report


class _StageRun:
    """One call's state on this process: its slots' groups and contexts, what the backwards
    need from the forwards, and the sends in flight."""

    def __init__(
        self,
        plan: StepPlan,
        groups: PipelineGroups,
        chunks: Sequence[Chunk],
        activation: Activation,
        scale: float,
        board: FailureBoard,
        label: str,
    ) -> None:
        self.plan, self.groups, self.chunks = plan, groups, chunks
        self.activation, self.scale, self.board, self.label = activation, scale, board, label
        self.stage, self.column = groups.stage, groups.column
        self._groups = [
            next((g for g in wave.groups if g.start <= self.column < g.start + g.size), None)
            for wave in plan.waves
        ]
        self._contexts: dict[int, MicroBatchContext] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.sends: list[dist.Work] = []
        self.posted: float | None = None  # when the current operation posted its send

    def group_of(self, slot: int) -> Group | None:
        return self._groups[slot]

    def context(self, slot: int, group: Group) -> MicroBatchContext:
        ctx = self._contexts.get(slot)
        if ctx is None:
            pool = self.groups.pool
            assert pool is not None
            me = pool.ranks[self.column]
            ctx = microbatch_context(
                self.plan,
                slot,
                group,
                group.microbatches[0],
                self.column - group.start,
                layout_maker(group, pool, me),
                self.scale,
            )
            self._contexts[slot] = ctx
        return ctx

    def shape(self, group: Group, ctx: MicroBatchContext) -> tuple[int, int]:
        """The hand-off's shape, from the plan: this column's padded shard x hidden."""
        tokens = self.plan.topology.memory_tokens(ctx.seqlens, group.size)
        return tokens, self.activation.hidden

    def _receive(self, hop: Hop, shape: tuple[int, int]) -> torch.Tensor:
        a = self.activation
        buf = torch.empty(shape, dtype=a.dtype, device=a.device)
        peer = self.groups.layout.rank(hop.peer_stage, self.column)
        group = self.groups.channel(hop.channel)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, group)]):
            work.wait()
        return buf

    def _send(self, hop: Hop, tensor: torch.Tensor, shape: tuple[int, int], what: str) -> None:
        a = self.activation
        if tuple(tensor.shape) != shape or tensor.dtype != a.dtype:
            raise ValueError(
                f"stage {self.stage} would send {what} of shape {tuple(tensor.shape)} "
                f"({tensor.dtype}); the plan's hand-off is {shape} ({a.dtype}): local zigzag "
                f"shard tokens (padded) x hidden"
            )
        peer = self.groups.layout.rank(hop.peer_stage, self.column)
        group = self.groups.channel(hop.channel)
        op = dist.P2POp(dist.isend, tensor.detach().contiguous(), peer, group)
        self.posted = time.perf_counter()
        self.sends.extend(dist.batch_isend_irecv([op]))

    def operation(
        self,
        op: PipelineOp,
        group: Group,
        losses: list[torch.Tensor],
        synchronize: Callable[[], None] | None = None,
    ) -> float | None:
        """Run ``op``; returns when its input arrived (perf_counter; None: it receives none)."""
        ctx = self.context(op.slot, group)
        shape = self.shape(group, ctx)
        recv, send = route(self.plan.pipeline, self.stage, self.column, op)  # type: ignore[arg-type]
        key = (op.slot, op.chunk)
        received = None if recv is None else self._receive(recv, shape)
        ready = None
        if received is not None:
            if synchronize is not None:
                synchronize()
            ready = time.perf_counter()
        if op.kind == FORWARD:
            x = None if received is None else received.requires_grad_()
            out = self.chunks[op.chunk](x, ctx)
            self._saved[key] = (x, out)
            if send is not None:
                self._send(send, out, shape, "activations")
            else:
                if out.numel() != 1:
                    raise ValueError(
                        f"the last virtual stage must return the micro-batch's scaled loss (one "
                        f"element), got shape {tuple(out.shape)}"
                    )
                losses.append(out.detach())
            return ready
        x, out = self._saved.pop(key)
        if received is None:
            out.backward()
        else:
            out.backward(received)
        if send is not None:
            assert x is not None
            grad = torch.zeros_like(x) if x.grad is None else x.grad
            self._send(send, grad, shape, "gradients")
        return ready

    def fail(self, op: PipelineOp | None, exc: Exception, started: float) -> None:
        """An operation (None: the final wait for sends) raised: report, name, raise."""
        me = self.groups.position
        assert me is not None
        slots = len(self.plan.waves)
        where = (
            "waiting for its sends at the end of the step"
            if op is None
            else f"{'forward' if op.kind == FORWARD else 'backward'} of slot {op.slot} chunk "
            f"{op.chunk}"
        )
        slot = slots if op is None else op.slot
        if is_communication_error(exc):  # a peer failed: wait for the reports, name it
            self.board.report_error(slot, me, exc)
            culprit = self.board.culprit(
                slot,
                suspects=None,
                until=self.board.survivors_until(started),
                label=self.label,
                earlier=range(-1, slots + 1),
            )
            raise StepFailed(culprit.message, culprit.ranks) from exc
        now = time.time()
        message = f"stage {self.stage} column {self.column}, {where}: {type(exc).__name__}: {exc}"
        self.board.report(slot, me, Report("raised", False, now, now, message))
        rank = self.groups.layout.ranks[me]
        raise StepFailed(f"{self.label}: rank {rank} failed in {message}", (rank,)) from exc
