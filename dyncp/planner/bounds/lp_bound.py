"""The tight lower bound: a linear relaxation of the plan contract, solved with OR-tools' GLOP.

Minimise T, the step seconds less one wave overhead, over a relaxation of the plan contract: each
sequence assigned to CP sizes fractionally (``y[i, c]``), with rows for its time alone, memory per
pass, the ranks' busy area, big sequences and the passes every size needs; sequences that no row
can favour elsewhere are fixed at size 1 as constants. Fractional sizes are closed by a best-first
branch and bound over the longest sequences' sizes (at most ``MAX_SOLVES`` LPs), each node also
valued by the holding bound of the ``TOP`` longest (``dyncp.planner.bounds.holding``); under
dataflow the result is raised to the rounding bound (``dyncp.planner.bounds.rounding``). The value
reported is the Lagrangian bound of GLOP's dual over explicit variable boxes, so solver tolerances
cannot make it too high, and never below the closed form (``dyncp.planner.bounds.closed_form``).

The rows, the branch and bound and the proof that no valid plan, under either timing and on any
menu, beats the value: docs/lp-bound.md ("The tight lower bound, and why it is valid").

Cost: about 5-25 ms per 512-sequence step here (build + one to six solves, and up to a few
hundred layouts of the ``TOP`` = 4 longest sequences per distinct set of their sizes); the
simulator computes it every step; the plan service may skip it (``Planner(bound="simple")``).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from ortools.linear_solver.python import model_builder as mb

from dyncp.cost_model.evaluate import check_timing
from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.batch import min_cp_sizes
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.holding import _held_value, _Riders
from dyncp.planner.bounds.rounding import ROUNDINGS, rounding_bound

__all__ = ["LpBound", "lp_lower_bound", "MAX_SOLVES"]

# LPs the branch and bound may solve per step (each 2-5 ms for 512 sequences here), and how many
# in a row may leave the least open value where it was before it stops.
MAX_SOLVES = 6
STALLED_SOLVES = 3
# Longest sequences whose sizes are branched on first and whose wave layouts the wave-holding
# bound enumerates (its cost grows with the set partitions of TOP sequences, twice).
TOP = 4


@dataclass(frozen=True, slots=True)
class LpBound:
    """The tight bound and what it took.

    seconds: the bound (>= ``simple_seconds``); simple_seconds: the closed-form bound LB0;
    status: GLOP's status name, or "TRIVIAL" (no sequence left free, LB0 returned);
    variables: sequences kept free in the LP; wall_seconds: build + solves; solves: LPs solved.
    """

    seconds: float
    simple_seconds: float
    status: str
    variables: int
    wall_seconds: float
    solves: int = 1


def lp_lower_bound(
    lengths: np.ndarray,
    topology: Topology,
    model: CostModel,
    *,
    simple: float | None = None,
    max_solves: int = MAX_SOLVES,
    timing: str = "dataflow",
) -> LpBound:
    """Seconds no valid plan of ``lengths`` on ``topology`` beats under ``model``, timed as
    ``timing`` (``dyncp.cost_model.evaluate.TIMINGS``; docs/lp-bound.md)."""
    check_timing(timing)
    start = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    lb0 = lower_bound(lengths, topology, model) if simple is None else float(simple)
    if len(lengths) == 0:
        return LpBound(0.0, 0.0, "TRIVIAL", 0, time.perf_counter() - start)
    wo = model.wave_overhead
    w, cap = topology.world, topology.capacity
    sizes = list(topology.group_sizes)
    m = min_cp_sizes(lengths, topology)
    n_all = len(lengths)
    r = np.full((len(sizes), n_all), np.inf)
    alone = np.full((len(sizes), n_all), np.inf)
    pad = np.zeros((len(sizes), n_all))
    for k, c in enumerate(sizes):
        ok = m <= c
        if ok.any():
            r[k, ok] = model.bound_rank_seconds(c, lengths[ok])
            alone[k, ok] = model.alone_seconds(c, lengths[ok])
            pad[k, ok] = CostModel.padded(c, lengths[ok])
    fixed = np.asarray([model.fixed_seconds(c) for c in sizes])
    one = sizes.index(1) if 1 in sizes else None
    simple0 = lb0
    if one is not None:
        short = (m == 1) & (r[one] <= r.min(axis=0)) & (alone[one] + wo <= lb0)
    else:
        short = np.zeros(n_all, dtype=bool)
    free = np.flatnonzero(~short)
    const_r = float(r[one, short].sum()) if one is not None else 0.0
    const_tokens = float(pad[one, short].sum()) if one is not None else 0.0

    # Variable layout: [T] + y[(i, k) pairs] + n[k] + m[k of c > 1] + z.
    pairs = [(j, k) for j, i in enumerate(free.tolist()) for k, c in enumerate(sizes) if m[i] <= c]
    ny, ns = len(pairs), len(sizes)
    ring = [k for k, c in enumerate(sizes) if c > 1]
    nm = len(ring)
    nv = 1 + ny + ns + nm + 1
    pj = np.asarray([p[0] for p in pairs], dtype=np.int64)
    pk = np.asarray([p[1] for p in pairs], dtype=np.int64)
    pi = free[pj] if ny else np.zeros(0, dtype=np.int64)
    yr = r[pk, pi]
    ya = alone[pk, pi]
    yp = pad[pk, pi]
    csz = np.asarray(sizes, dtype=np.float64)
    ycs = csz[pk]
    big = (ycs > 1) & (yp > ycs * cap / 2)
    iy = 1 + np.arange(ny)
    i_n = 1 + ny + np.arange(ns)
    i_m = {k: 1 + ny + ns + q for q, k in enumerate(ring)}
    i_z = nv - 1
    n_upper = (pad.sum(axis=1) / (csz * cap)) + 1.0
    t_upper = float(alone.min(axis=0).sum()) + n_all * wo + lb0

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(idx: np.ndarray, coef: np.ndarray, lower: float, upper: float) -> None:
        rows.append(np.full(len(idx), len(lo), dtype=np.int64))
        cols.append(np.asarray(idx, dtype=np.int64))
        vals.append(np.asarray(coef, dtype=np.float64))
        lo.append(lower)
        hi.append(upper)

    nf = len(free)
    for j in range(nf):
        sel = np.flatnonzero(pj == j)
        add(iy[sel], np.ones(len(sel)), 1.0, 1.0)  # assign
        add(np.r_[0, iy[sel]], np.r_[1.0, -ya[sel]], 0.0, np.inf)  # alone
    for k in range(ns):
        sel = np.flatnonzero(pk == k)
        extra = const_tokens if k == one else 0.0
        add(np.r_[i_n[k], iy[sel]], np.r_[csz[k] * cap, -yp[sel]], extra, np.inf)  # memory
    f1 = fixed[one] if one is not None else fixed.min()
    add(np.r_[0, iy, i_n], np.r_[float(w), -yr, -csz * fixed], const_r, np.inf)  # area
    add(
        np.r_[0, iy, i_n], np.r_[float(w), -yr, -csz * (fixed - f1)], const_r + w * f1, np.inf
    )  # active
    bsel = np.flatnonzero(big)
    add(np.r_[0, iy[bsel]], np.r_[float(w), -(ycs * ya)[bsel]], 0.0, np.inf)  # big
    add(np.asarray([0]), np.asarray([1.0]), lb0 - wo, np.inf)  # old
    spill_idx, spill_coef = [i_z], [float(cap)]
    for k in ring:  # exists
        sel = np.flatnonzero(pk == k)
        for q in sel.tolist():
            add(np.asarray([i_m[k], iy[q]]), np.asarray([1.0, -1.0]), 0.0, np.inf)
        bk = sel[big[sel]]
        if len(bk) > 1:
            add(np.r_[i_m[k], iy[bk]], np.r_[1.0, -np.ones(len(bk))], 0.0, np.inf)
        add(np.r_[i_m[k], iy[sel]], np.r_[csz[k] * cap, -yp[sel]], 0.0, np.inf)
        spill_idx += [i_m[k], *iy[sel].tolist()]
        spill_coef += [csz[k] * cap, *(-yp[sel]).tolist()]
    add(np.asarray(spill_idx), np.asarray(spill_coef), const_tokens, np.inf)  # spill
    at_one = np.flatnonzero(pk == one) if one is not None else np.zeros(0, np.int64)
    count_coef = np.zeros(nv)
    count_coef[0] = float(w)
    count_coef[iy] = -yr
    count_coef[iy[at_one]] -= f1 * yp[at_one] / cap
    for k in ring:
        count_coef[i_m[k]] = -csz[k] * fixed[k]
    count_coef[i_z] = -f1
    nz = np.flatnonzero(count_coef)
    add(nz, count_coef[nz], const_r, np.inf)  # count

    a = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(lo), nv)
    )
    var_hi = np.r_[t_upper, np.ones(ny), n_upper, n_upper[ring] + nf, const_tokens / cap]
    obj = np.zeros(nv)
    obj[0] = 1.0
    lo_a, hi_a = np.asarray(lo), np.asarray(hi)

    # Best-first branch and bound on the sequences' sizes (docs/lp-bound.md).
    rmin = r.min(axis=0)
    options = [np.flatnonzero(pj == j) for j in range(nf)]

    # Branching order: the longest sequences first (by their least time alone).
    by_time = np.argsort(-alone[:, free].min(axis=0), kind="stable").tolist() if nf else []
    riders = _Riders(r, rmin + fixed.min() * lengths / cap)
    held_cache: dict[tuple[tuple[int, int], ...], float] = {}

    def held(fix: dict[int, int]) -> float:
        """The wave-holding bound of the longest sequences the node fixes (docs/lp-bound.md)."""
        key = tuple((j, fix[j]) for j in by_time[:TOP] if j in fix)
        if not key:
            return 0.0
        if key not in held_cache:
            items = [(int(pi[q]), int(pk[q]), float(ya[q]), float(yr[q])) for _, q in key]
            held_cache[key] = _held_value(
                items, riders, model, lengths, (sizes, w, cap, fixed, wo), timing=timing
            )
        return held_cache[key] + wo

    def closed(fix: dict[int, int]) -> float:
        if not fix:
            return 0.0
        qs = np.asarray(list(fix.values()))
        spread = (rmin.sum() - rmin[pi[qs]].sum() + yr[qs].sum()) / w
        return max(max(float(ya[qs].max()), spread) + wo, held(fix))

    def solve(fix: dict[int, int]) -> tuple[float, np.ndarray | None, str]:
        var_lo = np.zeros(nv)
        hi_q = var_hi.copy()
        for j, q in fix.items():
            hi_q[iy[options[j]]] = 0.0
            var_lo[iy[q]] = hi_q[iy[q]] = 1.0
        lp = mb.Model()
        lp.helper.fill_model_from_sparse_data(var_lo, hi_q, obj, lo_a, hi_a, a)
        solver = mb.Solver("glop")
        status = solver.solve(lp)
        if status == mb.SolveStatus.INFEASIBLE:
            return np.inf, None, status.name
        if status != mb.SolveStatus.OPTIMAL:
            return np.nan, None, status.name
        duals = np.asarray(solver.dual_values(lp.get_linear_constraints()), dtype=np.float64)
        x = np.asarray(solver.values(lp.get_variables()), dtype=np.float64)
        got = _lagrangian(duals, a, lo_a, hi_a, obj, var_lo, hi_q) + wo
        return max(got, held(fix)), x[iy], status.name

    def branch(fix: dict[int, int], y: np.ndarray) -> int | None:
        """The longest free sequence the node runs at a mix of sizes; first, the ``TOP``
        longest until their sizes are fixed (the wave-holding bound needs them)."""
        top = next((j for j in by_time[:TOP] if j not in fix), None)
        if top is not None:
            return top
        return next((j for j in by_time if j not in fix and y[options[j]].max() < 1 - 1e-6), None)

    heap: list[tuple[float, int, dict[int, int], np.ndarray | None, bool]] = []
    solves, name, tick, stalled = 0, "OPTIMAL", 0, 0
    heapq.heappush(heap, (0.0, tick, {}, None, False))
    while heap:
        value, _, fix, y, solved = heapq.heappop(heap)
        tick += 1
        if not solved:
            if solves >= max_solves or stalled >= STALLED_SOLVES:
                heapq.heappush(heap, (value, tick, fix, y, solved))
                break
            got, y, status = solve(fix)
            solves += 1
            if np.isnan(got):  # GLOP failed: fall back to the closed form
                return LpBound(lb0, simple0, status, nf, time.perf_counter() - start, solves)
            tick += 1
            heapq.heappush(heap, (max(value, got), tick, fix, y, True))
            stalled = stalled + 1 if solves > 1 and heap[0][0] <= value * (1 + 1e-9) else 0
            continue
        j = branch(fix, y) if y is not None and np.isfinite(value) else None
        if j is None:
            heapq.heappush(heap, (value, tick, fix, y, solved))
            break
        for q in options[j].tolist():
            child = {**fix, j: q}
            tick += 1
            heapq.heappush(heap, (max(value, closed(child)), tick, child, None, False))
    best = heap[0][0] if heap else np.inf
    if not np.isfinite(best):
        best = lb0
        name = "INFEASIBLE"
    best = max(best, lb0)
    if timing == "dataflow":  # barrier keeps its bound as it was, bit for bit
        best = _rounded(best, m, r, alone, pad, fixed, one, lengths, topology, wo)
    return LpBound(best, simple0, name, nf, time.perf_counter() - start, solves)


def _rounded(
    bound: float,
    m: np.ndarray,
    r: np.ndarray,
    alone: np.ndarray,
    pad: np.ndarray,
    fixed: np.ndarray,
    one: int | None,
    lengths: np.ndarray,
    topology: Topology,
    wo: float,
) -> float:
    """``bound`` raised to the rounding bound (``dyncp.planner.bounds.rounding``) where that is
    higher. Sequences of minimum size 1, cheapest at size 1 and at most a quarter of
    ``bound`` - o alone at size 1 (no rounding counts them there) enter as their busy time at
    size 1, their least: r is least there, F[1] is the least F (contract 4), padding is least
    there."""
    low = bound - wo
    keep = np.ones(len(lengths), dtype=bool)
    kw: dict = {}
    if one is not None:
        left = (m == 1) & (r[one] <= r.min(axis=0)) & (alone[one] * (max(ROUNDINGS) + 1) <= low)
        if left.any():
            kw = {
                "other_busy": float(
                    (r[one, left] + fixed[one] * pad[one, left] / topology.capacity).sum()
                ),
                "other_r": r[:, left].min(axis=1),
                "other_pad": pad[:, left].min(axis=1),
            }
        keep = ~left
    if not keep.any():
        return bound
    t = rounding_bound(
        sizes=np.asarray(topology.group_sizes),
        alone=alone[:, keep],
        r=r[:, keep],
        pad=pad[:, keep],
        fixed=fixed,
        world=topology.world,
        capacity=topology.capacity,
        low=low,
        **kw,
    )
    return max(bound, t + wo)


def _lagrangian(
    duals: np.ndarray,
    a: sp.csr_matrix,
    lo: np.ndarray,
    hi: np.ndarray,
    obj: np.ndarray,
    var_lo: np.ndarray,
    var_hi: np.ndarray,
) -> float:
    """A certified lower bound of min obj.x s.t. lo <= A x <= hi, var_lo <= x <= var_hi.

    For any multipliers d (d >= 0 on rows with only a lower side, free on equalities),
    obj.x >= d.(A x) + (obj - A^T d).x >= d.lo + sum_j min over the box of (obj - A^T d)_j x_j.
    """
    eq = lo == hi
    d = np.where(eq, duals, np.maximum(duals, 0.0))
    reduced = obj - a.T @ d
    box = np.minimum(reduced * var_lo, reduced * var_hi)
    return float(d @ lo + box.sum())
