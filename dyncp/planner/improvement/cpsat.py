"""CP-SAT improvement of a plan: re-assign sequences to the plan's slots, optimally if time allows.

Decomposition (why it fits a deadline). Solving the whole plan contract per sequence -- CP size,
wave and group for each of thousands of sequences -- is far too large for milliseconds
(notes/planner-findings.md: such a model does not finish presolve in 100 ms). The structure of a
good plan (how many waves, which groups) is found by the greedy constructor; CP-SAT then decides
where every sequence goes within that structure:

- slots: the plan's groups, plus an empty single-rank slot for every idle rank of every wave;
  putting a sequence in a slot chooses its wave, its group and its CP size (the slot's size,
  which must be >= the sequence's minimum);
- big sequences are Booleans ``x[i, slot]`` over a few candidate slots each: its current slot,
  and for its current size, double and half, the slots with the least load. Up to ``max_exact``
  sequences every sequence is big; above, the ``max_big`` costliest and every one whose minimum
  CP size exceeds 1;
- every other sequence (large batches only) is bucketed: same minimum CP size, cost at CP 1
  within a factor ``bucket_ratio`` of each other; a bucket is an integer count ``n[b, slot]`` per
  slot that can hold it (so 4096 sequences become a few dozen buckets);
- a slot in use pays its fixed costs once (``u[slot]``: micro-batch constant, ring-step kernel
  and link latency, priced as a one-token micro-batch of its size);
- load(slot) = sum of costs (from the additive cost tables), level M_w >= load of every slot in
  wave w, objective: minimise sum_w M_w, the predicted step time without the wave constants.

Coefficients are integer microseconds: each item's cost is rounded to the nearest microsecond,
so a slot's modelled load is off by at most 0.5 us per sequence in it (under 1 ms for any
plan here), and a bucket's items are priced at the bucket's mean cost, off by at most the bucket
ratio (25%) on each small sequence. The model is hinted with the incoming plan (every variable,
levels included), so the solver starts from it. The solution is realised by dealing each
bucket's sequences, longest first, to its slots in proportion to the counts, then priced with
the exact cost model by the caller, which keeps it only if it is faster under the planner's
timing (dataflow by default: the model's sum of wave levels is the barrier price, which bounds
the dataflow one from above, so the solver works on a proxy and the acceptance decides).

Timeouts, an infeasible or invalid model, or a solver error never raise: the incoming plan is
returned and the outcome is recorded in ``CpSatResult.status``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from dyncp.planner.construction.assignment import Assignment

__all__ = ["CpSatResult", "CpSatImprover"]

log = logging.getLogger(__name__)

US = 1e6  # integer unit: microseconds
# Wall-clock mode: building the model may use at most this share of the time limit.
BUILD_SHARE = 0.5
# Model variables built per second here (measured: 107,136 bucket counts in 3.9 s on this 2-core
# machine); a model that could not be built within BUILD_SHARE of the limit is not started.
VARIABLES_PER_SECOND = 25_000


@dataclass(frozen=True, slots=True)
class CpSatResult:
    """What one solve did.

    status: OPTIMAL / FEASIBLE / UNKNOWN (no solution in time) / INFEASIBLE / MODEL_INVALID /
    ERROR (an exception inside the solver, logged) / SKIPPED (no time left).
    objective_seconds, bound_seconds: the model's objective and proven bound (None if none).
    """

    status: str
    wall_seconds: float
    build_seconds: float
    objective_seconds: float | None
    bound_seconds: float | None
    improved_model: bool
    big: int
    buckets: int
    variables: int


class CpSatImprover:
    """Re-assigns sequences to slots with CP-SAT.

    Args:
        max_exact: batches up to this many sequences give every sequence its own Booleans (no
            buckets, so the model prices exactly what is realised).
        max_big: otherwise, how many of the costliest sequences get their own Booleans.
        candidates_per_size: least-loaded slots offered to a big sequence per candidate size.
        bucket_ratio: cost ratio within a bucket of small sequences.
        deterministic: one worker, a deterministic time limit and a fixed seed, so identical
            inputs give identical results on every machine.
        seed: the solver's random seed.
    """

    def __init__(
        self,
        *,
        max_exact: int = 1024,
        max_big: int = 48,
        candidates_per_size: int = 6,
        bucket_ratio: float = 1.25,
        deterministic: bool = False,
        seed: int = 0,
    ) -> None:
        if bucket_ratio <= 1.0:
            raise ValueError(f"bucket_ratio must be > 1, got {bucket_ratio}")
        self.max_exact = max_exact
        self.max_big = max_big
        self.candidates_per_size = candidates_per_size
        self.bucket_ratio = bucket_ratio
        self.deterministic = deterministic
        self.seed = seed

    # ------------------------------------------------------------------------------ model
    def _split(self, a: Assignment) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
        """Big sequences, and buckets of the rest keyed by (min CP, cost class)."""
        costs = a.costs
        n = len(costs.lengths)
        where = np.zeros(n, dtype=np.int64)
        for j, ids in enumerate(a.items):
            where[ids] = j
        current = costs.seconds[a.row[where], np.arange(n)]
        order = np.argsort(-current, kind="stable")
        if n <= self.max_exact:
            return list(range(n)), {}
        big = set(order[: self.max_big].tolist()) | set(np.flatnonzero(costs.min_cp > 1).tolist())
        buckets: dict[tuple[int, int], list[int]] = {}
        log_ratio = np.log(self.bucket_ratio)
        for i in range(n):
            if i in big:
                continue
            c = int(costs.min_cp[i])
            cost = float(costs.seconds[costs.index(c), i])
            key = (c, int(np.floor(np.log(max(cost, 1e-12)) / log_ratio)))
            buckets.setdefault(key, []).append(i)
        return sorted(big), buckets

    def solve(self, a: Assignment, time_limit: float) -> tuple[Assignment, CpSatResult]:
        """Improve ``a`` within ``time_limit`` seconds (wall, or deterministic units)."""
        start = time.perf_counter()
        try:
            return self._solve(a, time_limit, start)
        except Exception as exc:  # a solver bug must never take training down
            log.exception("CP-SAT improvement failed; keeping the incoming plan")
            wall = time.perf_counter() - start
            return a, CpSatResult(f"ERROR: {exc}", wall, wall, None, None, False, 0, 0, 0)

    def _solve(
        self, a: Assignment, time_limit: float, start: float
    ) -> tuple[Assignment, CpSatResult]:
        costs = a.costs
        t = costs.seconds
        slots = len(a.items)
        loads = a.loads()
        big, buckets = self._split(a)
        # Checked before anything else is built: at 16,384 ranks the placement variables of
        # the big sequences alone take most of a second.
        estimate = sum(int((a.size >= key[0]).sum()) for key in buckets)
        if not self.deterministic and estimate > VARIABLES_PER_SECOND * BUILD_SHARE * time_limit:
            build = time.perf_counter() - start
            return a, CpSatResult(
                "SKIPPED: model too large for the time left",
                build,
                build,
                None,
                None,
                False,
                len(big),
                len(buckets),
                estimate,
            )
        where = {i: j for j, ids in enumerate(a.items) for i in ids}
        model = cp_model.CpModel()
        terms: list[list[tuple[int, cp_model.IntVar]]] = [[] for _ in range(slots)]
        hint_load = np.zeros(slots, dtype=np.int64)

        def unit(x: float) -> int:
            return int(round(x * US))

        x_vars: dict[int, list[tuple[int, cp_model.IntVar]]] = {}
        sizes_present = sorted(set(a.size.tolist()))
        for i in big:
            cand = {where[i]}
            cur = int(a.size[where[i]])
            for s in (cur // 2, cur, cur * 2):
                if s in sizes_present and s >= costs.min_cp[i]:
                    pool = np.flatnonzero(a.size == s)
                    cand.update(
                        pool[np.argsort(loads[pool], kind="stable")][
                            : self.candidates_per_size
                        ].tolist()
                    )
            row = []
            for j in sorted(cand):
                v = model.new_bool_var(f"x{i}_{j}")
                model.add_hint(v, int(j == where[i]))
                c = unit(t[a.row[j], i])
                terms[j].append((c, v))
                if j == where[i]:
                    hint_load[j] += c
                row.append((j, v))
            model.add_exactly_one(v for _, v in row)
            x_vars[i] = row
        n_vars: dict[tuple[int, int], list[tuple[int, list[int], cp_model.IntVar]]] = {}
        for key, ids in buckets.items():
            if not self.deterministic and time.perf_counter() - start > BUILD_SHARE * time_limit:
                # The model alone would eat the deadline (thousands of slots): give up early.
                build = time.perf_counter() - start
                return a, CpSatResult(
                    "SKIPPED: model too large for the time left",
                    build,
                    build,
                    None,
                    None,
                    False,
                    len(big),
                    len(buckets),
                    0,
                )
            min_cp = key[0]
            eligible = np.flatnonzero(a.size >= min_cp).tolist()
            count_now = np.zeros(slots, dtype=np.int64)
            for i in ids:
                count_now[where[i]] += 1
            row = []
            for j in eligible:
                mean = float(t[a.row[j], ids].mean())
                v = model.new_int_var(0, len(ids), f"n{key[0]}_{key[1]}_{j}")
                model.add_hint(v, int(count_now[j]))
                c = unit(mean)
                terms[j].append((c, v))
                hint_load[j] += c * int(count_now[j])
                row.append((j, ids, v))
            model.add(sum(v for _, _, v in row) == len(ids))
            n_vars[key] = row
        # A slot in use pays its fixed micro-batch costs (constant, ring steps' kernel and link
        # latency): priced as a one-token micro-batch at its size.
        model_ = a.costs.model
        fixed = {
            s: unit(float(model_.alone_seconds(s, np.ones(1, np.int64))[0])) for s in sizes_present
        }
        for j in range(slots):
            if not terms[j]:
                continue
            used = model.new_bool_var(f"u{j}")
            model.add_hint(used, int(bool(a.items[j])))
            model.add(sum(v for _, v in terms[j]) <= len(costs.lengths) * used)
            f = fixed[int(a.size[j])]
            terms[j].append((f, used))
            hint_load[j] += f * int(bool(a.items[j]))
        horizon = int(hint_load.max()) * 2 + 1 if slots else 1
        total = 0
        levels = []
        for w in range(a.n_waves):
            m = model.new_int_var(0, horizon, f"M{w}")
            members = np.flatnonzero(a.wave == w).tolist()
            model.add_hint(m, int(hint_load[members].max()) if members else 0)
            for j in members:
                if terms[j]:
                    model.add(sum(c * v for c, v in terms[j]) <= m)
            levels.append(m)
            total += m
        model.minimize(total)
        n_variables = sum(len(r) for r in x_vars.values()) + sum(len(r) for r in n_vars.values())
        build = time.perf_counter() - start
        remaining = time_limit - build
        if remaining <= 0.002 and not self.deterministic:
            return a, CpSatResult(
                "SKIPPED", build, build, None, None, False, len(big), len(buckets), n_variables
            )
        solver = cp_model.CpSolver()
        params = solver.parameters
        params.random_seed = self.seed
        if self.deterministic:
            params.num_workers = 1
            params.max_deterministic_time = max(time_limit, 1e-3)
        else:
            params.num_workers = 2
            params.max_time_in_seconds = remaining
        if time_limit < 0.5:
            params.cp_model_presolve = False
        status = solver.solve(model)
        wall = time.perf_counter() - start
        name = status.name
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            if status in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID):
                log.warning("CP-SAT returned %s on a hinted model; keeping the incoming plan", name)
            return a, CpSatResult(
                name, wall, build, None, None, False, len(big), len(buckets), n_variables
            )
        objective = solver.objective_value / US
        bound = solver.best_objective_bound / US
        improved = solver.objective_value < sum(
            int(hint_load[np.flatnonzero(a.wave == w)].max()) for w in range(a.n_waves)
        )
        out = self._realise(a, solver, x_vars, n_vars)
        result = CpSatResult(
            name, wall, build, objective, bound, improved, len(big), len(buckets), n_variables
        )
        return out, result

    @staticmethod
    def _realise(
        a: Assignment,
        solver: cp_model.CpSolver,
        x_vars: dict[int, list[tuple[int, cp_model.IntVar]]],
        n_vars: dict[tuple[int, int], list[tuple[int, list[int], cp_model.IntVar]]],
    ) -> Assignment:
        t = a.costs.seconds
        items: list[list[int]] = [[] for _ in a.items]
        for i, row in x_vars.items():
            j = next(j for j, v in row if solver.boolean_value(v))
            items[j].append(i)
        load = np.asarray([float(t[r, ids].sum()) if ids else 0.0 for r, ids in zip(a.row, items)])
        where = {i: j for j, ids in enumerate(a.items) for i in ids}
        lengths = a.costs.lengths
        for key in sorted(n_vars):
            row = n_vars[key]
            ids = sorted(row[0][1], key=lambda i: (-int(lengths[i]), i))
            left = {j: int(solver.value(v)) for j, _, v in row}
            # Sequences stay where they were while their slot keeps a count for the bucket;
            # only the surplus moves, dealt longest first to the least-loaded slot with room.
            movers = []
            for i in ids:
                j = where[i]
                if left.get(j, 0) > 0:
                    items[j].append(i)
                    load[j] += t[a.row[j], i]
                    left[j] -= 1
                else:
                    movers.append(i)
            left = {j: n for j, n in left.items() if n > 0}
            for i in movers:
                j = min(left, key=lambda j: (load[j], j))
                items[j].append(i)
                load[j] += t[a.row[j], i]
                left[j] -= 1
                if left[j] == 0:
                    del left[j]
        return Assignment(a.wave, a.start, a.size, a.row, items, a.costs)
