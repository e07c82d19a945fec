"""From the processes' timelines of a pipelined step to what calibration learns from.

    reports = gather_pipeline_reports(report, groups)     # collective; the list on grid rank 0
    if reports is not None:
        measured = pipeline_measurement(plan, reports, activation_bytes_per_token=H * 4)

Every process times its operations (``PipelineReport.ops``): when it started waiting for its
input, when the input was there (``ready``) and when it ended. Three readings, each for the
reason given:

- an operation's compute is ``end - ready``, at the group's member that measured least: the
  members of a CP ring run each layer's collectives in lockstep, so an early member's time
  includes its wait for the last one, who measured the operation alone (as
  ``dyncp.runtime.measure`` reads the unpipelined runtime's micro-batches);
- the step is the grid's wall clock, first operation to last completed send
  (``time.perf_counter`` is one monotonic clock for every process of a machine; across
  machines, clocks are not compared and the longest process's own span is taken instead);
- a hand-off's transfer is ``ready - the sender's post`` (``OpTiming.sent``) where the receiver
  was already waiting when the send was posted (otherwise the message may have sat there: no
  reading).

:func:`pipeline_measurement` returns a torch-free
:class:`~dyncp.cost_model.calibration.pipeline.PipelineStepMeasurement`, which
``calibrate_pipeline`` refits a profile from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch.distributed as dist

from dyncp.cost_model.calibration.measurements import Measurement
from dyncp.cost_model.calibration.pipeline import HopMeasurement, PipelineStepMeasurement
from dyncp.plan import StepPlan
from dyncp.plan.pipeline import BACKWARD, FORWARD
from dyncp.runtime.pipeline import OpTiming, PipelineReport
from dyncp.runtime.pipeline_groups import PipelineGroups

__all__ = ["gather_pipeline_reports", "pipeline_measurement"]


def gather_pipeline_reports(
    report: PipelineReport, groups: PipelineGroups, dst: int = 0
) -> list[PipelineReport] | None:
    """Every process's report (losses left out), in grid order, on grid position ``dst`` (None
    elsewhere). Collective over the grid."""
    me, ranks = groups.position, groups.layout.ranks
    if me is None:
        raise ValueError("this process is not on the pipeline grid")
    out: list[PipelineReport] | None = [None] * len(ranks) if me == dst else None  # type: ignore[list-item]
    light = dataclasses.replace(report, losses=[])
    dist.gather_object(light, out, dst=ranks[dst], group=groups.control_group)
    return out


def pipeline_measurement(
    plan: StepPlan,
    reports: Sequence[PipelineReport],
    *,
    activation_bytes_per_token: float,
    same_clock: bool = True,
) -> PipelineStepMeasurement:
    """One executed pipelined step of ``plan`` measured from every process's ``reports``
    (module docstring); ``activation_bytes_per_token``: hidden size x dtype bytes of a
    hand-off; ``same_clock``: all processes on one machine (their clocks compare).

    Raises:
        ValueError: the plan has no pipeline, or the reports do not cover its grid and its
            operations (another step's, or a failed step's).
    """
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("pipeline_measurement reads pipelined steps; this plan has pipeline=None")
    p, w, m, nq = pipe.stages, plan.topology.world, len(plan.waves), pipe.model_stages
    by_place = {(r.stage, r.column): r for r in reports}
    if len(reports) != p * w or len(by_place) != p * w:
        raise ValueError(
            f"{len(reports)} reports of {len(by_place)} distinct processes for a grid of {p} "
            f"stages x {w} columns"
        )
    # (kind, slot, virtual stage, column) -> the operation as that process timed it
    ops: dict[tuple[str, int, int, int], tuple[PipelineReport, OpTiming]] = {}
    for rep in reports:
        for op in rep.ops:
            ops[(op.kind, op.slot, op.chunk * p + rep.stage, rep.column)] = (rep, op)
    groups = [(j, g) for j, wave in enumerate(plan.waves) for g in wave.groups]
    expected = sum(g.size for _, g in groups) * 2 * nq
    if len(ops) != expected:
        raise ValueError(
            f"the reports hold {len(ops)} operations; the plan runs {expected} (a failed step, "
            "or reports of another plan)"
        )
    compute = {k: np.zeros((m, w, nq)) for k in (FORWARD, BACKWARD)}
    microbatches: list[Measurement] = []
    for j, g in groups:
        cols = range(g.start, g.start + g.size)
        for kind, table in compute.items():
            for q in range(nq):
                try:
                    least = min(ops[(kind, j, q, c)][1].compute_seconds for c in cols)
                except KeyError:
                    raise ValueError(
                        f"slot {j}, group at column {g.start}: no {kind} of virtual stage {q} in "
                        "the reports (a failed step, or reports of another plan)"
                    ) from None
                table[j, g.start : g.start + g.size, q] = max(least, 0.0)
        lengths = tuple(plan.lengths[i] for i in g.microbatches[0].seq_ids)
        seconds = float(compute[FORWARD][j, g.start].sum() + compute[BACKWARD][j, g.start].sum())
        microbatches.append(Measurement(g.size, lengths, seconds, g.heads))
    busy = np.zeros((p, w))
    for q in range(nq):
        busy[q % p] += (compute[FORWARD][:, :, q] + compute[BACKWARD][:, :, q]).sum(axis=0)
    if same_clock:
        first = min(r.origin + r.began for r in reports)
        step = max(r.origin + r.step_seconds for r in reports) - first
    else:
        step = max(r.step_seconds - r.began for r in reports)
    hops = _hops(plan, ops, activation_bytes_per_token) if same_clock else ()
    return PipelineStepMeasurement(
        forward=compute[FORWARD],
        backward=compute[BACKWARD],
        busy=busy,
        step_seconds=float(step),
        microbatches=tuple(microbatches),
        hops=hops,
    )


def _hops(
    plan: StepPlan,
    ops: dict[tuple[str, int, int, int], tuple[PipelineReport, OpTiming]],
    bytes_per_token: float,
) -> tuple[HopMeasurement, ...]:
    """The hand-offs whose receiver was waiting when the send was posted (module docstring)."""
    nq = plan.pipeline.model_stages  # type: ignore[union-attr]
    out = []
    for j, wave in enumerate(plan.waves):
        for g in wave.groups:
            lengths = [plan.lengths[i] for i in g.microbatches[0].seq_ids]
            size = plan.topology.memory_tokens(lengths, g.size) * bytes_per_token
            for c in range(g.start, g.start + g.size):
                for kind, q, sender in [(FORWARD, q, q - 1) for q in range(1, nq)] + [
                    (BACKWARD, q, q + 1) for q in range(nq - 1)
                ]:
                    rep, op = ops[(kind, j, q, c)]
                    src, sent = ops[(kind, j, sender, c)]
                    sent_at = src.origin + sent.sent
                    if rep.origin + op.start < sent_at < rep.origin + op.ready:
                        out.append(HopMeasurement(float(size), rep.origin + op.ready - sent_at))
    return tuple(out)
