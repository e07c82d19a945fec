"""Where each process of a pipelined job sits, and whom each pipeline operation talks to.

A pipelined plan (``dyncp.plan.pipeline``) runs on ``stages x columns`` processes: ``columns`` is
the plan's ``topology.world`` (the DP x CP axis, the same on every stage) and every stage has its
own copy of it. :class:`PipelineLayout` says which global rank is (stage, column); by default
**stage-major**, ``rank = stage * columns + column`` (the first ``columns`` ranks are stage 0),
so that one stage's columns are consecutive ranks: with ``ranks_per_node`` columns per node a
stage's CP rings stay inside nodes and only stage-to-stage sends cross them.

Routing (:func:`route`) is the one rule of the hand-off: the forward of virtual stage
``q = chunk * stages + stage`` receives its input from virtual stage ``q - 1`` and sends its
output to ``q + 1``, the backward the other way round, always on the *same column* (a column's
zigzag shard is the same on every stage, so activations never change hands inside a stage).
Messages travel on *channels*: one per (direction, sending stage, column), so that a channel's
messages are received in the order they were sent (see ``dyncp.runtime.pipeline`` for why that
order is the same on both ends). Torch-free on purpose: the ordering facts are checked in one
process by the unit tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dyncp.plan.errors import PlanError
from dyncp.plan.pipeline import BACKWARD, FORWARD, Pipeline, PipelineOp, stage_order

__all__ = [
    "DIRECTIONS",
    "Channel",
    "Hop",
    "PipelineLayout",
    "channel_messages",
    "check_orders",
    "replay_steps",
    "route",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineLayout:
    """The process grid of a pipelined job: ``stages`` x ``columns`` processes.

    Args:
        stages: pipeline stages P (the plan's ``pipeline.stages``).
        columns: positions on each stage's DP x CP axis (the plan's ``topology.world``).
        ranks: global rank of each (stage, column), stage-major: ``ranks[stage * columns +
            column]``; default ``range(stages * columns)`` (rank = stage * columns + column).

    Raises:
        ValueError: a count below 1, or ranks that are not ``stages * columns`` distinct
            non-negative integers.
    """

    stages: int
    columns: int
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, value in (("stages", self.stages), ("columns", self.columns)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineLayout {name} must be an integer >= 1, got {value!r}")
        n = self.stages * self.columns
        ranks = tuple(range(n)) if not self.ranks else tuple(self.ranks)
        if (
            len(ranks) != n
            or len(set(ranks)) != n
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)
        ):
            raise ValueError(
                f"PipelineLayout ranks must be {n} distinct global ranks >= 0 (stages "
                f"{self.stages} x columns {self.columns}, stage-major), got {list(self.ranks)}"
            )
        object.__setattr__(self, "ranks", ranks)

    @property
    def size(self) -> int:
        """Processes in the grid."""
        return self.stages * self.columns

    def rank(self, stage: int, column: int) -> int:
        """Global rank of (stage, column)."""
        if not (0 <= stage < self.stages and 0 <= column < self.columns):
            raise ValueError(
                f"(stage {stage}, column {column}) is outside the grid of {self.stages} stages x "
                f"{self.columns} columns"
            )
        return self.ranks[stage * self.columns + column]

    def place(self, rank: int) -> tuple[int, int]:
        """(stage, column) of a global rank."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in the pipeline grid {list(self.ranks)}")
        return divmod(self.ranks.index(rank), self.columns)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks of one stage's DP x CP axis, in column order (its GroupPool's ranks)."""
        return tuple(self.rank(stage, w) for w in range(self.columns))


@dataclass(frozen=True, slots=True)
class Channel:
    """Messages of one direction (``"F"``: activations, ``"B"``: their gradients) sent by
    ``stage`` on ``column`` to the next (F) or previous (B) stage, wrapping around when
    interleaved."""

    kind: Literal["F", "B"]
    stage: int
    column: int


@dataclass(frozen=True, slots=True)
class Hop:
    """One message of an operation: on ``channel``, to or from ``peer_stage`` (same column),
    for the operation ``(kind, slot)`` of virtual stage ``peer_chunk * stages + peer_stage``."""

    channel: Channel
    peer_stage: int
    peer_chunk: int


def route(pipeline: Pipeline, stage: int, column: int, op: PipelineOp) -> tuple[Hop | None, ...]:
    """``(receive, send)`` of ``op`` on (stage, column): where its input comes from and where
    its output goes (None: the embedding's input is data, the head's output is the loss)."""
    p, last = pipeline.stages, pipeline.model_stages - 1
    q = op.chunk * p + stage
    step = 1 if op.kind == FORWARD else -1
    src, dst = q - step, q + step  # input from src, output to dst
    recv = send = None
    if 0 <= src <= last:
        s, c = src % p, src // p
        recv = Hop(Channel(op.kind, s, column), s, c)
    if 0 <= dst <= last:
        s, c = dst % p, dst // p
        send = Hop(Channel(op.kind, stage, column), s, c)
    return recv, send


def channel_messages(
    pipeline: Pipeline,
    slots: int,
    *,
    columns: int = 1,
    idle: Sequence[frozenset[int]] = (),
    orders: Sequence[Sequence[PipelineOp]] | None = None,
) -> tuple[dict[Channel, list[tuple[int, int]]], dict[Channel, list[tuple[int, int]]]]:
    """Every channel's messages as its sender sends them and as its receiver receives them, in
    each one's operation order: ``(slot, chunk of the receiving operation)``. ``idle[j]``: the
    columns idle in slot j (no operation, no message). The runtime is correct only if the two
    lists of every channel are equal (received in the order sent): :func:`check_orders`.
    ``orders``: each stage's operations (default: ``stage_order``'s)."""
    sent: dict[Channel, list[tuple[int, int]]] = {}
    received: dict[Channel, list[tuple[int, int]]] = {}
    for stage in range(pipeline.stages):
        order = stage_order(pipeline, slots, stage) if orders is None else orders[stage]
        for op in order:
            for column in range(columns):
                if idle and column in idle[op.slot]:
                    continue
                recv, send = route(pipeline, stage, column, op)
                if send is not None:
                    sent.setdefault(send.channel, []).append((op.slot, send.peer_chunk))
                if recv is not None:
                    received.setdefault(recv.channel, []).append((op.slot, op.chunk))
    return sent, received


def replay_steps(
    pipeline: Pipeline, slots: int, orders: Sequence[Sequence[PipelineOp]] | None = None
) -> list[list[int]] | None:
    """Replay every stage's order in unit time, an operation running one step after its
    input's operation and its stage's previous one (the forward of virtual stage q after q - 1's,
    the backward after q + 1's and after its own forward). Returns each operation's step, per
    stage in order, or None when the replay stops short: the orders would deadlock."""
    p, last = pipeline.stages, pipeline.model_stages - 1
    if orders is None:
        orders = [stage_order(pipeline, slots, s) for s in range(p)]
    done: set[tuple[str, int, int]] = set()  # (kind, slot, virtual stage)
    steps: list[list[int]] = [[] for _ in range(p)]
    step = 0
    while any(len(steps[s]) < len(orders[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if len(steps[s]) == len(orders[s]):
                continue
            op = orders[s][len(steps[s])]
            q = op.chunk * p + s
            if op.kind == FORWARD:
                ok = q == 0 or (FORWARD, op.slot, q - 1) in done
            else:
                ok = (FORWARD, op.slot, q) in done and (
                    q == last or (BACKWARD, op.slot, q + 1) in done
                )
            if ok:
                ready.append((s, (op.kind, op.slot, q)))
        if not ready:
            return None
        for s, key in ready:
            done.add(key)
            steps[s].append(step)
        step += 1
    return steps


def check_orders(
    pipeline: Pipeline, slots: int, orders: Sequence[Sequence[PipelineOp]] | None = None
) -> None:
    """Raise PlanError (rule ``"pipeline-order"``) unless the stages' orders run every
    operation once without deadlock (:func:`replay_steps`) and every channel is received in the
    order it is sent (:func:`channel_messages`): the two facts the pipeline runtime's
    deadlock-freedom proof rests on (``dyncp.runtime.pipeline``)."""
    if orders is None:
        orders = [stage_order(pipeline, slots, s) for s in range(pipeline.stages)]
    want = sorted((k, j, c) for k in (FORWARD, BACKWARD) for j in range(slots)
                  for c in range(pipeline.virtual))  # fmt: skip
    for s, order in enumerate(orders):
        if sorted((o.kind, o.slot, o.chunk) for o in order) != want:
            raise PlanError(
                "pipeline-order",
                f"stage {s} does not run every forward and backward of {slots} slots x "
                f"{pipeline.virtual} chunk(s) exactly once",
            )
    if replay_steps(pipeline, slots, orders) is None:
        raise PlanError(
            "pipeline-order",
            f"the operation orders of {pipeline.stages} stages x {pipeline.virtual} virtual "
            f"over {slots} slots deadlock: some stage waits for an operation that waits for it",
        )
    sent, received = channel_messages(pipeline, slots, orders=orders)
    wrong = sorted(
        (c for c in set(sent) | set(received) if sent.get(c) != received.get(c)),
        key=lambda c: (c.kind, c.stage, c.column),
    )
    if wrong:
        raise PlanError(
            "pipeline-order",
            f"channel {wrong[0]} would deliver its messages out of the order its receiver "
            f"expects them",
        )


#: The two directions, for readers that iterate over them.
DIRECTIONS = (FORWARD, BACKWARD)
