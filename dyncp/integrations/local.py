"""A one-rank step plan run on a process without ``torch.distributed`` (plain ``python train.py``).

    report = execute_local(plan, step_fn)       # plan.topology.world == 1; no process group

Why not :func:`dyncp.runtime.execute` with a ``GroupPool``: the pool's communicators, plan
agreement and failure board are collectives over a process group, and a script started with
plain ``python`` has none. A world-1 plan needs none of them: every group is the one rank with
CP 1 (ring attention without communication), there is no other rank to agree with, to wait for or
to name in a failure, and the step's sums over the DP x CP axis are this rank's own. So nothing
is initialised: creating a default process group behind the user's back would outlive the
training (a later ``init_process_group`` in the same process would fail, and code that branches
on ``dist.is_initialized()`` would take its distributed path).

What ``step_fn`` sees is what ``execute`` gives the same plan on a one-rank pool: the same
:class:`~dyncp.runtime.MicroBatchContext` per micro-batch, in wave order, with the loss scale
``1 / label tokens of the global batch``, and the same :class:`~dyncp.runtime.RankReport`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from dyncp.plan import StepPlan
from dyncp.ring_attention import make_ring_layout
from dyncp.runtime import (
    MicroBatchContext,
    MicroBatchTiming,
    RankReport,
    loss_scale,
    microbatch_context,
)

__all__ = ["execute_local"]


def execute_local(
    plan: StepPlan,
    step_fn: Callable[[MicroBatchContext], object],
    *,
    labels_per_sequence: Sequence[int] | None = None,
    synchronize: Callable[[], None] | None = None,
) -> RankReport:
    """Run every micro-batch of a one-rank ``plan`` on this process, in wave order.

    Args:
        plan: a :class:`~dyncp.plan.StepPlan` for ``world == 1`` (validated here).
        step_fn, labels_per_sequence, synchronize: as in :func:`dyncp.runtime.execute`.

    Raises:
        ValueError: ``plan`` is not a StepPlan for one rank, or the label counts do not fit it.
        PlanError: the plan breaks the contract (``plan.validate()``).
        Exception: whatever ``step_fn`` raises, unchanged (there is no other rank to tell).
    """
    if not isinstance(plan, StepPlan) or plan.topology.world != 1:
        world = plan.topology.world if isinstance(plan, StepPlan) else type(plan).__name__
        raise ValueError(
            f"execute_local runs a StepPlan for one rank (topology.world == 1), got {world}; "
            f"plans for more ranks need torch.distributed and dyncp.runtime.execute"
        )
    start = time.perf_counter()
    plan.validate()
    scale = loss_scale(plan, labels_per_sequence)
    report = RankReport()
    wave_start = start
    for w, wave in enumerate(plan.waves):
        if w:
            wave_start = time.perf_counter()
        for group in wave.groups:  # at most one: the rank itself, CP 1, one head group
            for mb in group.microbatches:
                ctx = microbatch_context(plan, w, group, mb, 0, _local_layout, scale)
                t0 = time.perf_counter()
                step_fn(ctx)
                if synchronize is not None:
                    synchronize()
                seconds = time.perf_counter() - t0
                report.timings.append(MicroBatchTiming(w, 0, 1, mb.seq_ids, ctx.seqlens, seconds))
                report.busy_seconds += seconds
        report.wave_seconds.append(time.perf_counter() - wave_start)
    report.step_seconds = time.perf_counter() - start
    report.idle_seconds = report.step_seconds - report.busy_seconds
    return report


def _local_layout(seqlens: tuple[int, ...]):
    """The ring layout of a whole sequence on one rank (CP 1: no communication)."""
    return make_ring_layout(seqlens=seqlens, cp=1, rank=0)
