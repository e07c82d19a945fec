"""Structured candidates of the greedy constructor: the best structures found, realised.

The structure search (``structure``: waves, groups and CP sizes of the long sequences, priced
with a fluid model) runs from several starts; the best structures are realised by pouring
(``pouring``), searched again with the short sequences the best one has no room for, or that its
realisation left above a wave's fluid level (``overshoot``), placed as long ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan
from dyncp.planner.construction.fluid import Structure
from dyncp.planner.construction.pouring import Pouring
from dyncp.planner.construction.stretch import StretchCandidates
from dyncp.planner.construction.structure import StructureSearch

__all__ = ["StructuredCandidates"]

# Floors tried as structure-search starts, as multiples of the ideal step.
FLOOR_FACTORS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Column packing levels tried as structure-search starts, as multiples of the ideal step, and the
# extra rank-seconds (share) a long sequence may cost to be stacked on an existing group.
COLUMN_FACTORS = (0.6, 0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0)
STACK_TOLERANCES = (0.0, 0.1, 0.3)
# Times the structure search starts again with the short sequences that fit nowhere as long ones.
MISFIT_ROUNDS = 2
# How many starts (cheapest fluid price first) the structure search improves.
IMPROVED_STARTS = 8
# Share of the time to the deadline the first structure-search start may take.
FIRST_SHARE = 0.3
#: Share of the time to the deadline that building the column-packing starts may take (they
#: cost milliseconds at 64 ranks, seconds at 16,384).
STARTS_SHARE = 0.15
#: Structure prices one improvement of a start may spend when no deadline bounds it (deterministic
#: planning): a count, so the plan is the same on any machine. Measured with the simulator's
#: defaults (64 ranks, the Wikipedia and WLB-LLM samples, capacities 8,192 and 16,384): at most
#: 2,061 prices per improvement, so 100,000 leaves those plans unchanged (the 189 digests of
#: ``bench/plan_digests.py`` are identical); at 4,096 ranks an improvement took 2.2 million
#: (about 15 s each, 24 of them), which made one deterministic plan take minutes.
IMPROVE_EVALUATIONS = 100_000
# How many of the structure search's best structures are realised as candidates.
STRUCTURES_REALISED = 3
#: Batches whose tokens fill at most this many passes per rank on average (total padded tokens
#: over world x capacity) also get their structures realised with whole passes (``fill``'s
#: ``whole_passes``): with one or two passes per rank, charging a pass fractionally misprices a
#: slot that spills into a second pass by up to a whole ``fixed_seconds`` (measured: 4-5 ms of
#: a 46 ms step on 64 ranks at capacity 2,048, where dyncp lost to Megatron's scheduler).
WHOLE_PASS_LOAD = 2.0


class StructuredCandidates(StretchCandidates, Pouring):
    """The structure-search family (module docstring): ``structured`` yields its plans."""

    def realise(
        self,
        structure: Structure,
        search: StructureSearch,
        passes: bool = True,
        whole_passes: bool = False,
    ) -> StepPlan:
        """A plan of ``structure``: long sequences in their groups, short ones poured in."""
        _, levels, extra = search.levels(structure)
        n_long = len(levels) - int(extra)
        wave_groups: list[list[tuple[int, list[int], float]]] = [[] for _ in range(n_long)]
        for w, k, ids in structure.groups():
            wave_groups[w].append((int(self.sizes[k]), ids, float(self.seconds[k, ids].sum())))
        wave_groups = [sorted(gs, key=lambda g: -g[0]) for gs in wave_groups]
        if extra:
            wave_groups.append([])
        return self.fill(
            wave_groups, search.short.tolist(), list(levels), passes, search.eff, whole_passes
        )

    def sparse(self) -> bool:
        """Whether the batch fills at most ``WHOLE_PASS_LOAD`` passes per rank on average."""
        tokens = float(CostModel.padded(1, self.lengths).sum())
        return tokens <= WHOLE_PASS_LOAD * self.topology.world * self.topology.capacity

    def overshoot(
        self, plan: StepPlan, structure: Structure, search: StructureSearch
    ) -> np.ndarray:
        """Short sequences of ``plan`` (a realisation of ``structure``) that lift a group above
        its wave's fluid level (plus one pass at size 1, what ``fill`` charges on top of it).

        Pouring treats short work as divisible; coarse sequences that did not fit where the
        fluid model put them end up raising a wave, and every slot of that wave then fills up
        to the raised level. Per such group its short members, longest first, until their
        seconds cover the excess: placed as long ones, the structure search prices them where
        they are."""
        _, levels, extra = search.levels(structure)
        n_long = len(levels) - int(extra)
        short = set(search.short.tolist())
        cost = evaluate_plan(plan, self.model, timing="barrier")  # the search's wave levels
        slack = self.model.fixed_seconds(1)
        out: list[int] = []
        for w, (wave, seconds) in enumerate(zip(plan.waves[:n_long], cost.microbatch_seconds)):
            j = 0
            for group in wave.groups:
                n = len(group.microbatches)
                excess = float(sum(seconds[j : j + n])) - levels[w] - slack
                j += n
                if excess <= 0:
                    continue
                row = self.costs.index(group.size)
                members = [i for mb in group.microbatches for i in mb.seq_ids if i in short]
                for i in sorted(members, key=lambda i: (-self.seconds[row, i], i)):
                    if excess <= 0:
                        break
                    out.append(i)
                    excess -= float(self.seconds[row, i])
        return np.asarray(sorted(out), dtype=np.int64)

    def _starts(self, search: StructureSearch, stop: float | None = None) -> list[Structure]:
        """The structure search's starts (``structured``), cheapest fluid price first.

        The column packings (each a pass over every long sequence and group: half a second at
        16,384 ranks) are built until ``stop`` (``time.perf_counter()`` seconds), all of them
        without one."""
        rank_seconds = self.seconds * self.sizes[:, None]
        rows = [
            self.choose_sizes(1.0, 0),
            np.argmin(rank_seconds, axis=0),
            self.choose_sizes(0.5, 0),
            np.argmin(self.alone, axis=0),
        ]
        ideal = self.ideal_seconds()
        for f in FLOOR_FACTORS:
            fits = self.alone <= f * ideal
            cost = np.where(fits, rank_seconds, np.inf)
            rows.append(np.where(fits.any(axis=0), cost.argmin(axis=0), self.alone.argmin(axis=0)))
        starts: dict[Structure, float] = {}
        for r in rows:
            s = search.start(r)
            starts.setdefault(s, search.levels(s)[0])
        if len(search.long) > 1:
            for f in COLUMN_FACTORS:
                for tolerance in STACK_TOLERANCES:
                    if stop is not None and time.perf_counter() >= stop:
                        break
                    s = search.columns(f * ideal, tolerance)
                    starts.setdefault(s, search.levels(s)[0])
        return sorted(starts, key=lambda s: starts[s])  # stable: ties keep the start order

    def structured(self, deadline: float | None = None) -> Iterator[StepPlan]:
        """Plans of the best structures found from several starts.

        Starts: the stretch rules, every long sequence at its cheapest and at its fastest size,
        floors F (multiples of the ideal step: each long sequence at its cheapest size whose
        time alone is at most F, so a plateau of equally long sequences is lowered at once,
        which single moves cannot do), each long sequence in a group of its own; and column
        packings (``StructureSearch.columns``) at levels ``COLUMN_FACTORS`` x the ideal step
        and each of ``STACK_TOLERANCES``, which stack long sequences into shared groups. The
        start the fluid model prices lowest is improved first (``FIRST_SHARE`` of the time to
        the deadline at most) and realised at once, so an early deadline still leaves a sound
        plan; the other starts are then improved in order of their price, and the cheapest
        results realised, up to ``STRUCTURES_REALISED`` in all. None when single ranks are not
        an allowed group size (nothing to pour short work into).
        """
        if self.sizes[0] != 1:
            return
        first_stop = starts_stop = None
        if deadline is not None:
            now = time.perf_counter()
            starts_stop = now + STARTS_SHARE * max(deadline - now, 0.0)
        search = StructureSearch(self.costs, self.model.wave_overhead, self.model.fixed_seconds(1))
        ranked = self._starts(search, starts_stop)
        if deadline is not None:
            now = time.perf_counter()
            first_stop = now + FIRST_SHARE * max(deadline - now, 0.0)
        work = IMPROVE_EVALUATIONS if deadline is None else None
        first = search.improve(ranked[0], first_stop, max_evaluations=work)
        yield self.realise(first, search, passes=False)
        plan = self.realise(first, search)
        realised = {first: plan}
        yield plan
        whole = self.sparse()
        if whole:
            yield self.realise(first, search, whole_passes=True)
        done = {first}
        for round_ in range(MISFIT_ROUNDS + 1):
            found: dict[Structure, float] = {first: search.levels(first)[0]} if not round_ else {}
            for s in ranked[int(not round_) : IMPROVED_STARTS]:
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                s = search.improve(s, deadline, max_evaluations=work)
                found.setdefault(s, search.levels(s)[0])
            best = sorted(found, key=lambda s: found[s])
            for s in [s for s in best if s not in done][: STRUCTURES_REALISED - 1]:
                done.add(s)
                realised[s] = self.realise(s, search)
                yield realised[s]
                if whole:
                    yield self.realise(s, search, whole_passes=True)
            misfit = search.misfits(best[0]) if best else np.zeros(0, np.int64)
            if best and best[0] in realised:
                misfit = np.union1d(misfit, self.overshoot(realised[best[0]], best[0], search))
            if not len(misfit) or (deadline is not None and time.perf_counter() >= deadline):
                break
            # Short sequences the best structure has no room for: place them explicitly, in
            # the best structure where they fit (a start of its own) and in every other start.
            levels = search.levels(best[0])[1]
            search = StructureSearch(
                self.costs,
                self.model.wave_overhead,
                self.model.fixed_seconds(1),
                extra_long=np.union1d(search.long, misfit),
            )
            ranked = [search.extend(best[0], levels, misfit), *self._starts(search)]
