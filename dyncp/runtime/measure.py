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
from dyncp.plan import PlanSlice, StepPlan
from dyncp.runtime.executor import RankReport
from dyncp.runtime.group_pool import GroupPool

__all__ = [
    "CollectiveCalibration",
    "StoreMeasurements",
    "checked_report",
    "gather_reports",
    "step_measurements",
]


def gather_reports(
    report: RankReport | None, pool: GroupPool, dst: int = 0
) -> list[RankReport | None] | None:
    """Every rank's report, in axis order, on axis position ``dst`` (None elsewhere). Collective."""
    me = pool.position
    out: list[RankReport | None] | None = [None] * pool.world if me == dst else None
    dist.gather_object(report, out, dst=pool.ranks[dst], group=pool.axis_group)
    return out


#: One group of a step as measurements see it: (start, size, heads, each micro-batch's lengths).
_Group = tuple[int, int, int, list[tuple[int, ...]]]


def step_measurements(
    plan: StepPlan | PlanSlice, reports: Sequence[RankReport | None]
) -> tuple[list[Measurement], list[WaveMeasurement]]:
    """Micro-batch and wave measurements of one executed step (``reports`` in axis order).

    Micro-batches of groups split heads x ring (``Group.heads`` > 1) carry their split
    (``Measurement.heads``): the refit learns the head exchange and the attention of 1/u of the
    heads from them (``dyncp.cost_model.calibration.fit``).

    ``plan`` is the whole plan, or (plans read as slices) the gathering rank's slice: then each
    report was checked by the rank that made it against its own slice
    (:func:`checked_report`; None where it did not match), and the step's groups are the ones
    the reports name, each checked to be reported alike by every one of its members.

    Raises:
        ValueError: the reports do not match the plan (another step's, or a failed step's).
    """
    if len(reports) != plan.topology.world:
        raise ValueError(f"{len(reports)} reports for a plan of {plan.topology.world} ranks")
    if any(rep is None for rep in reports):
        bad = [r for r, rep in enumerate(reports) if rep is None]
        raise ValueError(f"the reports of ranks {bad} do not match their slices (a failed step)")
    full: Sequence[RankReport] = reports  # type: ignore[assignment]
    if isinstance(plan, PlanSlice):
        return _measure(_reported_groups(full, len(plan.waves)), full)
    structure = [
        [(g.start, g.size, g.heads, [_lengths(plan, mb.seq_ids) for mb in g.microbatches])
         for g in wave.groups]
        for wave in plan.waves
    ]  # fmt: skip
    return _measure(structure, full)


def checked_report(
    plan: StepPlan | PlanSlice, report: RankReport, position: int
) -> RankReport | None:
    """``report`` if it times exactly this rank's micro-batches of ``plan`` in order, else None
    (what a rank contributes to a gather when plans travel as slices: ``step_measurements``)."""
    expected = [
        (w, g.start, g.size, g.heads, mb.seq_ids, _lengths(plan, mb.seq_ids))
        for w, wave in enumerate(plan.waves)
        for g in wave.groups
        if g.start <= position < g.start + g.size
        for mb in g.microbatches
    ]
    seen = [(t.wave, t.group_start, t.cp, t.heads, t.seq_ids, t.seqlens) for t in report.timings]
    return report if seen == expected else None


def _lengths(plan: StepPlan | PlanSlice, seq_ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(plan.lengths[i]) for i in seq_ids)


def _reported_groups(reports: Sequence[RankReport], waves: int) -> list[list[_Group]]:
    """The step's groups as its members reported them (each report checked by its rank)."""
    groups: dict[tuple[int, int], tuple[int, int, list[tuple[int, ...]]]] = {}
    members: dict[tuple[int, int], list[int]] = {}
    for r, rep in enumerate(reports):
        mine: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        for t in rep.timings:
            key = (t.wave, t.group_start)
            mine.setdefault(key, []).append(t.seqlens)
            if groups.setdefault(key, (t.cp, t.heads, []))[:2] != (t.cp, t.heads):
                raise ValueError(f"wave {t.wave}, group at {t.group_start}: members disagree")
        for key, lengths in mine.items():
            if groups[key][2] and groups[key][2] != lengths:
                raise ValueError(f"wave {key[0]}, group at {key[1]}: members disagree")
            groups[key][2][:] = lengths
            members.setdefault(key, []).append(r)
    out: list[list[_Group]] = [[] for _ in range(waves)]
    for (w, start), (size, heads, lengths) in sorted(groups.items()):
        if members[(w, start)] != list(range(start, start + size)) or not 0 <= w < waves:
            raise ValueError(f"wave {w}, group at {start}: not reported by each of its ranks")
        out[w].append((start, size, heads, lengths))
    return out


def _measure(
    structure: list[list[_Group]], reports: Sequence[RankReport]
) -> tuple[list[Measurement], list[WaveMeasurement]]:
    """Measurements of the step's groups (``structure``) from every rank's timings."""
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
    for w, wave in enumerate(structure):
        busiest = 0.0
        switches: list[float] = []
        for start, size, heads, mbs in wave:
            group_busy = 0.0
            for k, expect in enumerate(mbs):
                key = (w, start, k)
                if lengths.get(key) != expect:
                    raise ValueError(
                        f"wave {w}, group at {start}, micro-batch {k}: no timing for it in "
                        "the reports (a failed step, or reports of another plan)"
                    )
                microbatches.append(Measurement(size, expect, seconds[key], heads))
                group_busy += seconds[key]
            busiest = max(busiest, group_busy)
            gaps = [
                reports[r].wave_seconds[w] - own[r].get(w, 0.0)
                for r in range(start, start + size)
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

    def step(self, step: int, plan: StepPlan | PlanSlice, report: RankReport) -> None:
        """Gather and push one step's measurements; ``plan`` as the sampler gave it (a whole
        plan, or this rank's slice: each rank then checks its own report against it first)."""
        if isinstance(plan, PlanSlice):
            report = checked_report(plan, report, self.pool.position)  # type: ignore[assignment]
        reports = gather_reports(report, self.pool)
        if reports is not None:
            self.channel.push(step, *step_measurements(plan, reports))
