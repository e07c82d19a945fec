"""Pipeline parallelism in the plan: stages, virtual stages, and the order every stage runs.

Under pipeline parallelism (PP) the model's layers are cut into ``stages`` consecutive stages,
and each stage has its own copy of the data-parallel x context-parallel axis: the plan's ``world``
ranks (its *columns*) exist once per stage, ``world x stages`` processes in all. A micro-batch's CP
group must be the same columns on every stage (stage ``s`` hands column ``w``'s activations to
column ``w`` of stage ``s + 1``, and the zigzag shard a column holds is the same on every stage), so
the plan's groups describe all stages at once.

A pipelined plan reads its waves as **slots**: wave ``j`` is the ``j``-th micro-batch of every
pipeline column, and every group in it holds exactly one micro-batch; a column outside every group
of a slot is *idle* there (its forward and backward of that slot do nothing). Slots are what the
schedule orders, so the plan's wave order *is* each column's micro-batch order, and a group that
spans several columns has its micro-batch at the same slot in each of their schedules by
construction: every column runs the same sequence of operations (:func:`stage_order`), so the
ring of a group meets its members at the same operation.

Schedules (the operation order of one stage over ``M`` slots)::

    "1f1b"         virtual = 1: stage s runs min(P - s - 1, M) forwards (warm-up), then
                   alternates one forward and one backward, then the remaining backwards
    "interleaved"  virtual = V > 1: each rank holds V model chunks (chunk c of rank s is
                   virtual stage c*P + s of V*P); forwards take slots in groups of P through
                   the chunks in order, backwards through the chunks in reverse; warm-up
                   (P - s - 1) * 2 + (V - 1) * P forwards; M must be a multiple of P

These are the schedules of Megatron-Core (``forward_backward_pipelining_without_interleaving``
and ``..._with_interleaving``) and of ``torch.distributed.pipelining``'s ``Schedule1F1B`` and
``ScheduleInterleaved1F1B`` for equal micro-batches; written here without torch so that the
cost model and the planner (torch-free) price the order the runtime runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dyncp.plan.errors import PlanError

__all__ = [
    "FORWARD",
    "BACKWARD",
    "SCHEDULES",
    "Pipeline",
    "PipelineOp",
    "stage_layers",
    "stage_order",
]

FORWARD: Literal["F"] = "F"
BACKWARD: Literal["B"] = "B"
SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True, slots=True)
class Pipeline:
    """``stages`` pipeline stages (P), each rank holding ``virtual`` model chunks (V).

    ``virtual = 1`` runs 1F1B, ``virtual > 1`` interleaved 1F1B (which needs ``stages >= 2``).
    """

    stages: int
    virtual: int = 1

    def __post_init__(self) -> None:
        for name, value in (("stages", self.stages), ("virtual", self.virtual)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(
                    "pipeline", f"pipeline {name} must be an integer >= 1, got {value!r}"
                )
        if self.virtual > 1 and self.stages < 2:
            raise PlanError(
                "pipeline",
                f"virtual stages ({self.virtual}) need at least 2 pipeline stages, got "
                f"{self.stages}",
            )

    @property
    def schedule(self) -> str:
        """``"1f1b"`` or ``"interleaved"``."""
        return "1f1b" if self.virtual == 1 else "interleaved"

    @property
    def model_stages(self) -> int:
        """Virtual stages the model is cut into (``stages x virtual``)."""
        return self.stages * self.virtual

    def slot_multiple(self) -> int:
        """The slot count must be a multiple of this (``stages`` when interleaved, else 1)."""
        return self.stages if self.virtual > 1 else 1

    def check_slots(self, slots: int) -> None:
        """Raise PlanError (rule ``"pipeline-count"``) unless ``slots`` suits the schedule."""
        if slots < 1:
            raise PlanError("pipeline-count", "a pipelined plan needs at least one slot")
        k = self.slot_multiple()
        if slots % k:
            raise PlanError(
                "pipeline-count",
                f"interleaved 1F1B over {self.stages} stages needs a slot count that is a "
                f"multiple of {k}; the plan has {slots} slots",
            )

    def to_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "virtual": self.virtual}


def stage_layers(layers: int, pipeline: Pipeline) -> tuple[int, ...]:
    """Layers of each virtual stage ``q = chunk * stages + stage`` (``model_stages`` of them):
    an even split, the first ``layers % model_stages`` virtual stages taking one more. The
    embedding sits before virtual stage 0 and the head (norm, LM head, loss) after the last; the
    runtime cuts the model and the cost model prices the stages by this one rule."""
    n = pipeline.model_stages
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < n:
        raise PlanError(
            "pipeline",
            f"{pipeline.stages} stages x {pipeline.virtual} virtual stages need at least {n} "
            f"layers (one per virtual stage), got {layers!r}",
        )
    base, extra = divmod(layers, n)
    return tuple(base + (1 if q < extra else 0) for q in range(n))


@dataclass(frozen=True, slots=True)
class PipelineOp:
    """One operation of a stage: the forward (``"F"``) or backward (``"B"``) of ``slot``'s
    micro-batch through the rank's model chunk ``chunk`` (virtual stage ``chunk * P + stage``)."""

    kind: Literal["F", "B"]
    slot: int
    chunk: int = 0


def stage_order(pipeline: Pipeline, slots: int, stage: int) -> tuple[PipelineOp, ...]:
    """The operations pipeline stage ``stage`` runs over ``slots`` slots, in order (module
    docstring). Every column of a stage runs this same order."""
    p, v = pipeline.stages, pipeline.virtual
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < p:
        raise PlanError("pipeline", f"stage {stage!r} is not one of 0..{p - 1}")
    pipeline.check_slots(slots)
    total = slots * v
    if v == 1:
        warmup = min(p - stage - 1, slots)
    elif slots == p:
        warmup = total  # every forward first (Megatron: all-warm-up when M == P)
    else:
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)

    def op(kind: Literal["F", "B"], k: int) -> PipelineOp:
        if v == 1:
            return PipelineOp(kind, k, 0)
        group, within = divmod(k, p * v)
        chunk = within // p
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return PipelineOp(kind, group * p + within % p, chunk)

    ops = [op(FORWARD, k) for k in range(warmup)]
    for j in range(total - warmup):
        ops.append(op(FORWARD, warmup + j))
        ops.append(op(BACKWARD, j))
    ops += [op(BACKWARD, k) for k in range(total - warmup, total)]
    return tuple(ops)
