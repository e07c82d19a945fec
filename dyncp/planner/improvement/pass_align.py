"""Pass alignment: a plan's waves rebuilt so that every rank runs a micro-batch in every pass.

Full sharding runs every rank through the same passes (``dyncp.plan.passes``); a rank with
nothing to run in a pass still pays that pass's collectives (an empty pass). ``align_passes``
takes a valid plan and, wave by wave, drafts alternatives with the moves of
``dyncp.planner.improvement.pass_moves``:

- the wave as it is, and with each group's packs ordered most expensive first;
- groups grown into the idle ranks, then every group rebalanced to ``k`` packs, for ``k`` from
  the wave's pass count down (at most ``TARGETS`` values; a ``k`` no merge or hand-off reaches
  ends the descent), splitting packs in halves or peeling one sequence off, then grown again;
- the same with new groups opened on the idle ranks first (so that they take packs from busy
  groups instead of a neighbour growing into them).

Each draft is priced as lockstep passes (``dyncp.cost_model.pass_timing``: the busiest
micro-batch of each pass, plus the collectives ``ShardingCost`` says it cannot hide); the wave
keeps the draft with the fewest empty rank-passes and, among those, the fewest predicted seconds.
Waves are priced apart, because a pass-timed step is the sum of its waves. The draft "as it is"
is always a candidate, so the result never has more empty passes than the input nor, at as many,
more predicted seconds; the aligned plan is validated, and the input is kept if it failed.

``align_best`` aligns several plans of one batch (the planner's own and its baselines', built
for another timing) and keeps the best aligned one: a plan that was slower as dataflow can be the
faster in lockstep.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dyncp.cost_model import CostModel
from dyncp.cost_model.pass_timing import price_passes
from dyncp.cost_model.sharding import ShardingCost
from dyncp.plan import PlanError, PlanStats, StepPlan
from dyncp.planner.improvement.pass_moves import WaveDraft

__all__ = ["PASSES", "TARGETS", "AlignmentReport", "align_best", "align_passes", "aligned_waves"]

log = logging.getLogger(__name__)

#: The planner's ``passes`` option: ``"free"`` (plans as built) or ``"aligned"`` (this module).
PASSES = ("free", "aligned")
#: Pack counts tried per wave, from the wave's pass count down.
TARGETS = 8


@dataclass(frozen=True, slots=True)
class AlignmentReport:
    """What alignment changed: passes, empty rank-passes and pass-timed seconds, before/after."""

    passes_before: int
    passes_after: int
    empty_before: int
    empty_after: int
    seconds_before: float
    seconds_after: float
    exposed_seconds_after: float  # what the collectives add to the aligned plan's compute

    @property
    def cost_seconds(self) -> float:
        """What alignment costs (negative: what it saves) in predicted seconds."""
        return self.seconds_after - self.seconds_before

    def as_dict(self) -> dict[str, Any]:
        return {
            "timing": "passes",
            "passes_before": self.passes_before,
            "passes_after": self.passes_after,
            "empty_before": self.empty_before,
            "empty_after": self.empty_after,
            "seconds_before": self.seconds_before,
            "seconds_after": self.seconds_after,
            "cost_seconds": self.cost_seconds,
            "exposed_seconds_after": self.exposed_seconds_after,
        }


class _Pricer:
    """Seconds of packs (cached) and of a wave's passes."""

    def __init__(self, plan: StepPlan, model: CostModel, sharding: ShardingCost | None) -> None:
        self.lengths, self.model, self.sharding = plan.lengths, model, sharding
        self._cache: dict[tuple[int, int, tuple[int, ...]], float] = {}

    def __call__(self, size: int, heads: int, ids: tuple[int, ...]) -> float:
        key = (size, heads, ids)
        if key not in self._cache:
            lengths = [self.lengths[i] for i in ids]
            split = {"heads": heads} if heads > 1 else {}
            self._cache[key] = float(self.model.microbatch_seconds(size, lengths, **split))
        return self._cache[key]

    def wave(self, draft: WaveDraft) -> tuple[int, float]:
        """(empty rank-passes, pass-timed seconds) of one wave."""
        busiest = [0.0] * draft.passes()
        for g in draft.groups:
            for p, pack in enumerate(g.packs):
                busiest[p] = max(busiest[p], draft.pack_seconds(g, pack))
        if self.sharding is not None:
            busiest = [self.sharding.pass_seconds(t) for t in busiest]
        return draft.empty(), sum(busiest) + self.model.wave_overhead


def _drafts(draft: WaveDraft) -> list[WaveDraft]:
    """The alternatives of one wave (module docstring)."""
    ordered = draft.copy()
    ordered.order_packs()
    out = [draft, ordered]
    for opening in (WaveDraft.grow, WaveDraft.open_idle):
        base = draft.copy()
        opening(base)
        top = base.passes()
        for peel in (False, True):
            for k in range(top, max(top - TARGETS, 0), -1):
                d = base.copy()
                reached = d.rebalance(k, peel=peel)
                d.drop_unused()
                d.grow()
                d.order_packs()
                out.append(d)
                if not reached:
                    break
    return out


def aligned_waves(
    plan: StepPlan, model: CostModel, sharding: ShardingCost | None = None
) -> StepPlan:
    """``plan`` with each wave replaced by its best draft, not validated (``align_passes``
    validates it and keeps ``plan`` if it fails; tests call this to see a move's mistakes)."""
    pricer = _Pricer(plan, model, sharding)
    waves = []
    for wave in plan.waves:
        drafts = _drafts(WaveDraft(wave, plan.topology, plan.lengths, pricer))
        best = min(range(len(drafts)), key=lambda j: (*pricer.wave(drafts[j]), j))
        waves.append(drafts[best].to_wave())
    return StepPlan(
        plan.topology,
        plan.lengths,
        tuple(waves),
        plan.policy,
        plan.sample_ids,
        PlanStats(dict(plan.stats)),
    )


def align_best(
    plans: list[StepPlan], model: CostModel, sharding: ShardingCost | None = None
) -> tuple[int, StepPlan, AlignmentReport]:
    """The best of ``plans`` (same batch and topology) once each is aligned: the fewest empty
    rank-passes, then the fewest pass-timed seconds, then the earliest. Returns its index, the
    aligned plan and a report against ``plans[0]`` unaligned (the plan the planner would hand
    out without alignment)."""
    aligned = [align_passes(p, model, sharding) for p in plans]
    best = min(
        range(len(plans)),
        key=lambda j: (aligned[j][1].empty_after, aligned[j][1].seconds_after, j),
    )
    plan, report = aligned[best]
    first = aligned[0][1]
    report = AlignmentReport(
        passes_before=first.passes_before,
        passes_after=report.passes_after,
        empty_before=first.empty_before,
        empty_after=report.empty_after,
        seconds_before=first.seconds_before,
        seconds_after=report.seconds_after,
        exposed_seconds_after=report.exposed_seconds_after,
    )
    return best, plan, report


def align_passes(
    plan: StepPlan, model: CostModel, sharding: ShardingCost | None = None
) -> tuple[StepPlan, AlignmentReport]:
    """``plan`` with its passes aligned as far as the moves allow, and what that changed.

    Args:
        plan: a valid plan.
        model: prices each micro-batch.
        sharding: prices each pass's collectives (``None``: collectives free).
    """
    aligned = aligned_waves(plan, model, sharding)
    before = price_passes(plan, model, sharding)
    try:
        aligned.validate()
    except PlanError as exc:  # a bug in a move: never hand out an invalid plan
        log.warning("pass alignment produced an invalid plan, keeping the input: %s", exc)
        aligned = plan
    after = price_passes(aligned, model, sharding)
    if (after.empty, after.step_seconds) > (before.empty, before.step_seconds):
        aligned, after = plan, before  # the per-wave choice cannot do this; kept as a guard
    report = AlignmentReport(
        passes_before=before.passes,
        passes_after=after.passes,
        empty_before=before.empty,
        empty_after=after.empty,
        seconds_before=before.step_seconds,
        seconds_after=after.step_seconds,
        exposed_seconds_after=after.exposed_seconds,
    )
    return aligned, report
