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

Budget (``AlignBudget``): alignment is a stage of the planner's deadline. Every draft but the
wave as it is spends work (its groups) and is drafted only while the budget allows: by a
wall-clock deadline, or by work units alone in deterministic mode, so that the plan is a pure
function of the input. The drafts come most promising first (the chains round robin, highest
pack counts first); waves left when it runs out stay as they are, and a budget spent before the
first wave hands out the input plan, which is valid, priced in lockstep. The choice among drafts
is the same whatever the order they were drafted in (each keeps its rank in a full run).

Speed: drafts share their packs (a move replaces a pack, never changes it in place), and the
input plans' packs and every sequence alone are priced in one vectorised call per group size,
the rest once per set of sequence ids; only the chosen plan is validated.

``align_best`` aligns several plans of one batch (the planner's own and its baselines', built
for another timing) and keeps the best aligned one: a plan that was slower as dataflow can be the
faster in lockstep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dyncp.cost_model import CostModel
from dyncp.cost_model.pass_timing import PassCost, price_passes
from dyncp.cost_model.sharding import ShardingCost
from dyncp.plan import PlanError, PlanStats, StepPlan, padded_length
from dyncp.planner.improvement.pass_moves import WaveDraft

__all__ = [
    "ALIGN_WORK_PER_SECOND",
    "PASSES",
    "TARGETS",
    "AlignBudget",
    "AlignmentReport",
    "align_best",
    "align_passes",
    "aligned_waves",
]

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
    complete: bool = True  # False: the budget ran out (waves or plans left as they were)
    work: int = 0  # work units spent (``AlignBudget``)

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
            "complete": self.complete,
            "work": self.work,
        }


#: Work units (``AlignBudget``: one group of one drafted wave) alignment does per second of
#: its share in deterministic mode, where a clock would make plans differ between ranks:
#: measured by ``bench/fsdp_predict.py --latency`` (medians of 43,283 to 50,122 a second over 5
#: batches at 512 ranks in three runs, on a 2-core machine shared with other jobs), rounded down.
ALIGN_WORK_PER_SECOND = 40_000


@dataclass(slots=True)
class AlignBudget:
    """How much alignment may do: a wall-clock ``deadline`` (``time.perf_counter()`` seconds)
    and/or ``work`` units (a draft of a wave of ``n`` groups costs ``n``: drafting and pricing it
    walk its groups). Not a config: it counts what was spent (``spent``), once exhausted it stays
    so. ``work`` alone (deterministic mode) makes the result a pure function of the input."""

    deadline: float | None = None
    work: int | None = None
    spent: int = 0
    exhausted: bool = False

    def allows(self, cost: int) -> bool:
        """Spend ``cost`` units if the budget allows them; False (and exhausted) if not."""
        if self.exhausted:
            return False
        over_work = self.work is not None and self.spent + cost > self.work
        if over_work or (self.deadline is not None and time.perf_counter() >= self.deadline):
            self.exhausted = True
            return False
        self.spent += cost
        return True


class _Pricer:
    """Seconds of packs (cached, shared by every plan of one batch) and of a wave's passes."""

    def __init__(
        self, lengths: tuple[int, ...], model: CostModel, sharding: ShardingCost | None
    ) -> None:
        self.lengths, self.model, self.sharding = lengths, model, sharding
        self._cache: dict[tuple[int, int, tuple[int, ...]], float] = {}
        self._padded: dict[int, list[int]] = {}

    def __call__(self, size: int, heads: int, ids: tuple[int, ...]) -> float:
        key = (size, heads, ids)
        seconds = self._cache.get(key)
        if seconds is None:
            # A pack's price does not depend on its order: one computation per set of ids
            # (a merge or hand-off rebuilds packs in another order).
            canonical = (size, heads, tuple(sorted(ids)))
            seconds = self._cache.get(canonical)
            if seconds is None and len(ids) == 1:  # a split's or a peel's: every one at once
                self._seed_alone(size, heads)
                seconds = self._cache.get(canonical)
            if seconds is None:
                lengths = [self.lengths[i] for i in canonical[2]]
                split = {"heads": heads} if heads > 1 else {}
                seconds = float(self.model.microbatch_seconds(size, lengths, **split))
                self._cache[canonical] = seconds
            self._cache[key] = seconds
        return seconds

    def seed(self, plan: StepPlan) -> None:
        """Price ``plan``'s packs that are not cached yet, one vectorised call per group size
        and head split (``packs_seconds``): most packs a draft prices are the input's, and one
        call per pack made most of alignment's pricing time."""
        todo: dict[tuple[int, int], dict[tuple[int, ...], None]] = {}
        for wave in plan.waves:
            for g in wave.groups:
                for mb in g.microbatches:
                    ids = tuple(sorted(mb.seq_ids))
                    if ids and (g.size, g.heads, ids) not in self._cache:
                        todo.setdefault((g.size, g.heads), {})[ids] = None
        for (size, heads), packs in todo.items():
            ids = list(packs)
            lengths = np.array([self.lengths[i] for pack in ids for i in pack], dtype=np.int64)
            starts = np.cumsum([0] + [len(pack) for pack in ids[:-1]])
            split = {"heads": heads} if heads > 1 else {}
            seconds = self.model.packs_seconds(size, lengths, starts, **split)  # type: ignore[call-arg]
            for pack, t in zip(ids, seconds.tolist()):
                self._cache[(size, heads, pack)] = t

    def _seed_alone(self, size: int, heads: int) -> None:
        """Every sequence alone on a group of (size, heads), one vectorised call."""
        split = {"heads": heads} if heads > 1 else {}
        lengths = np.asarray(self.lengths, dtype=np.int64)
        seconds = self.model.alone_seconds(size, lengths, **split)  # type: ignore[call-arg]
        for i, t in enumerate(seconds.tolist()):
            self._cache.setdefault((size, heads, (i,)), t)

    def memory(self, size: int) -> list[int]:
        """Each sequence's padded tokens in a group of ``size`` (``dyncp.plan.padding``),
        computed once per size for every draft (``WaveDraft.fits`` sums them)."""
        padded = self._padded.get(size)
        if padded is None:
            padded = self._padded[size] = [padded_length(n, size) for n in self.lengths]
        return padded

    def wave(self, draft: WaveDraft) -> tuple[int, float]:
        """(empty rank-passes, pass-timed seconds) of one wave."""
        busiest = [0.0] * draft.passes()
        for g in draft.groups:
            for p, pack in enumerate(g.packs):
                t = draft.pack_seconds(g, pack)
                if t > busiest[p]:
                    busiest[p] = t
        if self.sharding is not None:
            # ``reduce="once"``: a wave's passes are priced without their reduce-scatter,
            # which only the step's last pass runs (the same in every draft of the last wave).
            scatter = self.sharding.reduce == "every-pass"
            busiest = [self.sharding.pass_seconds(t, scatter=scatter) for t in busiest]
        return draft.empty(), sum(busiest) + self.model.wave_overhead


def _chain(base: WaveDraft, peel: bool) -> Iterator[WaveDraft]:
    """The drafts of one opened wave: rebalanced to ``k`` packs from its pass count down,
    until a ``k`` is not reached (module docstring)."""
    top = base.passes()
    for k in range(top, max(top - TARGETS, 0), -1):
        d = base.copy()
        reached = d.rebalance(k, peel=peel)
        d.drop_unused()
        d.grow()
        d.order_packs()
        yield d
        if not reached:
            return


def _opened(draft: WaveDraft, opening: Callable[[WaveDraft], None]) -> WaveDraft:
    base = draft.copy()
    opening(base)
    return base


def _chains(draft: WaveDraft, budget: AlignBudget, cost: int) -> Iterator[Iterator[WaveDraft]]:
    """The four chains (grow or open idle blocks; halve or peel), each opening drafted once
    and shared by its two chains, within the budget."""
    for opening in (WaveDraft.grow, WaveDraft.open_idle):
        if not budget.allows(cost):
            return
        base = _opened(draft, opening)
        yield _chain(base, False)
        yield _chain(base, True)


def _drafts(draft: WaveDraft, budget: AlignBudget) -> Iterator[tuple[tuple[int, int], WaveDraft]]:
    """The alternatives of one wave, each with its rank among them (the tie-break), most
    promising first while the budget lasts: the wave as it is (free), ordered, then the four
    chains round robin, so that a budget that stops early has tried the highest pack counts --
    the fewest passes -- of every chain. The rank is (chain, step): the order of a full run
    whatever order they are drafted in."""
    yield (0, 0), draft
    cost = max(len(draft.groups), 1)
    if not budget.allows(cost):
        return
    ordered = draft.copy()
    ordered.order_packs()
    yield (0, 1), ordered
    chains = list(enumerate(_chains(draft, budget, cost), start=1))
    step = 0
    while chains:
        live = []
        for c, chain in chains:
            if not budget.allows(cost):
                return
            d = next(chain, None)
            if d is not None:
                yield (c, step), d
                live.append((c, chain))
        chains, step = live, step + 1


def _aligned(plan: StepPlan, pricer: _Pricer, budget: AlignBudget) -> StepPlan:
    """``plan`` with each wave replaced by its best draft within ``budget`` (waves after the
    budget runs out stay as they are)."""
    waves = []
    for wave in plan.waves:
        best_key: tuple | None = None
        best = None
        draft = WaveDraft(wave, plan.topology, plan.lengths, pricer, pricer.memory)
        for rank, d in _drafts(draft, budget):
            key = (*pricer.wave(d), rank)
            if best_key is None or key < best_key:
                best_key, best = key, d
        assert best is not None
        waves.append(best.to_wave())
    return StepPlan(
        plan.topology,
        plan.lengths,
        tuple(waves),
        plan.policy,
        plan.sample_ids,
        PlanStats(dict(plan.stats)),
    )


def aligned_waves(
    plan: StepPlan,
    model: CostModel,
    sharding: ShardingCost | None = None,
    budget: AlignBudget | None = None,
) -> StepPlan:
    """``plan`` with each wave replaced by its best draft, not validated (``align_passes``
    validates it and keeps ``plan`` if it fails; tests call this to see a move's mistakes)."""
    pricer = _Pricer(plan.lengths, model, sharding)
    return _aligned(plan, pricer, AlignBudget() if budget is None else budget)


def _candidates(
    j: int, plan: StepPlan, pricer: _Pricer, budget: AlignBudget
) -> tuple[PassCost, list[tuple[tuple[int, float, int, int], StepPlan, PassCost]]]:
    """``plan``'s lockstep price, and its candidates keyed for ``_choose``: ``plan`` aligned
    within ``budget`` (not validated yet) and ``plan`` itself, which wins only when it is
    strictly faster (the per-wave choice cannot make it so; kept as a guard). A move that
    raises leaves ``plan`` alone, with a warning: alignment never makes the planner fail."""
    model, sharding = pricer.model, pricer.sharding
    before = price_passes(plan, model, sharding)
    out = [((before.empty, before.step_seconds, j, 1), plan, before)]
    if budget.exhausted:  # nothing left to draft with: the input as it is
        return before, out
    pricer.seed(plan)
    try:
        aligned = _aligned(plan, pricer, budget)
    except (PlanError, ValueError, IndexError) as exc:  # a bug in a move
        log.warning("pass alignment failed, keeping the input: %s", exc)
        return before, out
    after = price_passes(aligned, model, sharding)
    out.append(((after.empty, after.step_seconds, j, 0), aligned, after))
    return before, out


def _choose(
    candidates: list[tuple[tuple[int, float, int, int], StepPlan, PassCost]],
) -> tuple[int, StepPlan, PassCost]:
    """The best valid candidate (the fewest empty rank-passes, then seconds, then the earliest
    plan, aligned before not): only the winner is validated, an invalid one (a bug in a move)
    gives way to the next with a warning. An input plan is valid, so one always remains."""
    for (_, _, j, raw), plan, cost in sorted(candidates, key=lambda c: c[0]):
        if not raw:
            try:
                plan.validate()
            except PlanError as exc:
                log.warning("pass alignment produced an invalid plan, keeping the input: %s", exc)
                continue
        return j, plan, cost
    raise AssertionError("an input plan is always a candidate")  # pragma: no cover


def _report(before: PassCost, after: PassCost, budget: AlignBudget) -> AlignmentReport:
    return AlignmentReport(
        passes_before=before.passes,
        passes_after=after.passes,
        empty_before=before.empty,
        empty_after=after.empty,
        seconds_before=before.step_seconds,
        seconds_after=after.step_seconds,
        exposed_seconds_after=after.exposed_seconds,
        complete=not budget.exhausted,
        work=budget.spent,
    )


def align_best(
    plans: list[StepPlan],
    model: CostModel,
    sharding: ShardingCost | None = None,
    budget: AlignBudget | None = None,
) -> tuple[int, StepPlan, AlignmentReport]:
    """The best of ``plans`` (same batch and topology) once each is aligned: the fewest empty
    rank-passes, then the fewest pass-timed seconds, then the earliest. Returns its index, the
    aligned plan and a report against ``plans[0]`` unaligned (the plan the planner would hand
    out without alignment).

    ``budget`` (default: none) bounds the whole: ``plans[0]`` is aligned first, the others while
    the budget lasts; a budget spent before anything was drafted hands out ``plans[0]`` as it
    is, priced in lockstep (always valid). Pack prices are shared by every plan."""
    budget = AlignBudget() if budget is None else budget
    pricer = _Pricer(plans[0].lengths, model, sharding)
    first, candidates = _candidates(0, plans[0], pricer, budget)
    for j, plan in enumerate(plans[1:], start=1):
        if budget.exhausted:
            break
        candidates += _candidates(j, plan, pricer, budget)[1]
    index, plan, after = _choose(candidates)
    return index, plan, _report(first, after, budget)


def align_passes(
    plan: StepPlan,
    model: CostModel,
    sharding: ShardingCost | None = None,
    budget: AlignBudget | None = None,
) -> tuple[StepPlan, AlignmentReport]:
    """``plan`` with its passes aligned as far as the moves (and ``budget``) allow, and what
    that changed.

    Args:
        plan: a valid plan.
        model: prices each micro-batch.
        sharding: prices each pass's collectives (``None``: collectives free).
        budget: bounds the work (default: none); waves left when it runs out stay as they are.
    """
    budget = AlignBudget() if budget is None else budget
    before, candidates = _candidates(0, plan, _Pricer(plan.lengths, model, sharding), budget)
    _, aligned, after = _choose(candidates)
    return aligned, _report(before, after, budget)
