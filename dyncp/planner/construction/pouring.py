"""The greedy constructor's pouring engine: short sequences poured into a structure's waves.

A structure (``structure``) fixes the long sequences' groups; ``fill`` realises it: the longest
short sequences that run efficiently on a ring go into the rings' room (``_fill_rings``), the
rest are poured (``_pour``) where they raise the step least. At 16,384 ranks this places
130,000 sequences, one Python iteration per sequence and slot class, so both loops touch plain
lists and floats only.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import StepPlan
from dyncp.planner.construction.base import ConstructorBase

__all__ = ["Pouring"]


class Pouring(ConstructorBase):
    """``fill``: a structure realised with its short sequences poured in (module docstring)."""

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
