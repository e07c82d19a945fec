"""dyncp's constructor: a good plan in milliseconds, driven by the real cost model; anytime.

The structure of a good plan matters more than where each short sequence goes
(notes/planner-findings.md), so every candidate decides the structure first. Candidates, in
order of promise (``candidates``), each priced with the exact cost model:

1. the structure search's best structures (``dyncp.planner.structure``: waves, groups -- which
   may stack several long sequences -- and CP sizes of the long sequences, priced with a fluid
   model; searched again with the short sequences the best one has no room for, or that its
   realisation left above a wave's fluid level (``overshoot``), placed as long ones), realised
   by ``fill``: long sequences in their groups, the longest short ones that run
   efficiently on a ring into the rings' room, the rest poured up to the fluid levels, slots
   charged the passes their tokens need;
2. stretch-rule structures (``build``): CP size per sequence = the cheapest in rank-seconds,
   raised while the sequence alone would outlast ``stretch`` x the ideal step and a larger group
   is faster (or doubled ``boost`` times); long sequences first-fit into groups up to a level,
   groups laid into waves largest first (aligned blocks); short sequences poured into the spare
   time under each wave's level, the rest into a final wave balanced by LPT;
3. level-filled structures (``build_level``): each sequence at the smallest size whose time fits
   a common level, long ones first-fit into groups of their size in the earliest wave with room.

Every group's sequences are packed first-fit-decreasing into micro-batches within capacity.
``best`` prices candidates until the deadline (or all of them without one: deterministic, ties
broken by index), then runs the local search on the fastest. Candidates are priced under
``timing`` (default dataflow: no barrier between waves, ``dyncp.cost_model.evaluate``); under
dataflow each is also tried re-laid out (``dyncp.planner.dataflow``) and the barrier's pick is
searched too (``best``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator

import numpy as np

from dyncp.cost_model.evaluate import PlanCost, check_timing, evaluate_plan, time_waves
from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan, Topology, Wave
from dyncp.planner.assignment import Assignment
from dyncp.planner.costs import SequenceCosts
from dyncp.planner.dataflow import relayout
from dyncp.planner.local_search import improve
from dyncp.planner.packing import lpt, pack_ffd, place_waves
from dyncp.planner.structure import Structure, StructureSearch

__all__ = ["greedy_plan", "GreedyConstructor"]

# (stretch, boost) structures tried: how far a long sequence may outlast the ideal step before it
# gets a larger group, and how many times all long sequences' CP sizes are doubled.
STRUCTURES = ((1.0, 0), (0.5, 0), (0.25, 0), (1.0, 1), (1.0, 2))
# Common wave levels tried by build_level, as multiples of the ideal step.
LEVEL_FACTORS = (
    0.97,
    1.0,
    1.02,
    1.04,
    1.06,
    1.08,
    1.11,
    1.15,
    1.2,
    1.25,
    1.32,
    1.4,
    1.55,
    1.7,
    2.0,
)
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
# How many of the structure search's best structures are realised as candidates.
STRUCTURES_REALISED = 3
# Share of the time to the deadline spent pricing candidates; the local search gets the rest.
CANDIDATE_SHARE = 0.85
RING_FIRST = True
# How many of LEVEL_FACTORS are tried right after the first structure (they win most often).
EARLY_LEVELS = 5
#: Batches whose tokens fill at most this many passes per rank on average (total padded tokens
#: over world x capacity) also get their structures realised with whole passes (``fill``'s
#: ``whole_passes``): with one or two passes per rank, charging a pass fractionally misprices a
#: slot that spills into a second pass by up to a whole ``fixed_seconds`` (measured: 4-5 ms of
#: a 46 ms step on 64 ranks at capacity 2,048, where dyncp lost to Megatron's scheduler).
WHOLE_PASS_LOAD = 2.0


class GreedyConstructor:
    """Builds candidate plans for one batch; ``best()`` returns the fastest.

    Args:
        lengths: sequence lengths of the step.
        topology: ranks and capacity.
        model: the cost model used both to choose and to price.
        structures: (stretch, boost) pairs tried, see ``choose_sizes``.
        timing: how candidates are timed and compared (``dyncp.cost_model.evaluate.TIMINGS``).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        topology: Topology,
        model: CostModel,
        structures: tuple[tuple[float, int], ...] = STRUCTURES,
        *,
        timing: str = "dataflow",
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.topology = topology
        self.model = model
        self.structures = structures
        self.timing = check_timing(timing)
        self.costs = SequenceCosts(self.lengths, topology, model)
        self.sizes = self.costs.sizes
        self.min_cp = self.costs.min_cp
        self.seconds = self.costs.seconds
        self.alone = self.costs.alone
        self.tried = 0
        self.moves = 0
        self.deadline: float | None = None

    # ------------------------------------------------------------------------------ step 1
    def choose_sizes(self, stretch: float, boost: int = 0) -> np.ndarray:
        """Index into ``sizes`` of each sequence's CP size.

        Cheapest rank-seconds first; then a sequence longer than ``stretch`` x the ideal step
        (total work / W) moves to the next size while that runs it faster alone (exact cost,
        ring constants included); ``boost`` doubles the CP size of every long sequence that
        many times.
        """
        n = len(self.lengths)
        cols = np.arange(n)
        rank_seconds = self.seconds * self.sizes[:, None]
        k = np.argmin(rank_seconds, axis=0)
        limit = stretch * rank_seconds[k, cols].sum() / self.topology.world
        top = len(self.sizes) - 1
        for _ in range(top):
            nxt = np.minimum(k + 1, top)
            grow = (self.seconds[k, cols] > limit) & (self.alone[nxt, cols] < self.alone[k, cols])
            if not grow.any():
                break
            k = np.where(grow, nxt, k)
        if boost:
            long = self.sizes[k] > 1
            k = np.where(long, np.minimum(k + boost, top), k)
        return k

    # ------------------------------------------------------------------------------ step 2
    def long_groups(self, k: np.ndarray, level: float) -> list[tuple[int, list[int], float]]:
        """(size, sequence ids, seconds) of groups of long sequences filled up to ``level``."""
        groups: list[tuple[int, list[int], float]] = []
        cols = np.arange(len(k))
        t = self.seconds[k, cols]
        for kk in sorted(set(k[self.sizes[k] > 1].tolist()), reverse=True):
            ids = sorted(np.flatnonzero(k == kk).tolist(), key=lambda i: (-t[i], i))
            bins: list[list[int]] = []
            loads: list[float] = []
            for i in ids:
                for b, load in enumerate(loads):
                    if load + t[i] <= level:
                        bins[b].append(i)
                        loads[b] += t[i]
                        break
                else:
                    bins.append([i])
                    loads.append(t[i])
            groups += [(int(self.sizes[kk]), b, load) for b, load in zip(bins, loads)]
        return groups

    def _waves_needed(self, groups: list[tuple[int, list[int], float]]) -> int:
        ranks = sum(size for size, _, _ in groups)
        return -(-ranks // self.topology.world)

    def levels(self, k: np.ndarray) -> list[float]:
        """Group levels worth trying: the longest sequence, and the least that needs one wave."""
        cols = np.arange(len(k))
        long = self.sizes[k] > 1
        if not long.any():
            return [0.0]
        t = self.seconds[k, cols][long]
        lo, hi = float(t.max()), float(t.sum())
        out = [lo]
        one_wave = self._waves_needed(self.long_groups(k, hi)) == 1
        if one_wave and self._waves_needed(self.long_groups(k, lo)) > 1:
            for _ in range(30):
                mid = 0.5 * (lo + hi)
                if self._waves_needed(self.long_groups(k, mid)) == 1:
                    hi = mid
                else:
                    lo = mid
            out.append(hi)
        return out

    # ------------------------------------------------------------------------------ steps 3-4
    def build(self, k: np.ndarray, level: float) -> StepPlan:
        topo = self.topology
        world = topo.world
        cols = np.arange(len(k))
        t = self.seconds[k, cols]
        groups = self.long_groups(k, level) if level > 0 else []
        # Lay groups into waves: first fit by decreasing size (power-of-two sizes pack exactly).
        wave_groups: list[list[tuple[int, list[int], float]]] = []
        wave_used: list[int] = []
        for g in sorted(groups, key=lambda g: (-g[0], -g[2], g[1][0])):
            for w, used in enumerate(wave_used):
                if used + g[0] <= world:
                    wave_groups[w].append(g)
                    wave_used[w] += g[0]
                    break
            else:
                wave_groups.append([g])
                wave_used.append(g[0])
        # Sand: spare time under each long wave's level, on its free ranks (at CP 1) and in its
        # long groups (at their CP size: dearer, but those ranks would idle), most room first;
        # what does not fit goes to a final wave of single ranks.
        bins: list[tuple[float, int, int]] = []  # (-room, wave, slot)
        bin_size: list[list[int]] = []
        bin_items: list[list[list[int]]] = []
        for w, gs in enumerate(wave_groups):
            lvl = max(g[2] for g in gs)
            sizes = [g[0] for g in gs] + [1] * (world - wave_used[w])
            rooms = [lvl - g[2] for g in gs] + [lvl] * (world - wave_used[w])
            bin_size.append(sizes)
            bin_items.append([[] for _ in sizes])
            bins += [(-room, w, b) for b, room in enumerate(rooms) if room > 0]
        heapq.heapify(bins)
        sand = np.flatnonzero(self.sizes[k] == 1).tolist()
        sand.sort(key=lambda i: (-t[i], i))
        rest: list[int] = []
        for i in sand:
            placed = False
            if bins:
                room, w, b = bins[0]
                cost = self.seconds[self.costs.index(bin_size[w][b]), i]
                if cost <= -room:
                    heapq.heapreplace(bins, (room + cost, w, b))
                    bin_items[w][b].append(i)
                    placed = True
            if not placed:
                rest.append(i)
        specs = [
            [(size, ids + bin_items[w][b]) for b, (size, ids, _) in enumerate(gs)]
            + [(1, ids) for ids in bin_items[w][len(gs) :] if ids]
            for w, gs in enumerate(wave_groups)
        ]
        if rest:
            owner = lpt([t[i] for i in rest], world)
            per_rank: list[list[int]] = [[] for _ in range(world)]
            for j, i in enumerate(rest):
                per_rank[owner[j]].append(i)
            specs.append([(1, ids) for ids in per_rank if ids])
        return self.assemble(specs)

    def fill(
        self,
        wave_groups: list[list[tuple[int, list[int], float]]],
        sand: list[int],
        targets: list[float],
        passes: bool = True,
        eff: np.ndarray | None = None,
        whole_passes: bool = False,
    ) -> StepPlan:
        """Pour the CP-1 sequences into the waves up to ``targets`` and realise the plan.

        Slots: every long group (at its size: dearer, but its ranks would idle), every free rank
        of every wave, and one extra wave of W single ranks for what does not fit. Sequences go
        longest first where they raise the step (the sum of wave levels, each counted from its
        target up) least; among slots that keep it, where they cost the fewest rank-seconds (a
        long group's ring makes a short sequence dearer), then to the least-loaded slot (LPT
        within the levels). A slot's load is its sequences' marginal seconds plus the fixed cost
        (``fixed_seconds``) of the passes its tokens need: at least one, fractional beyond it (a
        step at each pass would make the least-loaded slot of a class a poor proxy for the
        class). Slots of one size in one wave then differ only by load, so each class keeps a
        heap and a placement looks at one candidate per class. ``passes=False`` charges the
        tables' token share of the pass constant instead (the fluid model's own accounting):
        measured better on thousands of ranks, slightly worse on 64. ``whole_passes=True``
        charges every slot the whole passes its tokens need (the micro-batches it will pack
        into): exact where slots hold one or two passes (sparse batches), a poorer heap proxy
        where they hold many.
        """

        def n_passes(x: np.ndarray | float) -> np.ndarray | float:
            x = np.maximum(1.0, x)
            return np.ceil(x - 1e-9) if whole_passes else x

        world = self.topology.world
        cap = self.topology.capacity
        model = self.model
        lengths = self.lengths
        fixed = [model.fixed_seconds(int(c)) for c in self.sizes]
        # Marginal seconds (the tables' seconds without their token share of the pass constant)
        # and memory per size, for the sequences placed here.
        ids = np.asarray(sand + [i for gs in wave_groups for g in gs for i in g[1]], np.int64)
        pad = np.zeros((len(self.sizes), len(lengths)))
        for k, c in enumerate(self.sizes.tolist()):
            pad[k, ids] = CostModel.padded(c, lengths[ids])
        unit = self.sizes[:, None] * cap
        if passes:
            marg = self.seconds - pad / unit * model.microbatch_overhead
            step_fixed = fixed[0] - model.microbatch_overhead  # what the shares do not cover
        else:
            marg, step_fixed, fixed = self.seconds, 0.0, [0.0] * len(fixed)
        wave_groups = [*wave_groups, []]  # the overflow wave last, target 0
        # Whole passes price each slot as it will run, so a wave's target is its fluid level
        # (raised below to its slowest long group's exact time) without the slack of a pass at
        # size 1 that converts a fluid level into one priced with shares.
        slack = 0.0 if whole_passes else step_fixed
        targets = [*(t + slack for t in targets), 0.0]
        n_waves = len(wave_groups)
        slot_size: list[int] = []
        slot_items: list[list[int]] = []
        slot_marg: list[float] = []
        slot_tokens: list[float] = []
        classes: dict[tuple[int, int], list[tuple[float, int]]] = {}
        level = list(targets)
        one = self.costs.index(1)
        for w, gs in enumerate(wave_groups):
            free = world - sum(g[0] for g in gs)
            for size, members, _ in gs:
                row = self.costs.index(size)
                j = len(slot_size)
                slot_size.append(size)
                slot_items.append(list(members))
                slot_tokens.append(float(pad[row, members].sum()))
                # A long group starts at its members' exact times alone (ring communication the
                # additive tables leave out), never below their marginal seconds.
                passes_now = fixed[row] * float(n_passes(slot_tokens[j] / unit[row, 0]))
                exact = float(self.alone[row, members].sum()) - passes_now
                slot_marg.append(max(float(marg[row, members].sum()), exact))
                load = 0.0
                if members:
                    load = slot_marg[j] + passes_now
                level[w] = max(level[w], load)
                classes.setdefault((w, row), []).append((load, j))
            if free:  # empty single ranks, in bulk: what the loop above gives an empty slot
                j = len(slot_size)
                slot_size += [1] * free
                slot_items += [[] for _ in range(free)]
                slot_tokens += [0.0] * free
                slot_marg += [max(0.0, 0.0 - fixed[one] * 1.0)] * free
                level[w] = max(level[w], 0.0)
                classes.setdefault((w, one), []).extend((0.0, jj) for jj in range(j, j + free))
        slot_wave = [
            w
            for w, gs in enumerate(wave_groups)
            for _ in range(world - sum(g[0] for g in gs) + len(gs))
        ]
        sand = self._fill_rings(
            sand,
            (slot_size, slot_items, slot_marg, slot_tokens, slot_wave),
            classes,
            level,
            (marg, pad, fixed, unit),
            eff,
            n_passes,
        )
        for heap in classes.values():
            heapq.heapify(heap)
        self._pour(
            sand,
            classes,
            level,
            (slot_items, slot_marg, slot_tokens),
            (marg, pad, fixed, unit),
            whole_passes,
        )
        specs: list[list[tuple[int, list[int]]]] = [[] for _ in range(n_waves)]
        j = 0
        for w, gs in enumerate(wave_groups):
            for _ in range(world - sum(g[0] for g in gs) + len(gs)):
                if slot_items[j]:
                    specs[w].append((slot_size[j], slot_items[j]))
                j += 1
        return self.assemble(specs)

    def _pour(
        self,
        sand: list[int],
        classes: dict[tuple[int, int], list[tuple[float, int]]],
        level: list[float],
        slots: tuple[list[list[int]], list[float], list[float]],
        tables: tuple[np.ndarray, np.ndarray, list[float], np.ndarray],
        whole_passes: bool = False,
    ) -> None:
        """``fill``'s pouring: each sequence of ``sand``, longest first, into the slot that keeps
        the step lowest, then spends the fewest rank-seconds, then is least loaded (the heads
        of the ``classes`` heaps); updates the slots, heaps and wave ``level`` in place.

        The placement of 130,000 sequences on 16,384 ranks runs here, one Python iteration per
        sequence and class, so the loop touches plain lists and floats only: per class its heap,
        wave, constants and its CP size's row of each table (one plain list per row, for the
        sizes some class has) bound once. The order of sequences, the keys and their ties are
        those of the plain formulation (key = (rise above the wave's level, rank-seconds, new
        load, wave x sizes + row), the least wins; ``tests/unit/planner/test_deferred_bound.py``
        keeps it as the reference), so the plans are.
        """
        slot_items, slot_marg, slot_tokens = slots
        marg, pad, fixed, unit = tables
        keys = sorted(classes)
        width = len(self.sizes)
        used = sorted({row for _, row in keys})
        col = {row: c for c, row in enumerate(used)}
        if not sand:
            return
        # Longest first, ties by id (a lexicographic sort: no per-element Python key).
        ids = np.asarray(sand, dtype=np.int64)
        cols = ids[np.lexsort((ids, -self.seconds[0, ids]))]
        rows = np.asarray(used, dtype=np.int64)
        # One plain list per table row (not one per sequence: 130,000 small lists would cost
        # more to build, and to the garbage collector, than the loop itself).
        marg_r = marg[np.ix_(rows, cols)].tolist()
        pad_r = pad[np.ix_(rows, cols)].tolist()
        spent_r = (self.seconds[np.ix_(rows, cols)] * self.sizes[rows, None]).tolist()
        unit_l = unit[:, 0].tolist()
        plain = not any(fixed[row] for row in used)  # no pass charge (``passes=False``)
        heads = [
            (
                classes[(w, row)],
                w,
                marg_r[col[row]],
                pad_r[col[row]],
                spent_r[col[row]],
                fixed[row],
                unit_l[row],
                w * width + row,
            )
            for w, row in keys
        ]
        for n, i in enumerate(cols.tolist()):
            # The least key (rise above the level, rank-seconds, new load, tie) over the
            # classes' heads, compared field by field as a tuple would be.
            b_over = b_spent = b_new = 0.0
            b_tie = -1
            for head in heads:
                heap, w, m_r, p_r, s_r, f, u, tie = head
                if plain:  # f * passes == 0.0: the load is the sum alone
                    new = slot_marg[heap[0][1]] + m_r[n]
                else:
                    j = heap[0][1]
                    passes = max(1.0, (slot_tokens[j] + p_r[n]) / u)
                    if whole_passes:  # ``fill``'s whole passes: each slot as it will run
                        passes = math.ceil(passes - 1e-9)
                    new = slot_marg[j] + m_r[n] + f * passes
                over = new - level[w]
                if over < 0.0:  # max(over, 0.0)
                    over = 0.0
                if b_tie >= 0:  # not better than the best so far: next
                    if over > b_over:
                        continue
                    if over == b_over:
                        spent = s_r[n]
                        if spent > b_spent or (
                            spent == b_spent and (new > b_new or (new == b_new and tie > b_tie))
                        ):
                            continue
                b_over, b_spent, b_new, b_tie, home = over, s_r[n], new, tie, head
            heap, w = home[0], home[1]
            j = heapq.heapreplace(heap, (b_new, heap[0][1]))[1]
            slot_items[j].append(i)
            slot_marg[j] += home[2][n]
            slot_tokens[j] += home[3][n]
            level[w] = max(level[w], b_new)

    def _fill_rings(
        self,
        sand: list[int],
        slots: tuple[list[int], list[list[int]], list[float], list[float], list[int]],
        classes: dict[tuple[int, int], list[tuple[float, int]]],
        level: list[float],
        tables: tuple[np.ndarray, np.ndarray, list[float], np.ndarray],
        eff: np.ndarray | None,
        n_passes: Callable[[np.ndarray | float], np.ndarray | float],
    ) -> list[int]:
        """Pour into the long groups' room below their wave's level, longest first, the short
        sequences that run there at least as efficiently as the fluid model assumed (``eff``:
        CP-1 seconds per rank-second on c ranks, averaged over all short work), each into the
        group it fills most tightly; the others are returned, in the order given.

        A ring's room is otherwise idle, and the longest short sequences are both the ones a
        ring runs best and the hardest to place evenly elsewhere.
        """
        slot_size, slot_items, slot_marg, slot_tokens, slot_wave = slots
        marg, pad, fixed, unit = tables
        rings = [j for j, c in enumerate(slot_size) if c > 1 and slot_items[j]]
        if eff is None or not rings or not sand:
            return sand
        pool = np.asarray(sand, dtype=np.int64)
        rows = np.asarray([self.costs.index(slot_size[j]) for j in rings])
        waves = np.asarray([slot_wave[j] for j in rings])
        loads = np.asarray(
            [
                slot_marg[j] + fixed[r] * float(n_passes(slot_tokens[j] / unit[r, 0]))
                for j, r in zip(rings, rows)
            ]
        )
        room = np.asarray(level)[waves] - loads
        # Per CP size (a handful), not per ring (thousands at 16,384 ranks): ring x sequence
        # tables would not fit in time.
        sizes_used, ring_size = np.unique(rows, return_inverse=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            good = (
                self.seconds[sizes_used][:, pool]
                * self.sizes[sizes_used][:, None]
                * eff[sizes_used][:, None]
                <= (self.seconds[0, pool][None, :])
            )
        # A sequence fits a ring only if its marginal seconds there are within the room left
        # (the passes it adds only raise the load): a cheap necessary test per sequence.
        need = np.where(good, marg[sizes_used][:, pool], np.inf)
        least = need.min(axis=0).tolist()
        left: list[int] = []
        by_length = np.argsort(-self.seconds[0, pool], kind="stable").tolist()
        # The rings' loads as arrays beside the slot lists (kept equal to them), and each ring's
        # place in its class's list: a placement updates both in O(1).
        ring_tokens = np.asarray([slot_tokens[j] for j in rings], dtype=np.float64)
        ring_marg = np.asarray([slot_marg[j] for j in rings], dtype=np.float64)
        fixed_a = np.asarray(fixed)
        ring_level = np.asarray(level)[waves]
        place: dict[int, int] = {}
        for key in {(int(w), int(r)) for w, r in zip(waves, rows)}:
            place.update((jj, p) for p, (_, jj) in enumerate(classes[key]))
        # Per sequence its row of ``need`` (contiguous), read per ring through its size; the
        # rooms with those at most 0 as -inf (no need is -inf), so one comparison selects the
        # rings with room > 0 and room >= need; their maximum, kept up to date.
        need_rows = np.ascontiguousarray(need.T)
        room_open = np.where(room > 0, room, -np.inf)
        room_max = float(room.max())
        for n, q in enumerate(by_length):
            i = int(pool[q])
            # Past the deadline the rest is poured as usual (a sound plan, sooner): at 16,384
            # ranks this loop alone takes seconds.
            if n % 256 == 255 and self.deadline is not None and time.perf_counter() > self.deadline:
                left.extend(int(pool[x]) for x in by_length[n:])
                break
            if least[q] > room_max:
                left.append(i)
                continue
            ok = np.flatnonzero(need_rows[q].take(ring_size) <= room_open)
            if len(ok):
                r = rows[ok]
                tokens = ring_tokens[ok] + pad[r, i]
                margs = ring_marg[ok] + marg[r, i]
                new = margs + fixed_a[r] * n_passes(tokens / unit[r, 0])
                after = ring_level[ok] - new
                fits = np.flatnonzero(after >= 0)
                if len(fits):
                    x = int(ok[fits[np.argmin(after[fits])]])
                    j = rings[x]
                    slot_items[j].append(i)
                    slot_marg[j] += marg[rows[x], i]
                    slot_tokens[j] += pad[rows[x], i]
                    ring_marg[x], ring_tokens[x] = slot_marg[j], slot_tokens[j]
                    load = slot_marg[j] + fixed[rows[x]] * float(
                        n_passes(slot_tokens[j] / unit[rows[x], 0])
                    )
                    before, room[x] = room[x], level[waves[x]] - load
                    room_open[x] = room[x] if room[x] > 0 else -np.inf
                    if room[x] > room_max or before == room_max:
                        room_max = float(room.max())
                    classes[(int(waves[x]), int(rows[x]))][place[j]] = (load, j)
                    continue
            left.append(i)
        order = {i: n for n, i in enumerate(sand)}
        return sorted(left, key=order.__getitem__)

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
        eff = search.eff if RING_FIRST else None
        return self.fill(
            wave_groups, search.short.tolist(), list(levels), passes, eff, whole_passes
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
        first = search.improve(ranked[0], first_stop)
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
                s = search.improve(s, deadline)
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

    def build_level(self, level: float) -> StepPlan:
        """Every wave filled up to one common ``level`` (seconds).

        Each sequence takes the smallest CP size whose time fits the level (or its fastest);
        long sequences first-fit into groups of their size in the earliest wave with room, new
        waves opening as needed; short ones go where the most room is left, and once nothing
        has room, onto the least-loaded single rank (raising its wave).
        """
        world = self.topology.world
        cols = np.arange(len(self.lengths))
        fits = self.seconds <= level
        k = np.where(fits.any(axis=0), fits.argmax(axis=0), self.alone.argmin(axis=0))
        t = self.seconds[k, cols]
        size = self.sizes[k]
        waves: list[list[list]] = []  # per wave: [size, ids, load] per group
        free: list[int] = []
        for i in sorted(np.flatnonzero(size > 1).tolist(), key=lambda i: (-size[i], -t[i], i)):
            c = int(size[i])
            home = next((g for gs in waves for g in gs if g[0] == c and g[2] + t[i] <= level), None)
            if home is None:
                w = next((w for w, f in enumerate(free) if f >= c), None)
                if w is None:
                    waves.append([])
                    free.append(world)
                    w = len(waves) - 1
                home = [c, [], 0.0]
                waves[w].append(home)
                free[w] -= c
            home[1].append(i)
            home[2] += t[i]
        sand = sorted(np.flatnonzero(size == 1).tolist(), key=lambda i: (-t[i], i))
        if sand and not any(free):
            waves.append([])
            free.append(world)
        for w, f in enumerate(free):
            waves[w] += [[1, [], 0.0] for _ in range(f)]
        groups = [g for gs in waves for g in gs]
        rooms = [(g[2] - level, j) for j, g in enumerate(groups)]  # min-heap of -room
        heapq.heapify(rooms)
        singles = [(0.0, j) for j, g in enumerate(groups) if g[0] == 1]
        for i in sand:
            # Every update pushes a fresh entry, so entries that disagree are stale: drop them.
            while rooms[0][0] != groups[rooms[0][1]][2] - level:
                heapq.heappop(rooms)
            neg_room, j = rooms[0]
            cost = self.seconds[self.costs.index(groups[j][0]), i]
            overflow = cost > -neg_room
            if overflow:  # no room anywhere: the least-loaded single rank takes it
                while singles[0][0] != groups[singles[0][1]][2]:
                    heapq.heappop(singles)
                j = singles[0][1]
                cost = t[i]
            groups[j][1].append(i)
            groups[j][2] += cost
            heapq.heappush(rooms, (groups[j][2] - level, j))
            if groups[j][0] == 1:
                heapq.heappush(singles, (groups[j][2], j))
        return self.assemble([[(g[0], g[1]) for g in gs if g[1]] for gs in waves])

    def assemble(self, specs: list[list[tuple[int, list[int]]]]) -> StepPlan:
        """A StepPlan from per-wave (CP size, sequence ids) groups: FFD micro-batches on allowed
        blocks (a wave whose groups do not fit the blocks at once continues in the next wave)."""
        topo = self.topology
        lengths = self.lengths.tolist()  # plain ints: pack_ffd reads one per sequence
        waves = tuple(
            Wave(groups)
            for spec in specs
            if spec
            for groups in place_waves(
                [(c, pack_ffd(ids, lengths, c, topo)) for c, ids in spec], topo
            )
        )
        return StepPlan(topo, tuple(int(s) for s in self.lengths), waves, policy="dyncp")

    def candidates(self) -> Iterator[StepPlan]:
        """Candidate plans, most promising first (measured: notes in docs/planner.md), so an
        anytime caller that stops early has already seen the likely winners."""
        ideal = self.ideal_seconds()
        first, rest = LEVEL_FACTORS[:EARLY_LEVELS], LEVEL_FACTORS[EARLY_LEVELS:]
        yield from self.structured(self.deadline)
        seen: set[bytes] = set()
        for n, (stretch, boost) in enumerate(self.structures):
            k = self.choose_sizes(stretch, boost)
            key = k.tobytes()
            if key not in seen:
                seen.add(key)
                for level in self.levels(k):
                    yield self.build(k, level)
            if n == 0:
                for f in first:
                    yield self.build_level(ideal * f)
        for f in rest:
            yield self.build_level(ideal * f)

    def ideal_seconds(self) -> float:
        return self.costs.ideal_seconds()

    def best(self, deadline: float | None = None) -> StepPlan:
        """The fastest candidate under the cost model and ``timing`` (first one on ties).

        Anytime: with a ``deadline`` (``time.perf_counter()`` seconds) it stops pricing
        candidates when the next one, as slow as the last, would end past ``CANDIDATE_SHARE`` of
        the time left (the first is always priced), then runs
        the local search (``dyncp.planner.local_search``) on the best until the deadline, and
        returns the best so far; ``tried`` counts the candidates priced. Without a deadline it
        prices them all and bounds the local search by rounds only (deterministic).

        Under the dataflow timing every candidate is also tried re-laid out
        (``dyncp.planner.dataflow.relayout``: the same groups on the ranks free first; priced
        by the re-layout itself, no cost-model call), and the candidate the barrier timing
        would pick is kept beside the dataflow best: the local search (whose additive objective
        is the barrier's) runs on both, the second half of the time on the barrier pick, and
        the fastest of them all under dataflow wins. So in deterministic mode the result is
        never slower, timed as dataflow, than what the barrier objective would have returned.
        """
        self.tried = 0
        self.moves = 0
        if len(self.lengths) == 0:
            return StepPlan(self.topology, (), (), policy="dyncp")
        stop = None
        if deadline is not None:
            now = time.perf_counter()
            stop = now + CANDIDATE_SHARE * max(deadline - now, 0.0)
        self.deadline = stop
        dataflow = self.timing == "dataflow"
        best: tuple[float, StepPlan] | None = None
        picked: StepPlan | None = None  # the candidate ``best`` was made from (re-laid out)
        barrier: tuple[float, StepPlan] | None = None  # dataflow only: the barrier's pick
        last = time.perf_counter()
        for plan in self.candidates():
            cost = evaluate_plan(plan, self.model, timing=self.timing)
            self.tried += 1
            seconds = cost.step_seconds
            candidate = plan
            if dataflow:
                flat = np.concatenate([np.asarray(s) for s in cost.microbatch_seconds])
                wall = time_waves(
                    plan, flat, self.model.wave_overhead, timing="barrier"
                ).step_seconds
                if barrier is None or wall < barrier[0]:
                    barrier = (wall, plan)
                seconds, plan = self._relaid(plan, cost)
            if best is None or seconds < best[0]:
                best = (seconds, plan)
                picked = candidate
            now = time.perf_counter()
            # Stop when the next candidate, if it takes as long as this one, would end late.
            if stop is not None and now + (now - last) >= stop:
                break
            last = now
        assert best is not None
        # The local search from the dataflow pick and from the barrier's (once when they are the
        # same candidate: from the candidate as built, which is what the barrier would search).
        starts = [best[1]]
        if barrier is not None:
            starts = [barrier[1]] if barrier[1] is picked else [best[1], barrier[1]]
        for n, start in enumerate(starts):
            until = deadline
            if deadline is not None and n == 0 and len(starts) > 1:
                until = time.perf_counter() + 0.5 * max(deadline - time.perf_counter(), 0.0)
            found = self._searched(start, until)
            if found is not None and found[0] < best[0]:
                best = found
        return best[1]

    def _relaid(self, plan: StepPlan, cost: PlanCost) -> tuple[float, StepPlan]:
        """Dataflow seconds and plan: ``plan`` or its re-layout, whichever is faster."""
        relaid = relayout(plan, cost, self.model.wave_overhead)
        if relaid is not None and relaid[0] < cost.step_seconds:
            return relaid
        return cost.step_seconds, plan

    def _searched(self, plan: StepPlan, deadline: float | None) -> tuple[float, StepPlan] | None:
        """The local search's plan from ``plan`` and its seconds (re-laid out under dataflow), or
        None when it moved nothing or its slots no longer pack into micro-batches."""
        moved, moves = improve(Assignment.from_plan(plan, self.costs), deadline)
        self.moves += moves
        if not moves:
            return None
        try:
            plan = moved.to_plan(plan)
        except ValueError:  # a slot whose sequences no longer pack into micro-batches
            return None
        cost = evaluate_plan(plan, self.model, timing=self.timing)
        if self.timing == "dataflow":
            return self._relaid(plan, cost)
        return cost.step_seconds, plan


def greedy_plan(lengths: np.ndarray, topology: Topology, model: CostModel) -> StepPlan:
    """dyncp's greedy plan for one step (see the module docstring)."""
    return GreedyConstructor(lengths, topology, model).best()
