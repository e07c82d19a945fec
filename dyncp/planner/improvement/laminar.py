"""Layout search for batches of few sequences: CP-SAT chooses the groups, not only the slots.

Why. ``dyncp.planner.improvement.cpsat`` re-assigns sequences within the structure the constructor
built (its waves and groups). On batches of a few long documents (the long-document scenario of
``bench/planner_bench.py``: 16 documents on 64 ranks) the structure is what is left to gain:
this search run for 15 s finds plans 0.3-2.5% faster than the constructor's on such batches
(``bench/layout_exact.py --long``), by nesting groups unevenly (two 32-rank groups of different
lengths, then different groups on each half) -- something wave levels do not express.

Model. Every placement of every allowed size (``Topology.placements``) is a *block*; a block
holds at most ``MAX_SLOTS`` micro-batches. Booleans ``x[i, b, k]``: sequence i runs in
micro-batch k of block b (one each; only where it fits alone); ``z[b, k]`` micro-batch k is used
(memory: its padded tokens fit ``c C``); ``g[b]`` block b is used. A micro-batch lasts at least
``fixed_seconds(c) + sum bound_rank_seconds / c`` of its sequences and at least each one's time
alone (the cost-model protocol's two lower bounds; exact for a single sequence and for profiles
without overlap). A rank's time is the sum, over the blocks holding it, of one wave overhead per
used block plus its micro-batches; the objective is the largest rank time. Realised with the
groups in descending size (each a wave after every earlier group it shares a rank with), every
rank runs its groups biggest first; where blocks nest (aligned power-of-two blocks), the members
of a group are then free together, so the dataflow step equals the modelled maximum up to the
protocol's lower bounds. The plan is priced exactly by the caller and kept only if faster, so the
proxy never makes a plan worse (and a menu whose blocks do not nest only loses accuracy).

Cost: about ``sequences x blocks x MAX_SLOTS`` Booleans (6,000 for 16 documents on 64 ranks);
batches of more than ``MAX_SEQUENCES`` sequences or models of more than ``MAX_VARIABLES`` are
skipped. The incoming plan is the solver's hint, complete: a block gets at least as many
micro-batches as the plan runs on it (its groups there merged), so the search starts from it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from dyncp.cost_model.model import CostModel
from dyncp.plan import Group, MicroBatch, StepPlan, Wave

__all__ = ["LaminarImprover", "LaminarResult", "MAX_SEQUENCES"]

log = logging.getLogger(__name__)

US = 1e6  # integer unit: microseconds
MAX_SEQUENCES = 32
MAX_VARIABLES = 20_000
MAX_SLOTS = 3


@dataclass(frozen=True, slots=True)
class LaminarResult:
    """What the layout search did: the solver's status name (or why it did not run), its
    modelled step seconds (None without a solution), Booleans, wall seconds."""

    status: str
    objective_seconds: float | None
    variables: int
    wall_seconds: float


class LaminarImprover:
    """CP-SAT over group layouts for small batches (module docstring).

    deterministic: one worker, a deterministic time limit and a fixed seed. hint: start from the
    incoming plan (the planner's use: within a step's budget the hint is the solver's first
    solution); without it the search is free of the incoming layout, which on long runs can
    find better ones (``bench/layout_exact.py`` runs both).
    """

    def __init__(self, *, deterministic: bool = False, seed: int = 0, hint: bool = True) -> None:
        self.deterministic = deterministic
        self.seed = seed
        self.hint = hint

    def solve(
        self, plan: StepPlan, model: CostModel, time_limit: float
    ) -> tuple[StepPlan | None, LaminarResult]:
        """A plan of ``plan``'s batch laid out by the model, or None (with why) when the batch
        is too large, the model too big, no solution was found within ``time_limit``, or the
        solver failed (logged; never raised: a solver bug must not stop training)."""
        start = time.perf_counter()
        try:
            return self._solve(plan, model, time_limit, start)
        except Exception as exc:
            log.exception("layout search failed; keeping the incoming plan")
            return None, LaminarResult(f"ERROR: {exc}", None, 0, time.perf_counter() - start)

    def _solve(
        self, plan: StepPlan, model: CostModel, time_limit: float, start: float
    ) -> tuple[StepPlan | None, LaminarResult]:
        topo = plan.topology
        lengths = np.asarray(plan.lengths, dtype=np.int64)
        n = len(lengths)
        if n == 0 or n > MAX_SEQUENCES:
            return None, LaminarResult("SKIPPED: batch size", None, 0, 0.0)
        blocks = [(s, c) for c in topo.group_sizes for s in topo.placements(c)]
        index = {blk: b for b, blk in enumerate(blocks)}
        fits = {}
        for c in topo.group_sizes:
            fits[c] = np.flatnonzero(CostModel.padded(c, lengths) <= c * topo.capacity)
        # The incoming plan, block by block (its groups on one block merged): the hint.
        given: dict[int, list[tuple[int, ...]]] = {}
        for wave in plan.waves:
            for group in wave.groups:
                b = index.get((group.start, group.size))
                if b is not None and group.heads == 1:
                    given.setdefault(b, []).extend(mb.seq_ids for mb in group.microbatches)
        slots = [
            max(min(len(fits[c]), MAX_SLOTS), len(given.get(b, ())))
            for b, (_, c) in enumerate(blocks)
        ]
        count = sum(k * len(fits[c]) for k, (_, c) in zip(slots, blocks, strict=True))
        if count > MAX_VARIABLES:
            return None, LaminarResult("SKIPPED: model size", None, count, 0.0)
        wo = int(round(model.wave_overhead * US))
        m = cp_model.CpModel()
        x: dict[tuple[int, int, int], cp_model.IntVar] = {}
        hints: list[tuple[cp_model.IntVar, int]] = []
        rank_terms: list[list] = [[] for _ in range(topo.world)]
        per_size = {}
        for c in topo.group_sizes:
            ids = fits[c]
            per_size[c] = (
                CostModel.padded(c, lengths[ids]).astype(np.int64),
                np.ceil(model.bound_rank_seconds(c, lengths[ids]) / c * US).astype(np.int64),
                np.ceil(model.alone_seconds(c, lengths[ids]) * US).astype(np.int64),
                int(np.ceil(model.fixed_seconds(c) * US)),
            )
        # No rank's time exceeds every sequence at its slowest, every slot's fixed seconds and
        # every block's overhead.
        slowest = np.zeros(n, dtype=np.int64)
        for c in topo.group_sizes:
            ids, (_, share, alone, fixed) = fits[c], per_size[c]
            slowest[ids] = np.maximum(slowest[ids], np.maximum(share, alone))
        most_fixed = max(per_size[c][3] for c in topo.group_sizes)
        horizon = int(slowest.sum()) + most_fixed * sum(slots) + wo * len(blocks) + 1
        hinted = np.zeros(topo.world, dtype=np.int64)  # each rank's modelled time in the hint
        for b, (s, c) in enumerate(blocks):
            ids = fits[c]
            if not len(ids):
                continue
            pad, share, alone, fixed = per_size[c]
            used = m.new_bool_var(f"g{b}")
            mine = given.get(b, [])
            hints.append((used, int(bool(mine))))
            for r in range(s, s + c):
                rank_terms[r].append(wo * used)
            prev = None
            for k in range(slots[b]):
                z = m.new_bool_var(f"z{b}_{k}")
                m.add_implication(z, used)
                held = set(mine[k]) if k < len(mine) else set()
                hints.append((z, int(bool(held))))
                if prev is not None:
                    m.add_implication(z, prev)
                prev = z
                xs = []
                for i in ids.tolist():
                    v = m.new_bool_var(f"x{i}_{b}_{k}")
                    x[i, b, k] = v
                    xs.append(v)
                    hints.append((v, int(i in held)))
                m.add(
                    sum(int(p) * v for p, v in zip(pad, xs, strict=True)) <= c * topo.capacity * z
                )
                t = m.new_int_var(0, horizon, f"t{b}_{k}")
                m.add(t >= fixed * z + sum(int(q) * v for q, v in zip(share, xs, strict=True)))
                for a, v in zip(alone, xs, strict=True):
                    m.add(t >= int(a) * v)
                for r in range(s, s + c):
                    rank_terms[r].append(t)
                at = [j for j, i in enumerate(ids.tolist()) if i in held]
                seconds = max([fixed + int(share[at].sum()), *alone[at].tolist()]) if at else 0
                hints.append((t, int(seconds)))
                for r in range(s, s + c):
                    hinted[r] += int(seconds)
            if mine:
                hinted[s : s + c] += wo
        places: list[list[cp_model.IntVar]] = [[] for _ in range(n)]
        for (i, _, _), v in x.items():
            places[i].append(v)
        for options in places:
            m.add_exactly_one(options)
        step = m.new_int_var(0, horizon, "step")
        for terms in rank_terms:
            if terms:
                m.add(sum(terms) <= step)
        m.minimize(step)
        covered = {i for mbs in given.values() for mb in mbs for i in mb}
        if self.hint and len(covered) == n and int(hinted.max()) <= horizon:  # a complete hint
            for v, value in hints:
                m.add_hint(v, value)
            m.add_hint(step, int(hinted.max()))
        solver = cp_model.CpSolver()
        params = solver.parameters
        params.random_seed = self.seed
        left = time_limit - (time.perf_counter() - start)
        if self.deterministic:
            params.num_workers = 1
            params.max_deterministic_time = max(time_limit, 1e-3)
        else:
            if left <= 0.01:
                return None, LaminarResult(
                    "SKIPPED: no time", None, count, time.perf_counter() - start
                )
            params.num_workers = 2
            params.max_time_in_seconds = left
        status = solver.solve(m)
        name = solver.status_name(status)
        wall = time.perf_counter() - start
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, LaminarResult(name, None, count, wall)
        chosen: dict[int, list[list[int]]] = {}
        for (i, b, k), v in x.items():
            if solver.boolean_value(v):
                mbs = chosen.setdefault(b, [[] for _ in range(slots[b])])
                mbs[k].append(i)
        out = _realise(plan, blocks, chosen)
        return out, LaminarResult(name, solver.objective_value / US + 0.0, count, wall)


def _realise(
    plan: StepPlan, blocks: list[tuple[int, int]], chosen: dict[int, list[list[int]]]
) -> StepPlan:
    """The chosen blocks as groups in descending size, each in the wave after every earlier
    group it shares a rank with (so each rank runs its groups biggest first)."""
    order = sorted(chosen, key=lambda b: (-blocks[b][1], blocks[b][0]))
    waves: list[list[Group]] = []
    last = np.full(plan.topology.world, -1)
    for b in order:
        s, c = blocks[b]
        mbs = tuple(MicroBatch(seq_ids=tuple(sorted(ids))) for ids in chosen[b] if ids)
        w = int(last[s : s + c].max()) + 1
        last[s : s + c] = w
        while len(waves) <= w:
            waves.append([])
        waves[w].append(Group(start=s, size=c, microbatches=mbs))
    return StepPlan(
        topology=plan.topology,
        lengths=plan.lengths,
        waves=tuple(Wave(groups=tuple(g)) for g in waves),
        policy=plan.policy,
        sample_ids=plan.sample_ids,
    )
