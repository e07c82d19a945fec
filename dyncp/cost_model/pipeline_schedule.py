"""Time a pipelined step's operations: the schedule's dependency graph, one vector step per level.

Every column of a stage runs the same operations in the same order (``dyncp.plan.pipeline``), and
the data dependencies are the same for every column: the forward of (slot j, virtual stage q)
needs the forward of (j, q - 1) plus its transfer, the backward of (j, q) the backward of
(j, q + 1) plus its transfer, the last virtual stage's backward its own forward (the loss). So
the graph is built once over (stage, operation) nodes and timed for all columns at once:

    start = max over the group's columns of max(previous op's end, dependency's end + transfer)
    end   = start + seconds

An idle operation (its column in no group of that slot) waits for nothing and takes no time.
Nodes are cut into levels (1 + the later level of their two predecessors); nodes of one level
depend on none of each other, so each level is one gather, one segmented max (``reduceat`` over
the groups' contiguous columns) and one write: about 10 numpy calls a level and 2 x slots x V +
2 x P levels, whatever the column count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dyncp.plan.pipeline import BACKWARD, FORWARD, Pipeline, PipelineOp, stage_order

__all__ = ["PipelineCost", "ScheduleGraph", "StageCosts", "schedule", "schedule_graph"]


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Seconds of every operation of a pipelined plan, before it is scheduled.

    ``forward[j, w, q]`` / ``backward[j, w, q]``: column ``w``'s forward / backward of slot ``j``'s
    micro-batch through virtual stage ``q`` (0 where the column is idle); ``transfer[j, w, q]``:
    moving that micro-batch's activations of column ``w`` from virtual stage ``q - 1`` to ``q``
    (``q = 0``: 0), the backward moving the same bytes from ``q`` back to ``q - 1``;
    ``busy[j, w]``: the column is in a group of slot ``j``; ``segments[j]``: the first column of
    each group of slot ``j`` and of each idle column, increasing (the members of a segment start
    an operation together).
    """

    pipeline: Pipeline
    forward: np.ndarray
    backward: np.ndarray
    transfer: np.ndarray
    busy: np.ndarray
    segments: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        m, w, q = self.forward.shape if self.forward.ndim == 3 else (0, 0, 0)
        if self.forward.ndim != 3 or q != self.pipeline.model_stages:
            raise ValueError(
                f"StageCosts.forward must be (slots, columns, {self.pipeline.model_stages}) "
                f"virtual stages, got shape {self.forward.shape}"
            )
        for name in ("backward", "transfer"):
            if getattr(self, name).shape != (m, w, q):
                raise ValueError(
                    f"StageCosts.{name} has shape {getattr(self, name).shape}; forward has "
                    f"{(m, w, q)}"
                )
        if self.busy.shape != (m, w) or len(self.segments) != m:
            raise ValueError(
                f"StageCosts.busy must be {(m, w)} and segments {m} long, got "
                f"{self.busy.shape} and {len(self.segments)}"
            )
        for j, seg in enumerate(self.segments):
            seg = np.asarray(seg)
            if (
                seg.ndim != 1
                or not len(seg)
                or seg[0] != 0
                or (np.diff(seg) <= 0).any()
                or (seg[-1] >= w)
            ):
                raise ValueError(
                    f"StageCosts.segments[{j}] must start at column 0 and increase strictly "
                    f"below {w} (each group's first column and each idle column), got {seg!r}"
                )
        self.pipeline.check_slots(m)

    @property
    def slots(self) -> int:
        return self.forward.shape[0]

    @property
    def columns(self) -> int:
        return self.forward.shape[1]


@dataclass(frozen=True, slots=True)
class PipelineCost:
    """A pipelined plan's timeline (``price_pipeline``).

    ``ops[s]``: stage ``s``'s operations in order (``stage_order``); ``op_start[s, k, w]`` /
    ``op_end[s, k, w]``: when column ``w`` of stage ``s`` starts / ends ``ops[s][k]`` (an idle
    operation: start = end = the previous operation's end); ``stage_busy_seconds[s, w]``: the
    compute seconds of process (s, w). ``bubble_fraction = 1 - sum(stage_busy_seconds) /
    (step_seconds x P x W)``: the share of the step's process-seconds in which processes compute
    nothing (waiting on the schedule, on a transfer, on a slower group member, or idle in a slot).
    ``compute_seconds``: process-seconds of compute (= sum of stage_busy_seconds);
    ``transfer_seconds``: link-seconds of all activation and gradient transfers.
    """

    step_seconds: float
    bubble_fraction: float
    stage_busy_seconds: np.ndarray
    ops: tuple[tuple[PipelineOp, ...], ...]
    op_start: np.ndarray
    op_end: np.ndarray
    compute_seconds: float
    transfer_seconds: float

    @property
    def stage_busy(self) -> np.ndarray:
        """Each stage's busiest column's compute seconds, shape (P,)."""
        return self.stage_busy_seconds.max(axis=1)


@dataclass(frozen=True, slots=True)
class ScheduleGraph:
    """The schedule of ``pipeline`` over ``slots`` slots as arrays, the same for every column and
    every plan of that slot count (``schedule_graph``; reuse it to price many such plans)."""

    pipeline: Pipeline
    slots: int
    ops: tuple[tuple[PipelineOp, ...], ...]
    node: np.ndarray  # (N, 2): (stage, index) of each node, by level
    bounds: np.ndarray  # level l is nodes bounds[l]:bounds[l + 1]
    prev: np.ndarray  # (N,): node of the previous operation, N: none (a row of zeros)
    dep: np.ndarray  # (N,): node of the data dependency, N: none
    hop: np.ndarray  # (N,): virtual stage whose transfer the dependency pays (0: none)
    slot: np.ndarray  # (N,)
    virtual: np.ndarray  # (N,)
    backward: np.ndarray  # (N,) bool


def schedule_graph(pipeline: Pipeline, slots: int) -> ScheduleGraph:
    """The dependency graph of ``pipeline``'s order over ``slots`` slots, cut into levels."""
    pipeline.check_slots(slots)
    p, nq = pipeline.stages, pipeline.model_stages
    ops = tuple(stage_order(pipeline, slots, s) for s in range(p))
    k = len(ops[0])
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    for s, order in enumerate(ops):
        for i, op in enumerate(order):
            where[(op.kind, op.slot, op.chunk * p + s)] = (s, i)
    dep: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
    for (kind, j, q), at in where.items():
        if kind == FORWARD and q > 0:
            dep[at] = (where[(FORWARD, j, q - 1)], q)
        elif kind == BACKWARD and q == nq - 1:
            dep[at] = (where[(FORWARD, j, q)], 0)  # the loss: same process, no transfer
        elif kind == BACKWARD:
            dep[at] = (where[(BACKWARD, j, q + 1)], q + 1)
    # Levels, walking each stage's order as far as its dependencies allow.
    level: dict[tuple[int, int], int] = {}
    done = [0] * p
    while len(level) < p * k:
        moved = False
        for s in range(p):
            while done[s] < k:
                i = done[s]
                d = dep.get((s, i))
                if d is not None and d[0] not in level:
                    break
                before = level[(s, i - 1)] if i else -1
                level[(s, i)] = 1 + max(before, level[d[0]] if d is not None else -1)
                done[s] += 1
                moved = True
        if not moved:
            raise ValueError(f"the {pipeline.schedule} order over {slots} slots deadlocks")
    nodes = sorted(level, key=lambda n: (level[n], n))
    index = {n: x for x, n in enumerate(nodes)}
    total = len(nodes)
    levels = np.asarray([level[n] for n in nodes], dtype=np.int64)
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(levels)) + 1, [total]])
    prev = np.asarray([index[(s, i - 1)] if i else total for s, i in nodes], dtype=np.int64)
    deps = [dep.get(n) for n in nodes]
    dep_at = np.asarray([index[d[0]] if d else total for d in deps], dtype=np.int64)
    hop = np.asarray([d[1] if d else 0 for d in deps], dtype=np.int64)
    chosen = [ops[s][i] for s, i in nodes]
    return ScheduleGraph(
        pipeline=pipeline,
        slots=slots,
        ops=ops,
        node=np.asarray(nodes, dtype=np.int64).reshape(total, 2),
        bounds=bounds,
        prev=prev,
        dep=dep_at,
        hop=hop,
        slot=np.asarray([op.slot for op in chosen], dtype=np.int64),
        virtual=np.asarray([op.chunk * p + s for op, (s, _) in zip(chosen, nodes)], np.int64),
        backward=np.asarray([op.kind == BACKWARD for op in chosen], dtype=bool),
    )


def schedule(costs: StageCosts, *, graph: ScheduleGraph | None = None) -> PipelineCost:
    """Time the operations of ``costs`` along their schedule (module docstring); ``graph``:
    ``schedule_graph(costs.pipeline, costs.slots)`` made once for many plans."""
    pipeline = costs.pipeline
    m, w = costs.slots, costs.columns
    if graph is None:
        graph = schedule_graph(pipeline, m)
    elif (graph.pipeline, graph.slots) != (pipeline, m):
        raise ValueError(
            f"the graph is of {graph.pipeline} over {graph.slots} slots; the costs are of "
            f"{pipeline} over {m}"
        )
    g = graph
    p = pipeline.stages
    total = len(g.slot)
    k = total // p
    # Per node, every column: seconds, and the transfer its dependency pays (-inf: waits for
    # nothing, the node has no dependency or the column is idle in that slot).
    # Everything below is indexed in operation order (stage-major); ``flat`` maps each node of
    # the level order to its operation, and row ``total`` of ``end`` is "no operation" (ends at 0).
    flat = g.node[:, 0] * k + g.node[:, 1]
    order = np.empty(total, dtype=np.int64)
    order[flat] = np.arange(total)
    slot, virtual = g.slot[order], g.virtual[order]
    nq = pipeline.model_stages
    table = np.concatenate([costs.forward, costs.backward], axis=2).transpose(2, 0, 1)
    op_dur = table.reshape(-1, w)[(g.backward[order] * nq + virtual) * m + slot]
    hops = costs.transfer.transpose(2, 0, 1).reshape(-1, w)[g.hop[order] * m + slot]
    wait = (g.dep[order] < total)[:, None] & costs.busy[slot]
    hop = np.where(wait, hops, -np.inf)
    prev_op = np.append(flat, total)[g.prev]  # per level-ordered node: its predecessors' ops
    dep_op = np.append(flat, total)[g.dep]
    # Segments (groups and idle columns) of every node, as offsets into its level's block.
    counts = np.asarray([len(x) for x in costs.segments], dtype=np.int64)
    firsts = np.concatenate(costs.segments)
    last = np.cumsum(counts) - 1
    lengths = np.diff(np.append(firsts, w))
    lengths[last] = w - firsts[last]
    per_node = counts[g.slot]
    ends = np.cumsum(per_node)
    seg = np.repeat(last[g.slot] - per_node + 1 - ends + per_node, per_node) + np.arange(ends[-1])
    seg_ptr = np.concatenate([[0], ends])
    level_of = np.searchsorted(g.bounds, np.arange(total), "right") - 1
    offset = firsts[seg] + np.repeat((np.arange(total) - g.bounds[level_of]) * w, per_node)
    seg_len = lengths[seg]
    end = np.zeros((total + 1, w))
    op_start = np.empty((total, w))
    for a, b in zip(g.bounds[:-1].tolist(), g.bounds[1:].tolist()):
        ops = flat[a:b]
        ready = np.maximum(end[prev_op[a:b]], end[dep_op[a:b]] + hop[ops])
        x, y = seg_ptr[a], seg_ptr[b]
        together = np.repeat(np.maximum.reduceat(ready.ravel(), offset[x:y]), seg_len[x:y])
        together = together.reshape(b - a, w)
        op_start[ops] = together
        end[ops] = together + op_dur[ops]
    op_end = end[:total]
    busy = op_dur.reshape(p, k, w).sum(axis=1)
    step = float(op_end.max()) if op_end.size else 0.0
    compute = float(busy.sum())
    bubble = 1.0 - compute / (step * p * w) if step > 0 else 0.0
    transfer = 2.0 * float(costs.transfer.sum())  # each hop forward, and its gradient backward
    return PipelineCost(
        step,
        bubble,
        busy,
        g.ops,
        op_start.reshape(p, k, w),
        op_end.reshape(p, k, w),
        compute,
        transfer,
    )
