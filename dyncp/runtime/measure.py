"""From what every rank measured to what the cost model can learn from.

    reports = gather_reports(report, pool)                 # collective; the list on rank 0
    if reports is not None:
        microbatches, waves = step_measurements(plan, reports)

Each rank times its own micro-batches (``RankReport.timings``). The runtime is dataflow: a group's
members arrive at different times and its first collective holds the early ones until the last
is there, so an early member's timing includes that wait. Every member's micro-batch ends
together (the ring's collectives run in lockstep to its last step, a straggler included), so
the member that started last measured the micro-batch alone: the measurement is the *minimum*
over the group's ranks. The same reasoning gives a group's switching cost (what the cost model
charges as ``wave_overhead`` once per group): a member's wave wall clock minus its own
micro-batches, at the member that waited least. A wave's measurement is its slowest group's
busy time plus the median switching cost of its groups.

:class:`CollectiveCalibration` closes the loop without a plan service: at the end of a step every
rank calls ``step()``; rank 0 refits (an :class:`~dyncp.cost_model.calibration.OnlineCalibrator`)
and a broadcast hands the adopted model version to every rank in the same call, so all ranks switch
models at the same step boundary and their deterministic planners keep producing one plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch.distributed as dist

from dyncp.control.model_channel import MeasurementChannel
from dyncp.cost_model.calibration.fit import Measurement, WaveMeasurement
from dyncp.cost_model.calibration.online import ModelVersion, OnlineCalibrator
from dyncp.plan import StepPlan
from dyncp.runtime.executor import RankReport
from dyncp.runtime.group_pool import GroupPool

__all__ = [
    "CollectiveCalibration",
    "StoreMeasurements",
    "gather_reports",
    "step_measurements",
]


def gather_reports(report: RankReport, pool: GroupPool, dst: int = 0) -> list[RankReport] | None:
    """Every rank's report, in axis order, on axis position ``dst`` (None elsewhere). Collective."""
    me = pool.position
    out: list[RankReport] | None = [None] * pool.world if me == dst else None  # type: ignore[list-item]
    dist.gather_object(report, out, dst=pool.ranks[dst], group=pool.axis_group)
    return out


def step_measurements(
    plan: StepPlan, reports: Sequence[RankReport]
) -> tuple[list[Measurement], list[WaveMeasurement]]:
    """Micro-batch and wave measurements of one executed step (``reports`` in axis order).

    Micro-batches of groups split heads x ring (``Group.heads`` > 1) carry their split
    (``Measurement.heads``): the refit learns the head exchange and the attention of 1/u of the
    heads from them (``dyncp.cost_model.calibration.fit``).

    Raises:
        ValueError: the reports do not match the plan (another step's, or a failed step's).
    """
    if len(reports) != plan.topology.world:
        raise ValueError(f"{len(reports)} reports for a plan of {plan.topology.world} ranks")
    seconds: dict[tuple[int, int, int], float] = {}
    lengths: dict[tuple[int, int, int], tuple[int, ...]] = {}
    own: list[dict[int, float]] = []  # per rank: its own micro-batch seconds per wave
    for rep in reports:
        seen: dict[tuple[int, int], int] = {}
        mine: dict[int, float] = {}
        for t in rep.timings:
            k = seen.get((t.wave, t.group_start), 0)
            seen[(t.wave, t.group_start)] = k + 1
            key = (t.wave, t.group_start, k)
            # Minimum over the group's ranks: the last to arrive did not wait (module docstring).
            seconds[key] = min(seconds.get(key, t.seconds), t.seconds)
            lengths[key] = t.seqlens
            mine[t.wave] = mine.get(t.wave, 0.0) + t.seconds
        own.append(mine)
    microbatches: list[Measurement] = []
    waves: list[WaveMeasurement] = []
    for w, wave in enumerate(plan.waves):
        busiest = 0.0
        switches: list[float] = []
        for g in wave.groups:
            group_busy = 0.0
            for k, mb in enumerate(g.microbatches):
                key = (w, g.start, k)
                expect = tuple(plan.lengths[i] for i in mb.seq_ids)
                if lengths.get(key) != expect:
                    raise ValueError(
                        f"wave {w}, group at {g.start}, micro-batch {k}: no timing for it in "
                        "the reports (a failed step, or reports of another plan)"
                    )
                microbatches.append(Measurement(g.size, expect, seconds[key], g.heads))
                group_busy += seconds[key]
            busiest = max(busiest, group_busy)
            gaps = [
                reports[r].wave_seconds[w] - own[r].get(w, 0.0)
                for r in range(g.start, g.start + g.size)
                if w < len(reports[r].wave_seconds)
            ]
            if gaps:
                switches.append(max(min(gaps), 0.0))
        switch = float(np.median(switches)) if switches else 0.0
        waves.append(WaveMeasurement(busiest + switch, busiest))
    return microbatches, waves


class CollectiveCalibration:
    """Online calibration inside the training loop, kept identical on every rank.

    Args:
        pool: the job's GroupPool (its DP x CP axis).
        calibrator: the calibrator; used on axis position 0 only (pass the same construction
            on every rank, it is cheap).
        dst: axis position that refits.

    Every rank must call :meth:`step` after every executed step (it is collective).
    """

    def __init__(self, pool: GroupPool, calibrator: OnlineCalibrator, dst: int = 0) -> None:
        self.pool = pool
        self.calibrator = calibrator
        self.dst = dst
        self.current: ModelVersion = calibrator.current

    @property
    def is_fitter(self) -> bool:
        return self.pool.position == self.dst

    def step(self, plan: StepPlan, report: RankReport) -> ModelVersion | None:
        """Gather this step's timings, maybe refit; the new version on every rank, or None."""
        reports = gather_reports(report, self.pool, self.dst)
        payload: list[str | None] = [None]
        if reports is not None:
            mbs, waves = step_measurements(plan, reports)
            new = self.calibrator.observe(mbs, waves)
            payload[0] = None if new is None else new.to_json()
        src = self.pool.ranks[self.dst]
        dist.broadcast_object_list(payload, src=src, group=self.pool.axis_group)
        if payload[0] is None:
            return None
        self.current = ModelVersion.from_json(payload[0])
        return self.current


class StoreMeasurements:
    """The trainers' side of calibration with a plan service: push each step's measurements.

    Every rank calls :meth:`step` after every executed step (it gathers, a collective); axis
    position 0 pushes the step's micro-batch and wave measurements to the Store, where the
    calibrating plan service (``DynamicCPSampler(calibrate=...)`` on the serving rank, or
    ``python -m dyncp.service --calibrate``) drains them.
    """

    def __init__(self, pool: GroupPool, channel: MeasurementChannel) -> None:
        self.pool = pool
        self.channel = channel

    def step(self, step: int, plan: StepPlan, report: RankReport) -> None:
        reports = gather_reports(report, self.pool)
        if reports is not None:
            self.channel.push(step, *step_measurements(plan, reports))
