"""The tight lower bound: a linear relaxation of the plan contract, solved with OR-tools' GLOP.

Notation: W ranks, capacity C tokens per rank per micro-batch, allowed CP sizes c; for sequence i
at size c: ``alone[i, c]`` its seconds as its own micro-batch, ``r[i, c]`` the additive
lower-bound rank-seconds of the cost-model protocol (``bound_rank_seconds``), ``pad[i, c]`` its
memory footprint (the plan contract's zigzag padding); ``F[c]`` the protocol's ``fixed_seconds``
(what every micro-batch at c pays whatever it holds), ``o`` the wave overhead. ``LB0`` is the
closed-form bound of ``dyncp.planner.bound``. A sequence is *big* at c > 1 when
``pad[i, c] > c C / 2``.

Variables: ``y[i, c]`` in [0, 1] (sequence i runs at size c), ``n[c]`` >= 0 (micro-batches at c,
by memory), ``m[c]`` >= 0 for c > 1 (micro-batches at c, by what the free sequences need),
``z`` >= 0 (passes at size 1 the fixed sequences need at least), ``T`` (step seconds without one
wave overhead). Minimise T subject to::

    (assign)   sum_c y[i, c] = 1                                      every sequence once
    (alone)    T >= sum_c alone[i, c] y[i, c]                          its micro-batch, whole
    (memory)   c C n[c] >= sum_i pad[i, c] y[i, c]                     capacity per rank per pass
    (area)     W T >= sum_{i,c} r[i, c] y[i, c] + sum_c c F[c] n[c]    the busiest rank >= mean
    (active)   W T >= sum_{i,c} r[i, c] y[i, c] + sum_c c (F[c] - F[1]) n[c] + W F[1]
    (big)      W T >= sum_{c > 1, i big at c} c alone[i, c] y[i, c]
    (old)      T >= LB0 - o
    (exists)   m[c] >= y[i, c]  (free i);   m[c] >= sum_{free i big at c} y[i, c];
               c C m[c] >= sum_{free i} pad[i, c] y[i, c]                         (c > 1)
    (spill)    C z >= tokens of the fixed sequences - sum_{c > 1} (c C m[c] - sum_{free i}
               pad[i, c] y[i, c])
    (count)    W T >= sum_{i,c} r[i, c] y[i, c] + sum_{c > 1} c F[c] m[c]
               + F[1] (sum_{free i} pad[i, 1] y[i, 1] / C + z)

and report ``T + o``. Sequences that no constraint can favour at another size -- minimum size 1,
cheapest ``r`` at size 1, ``alone`` at size 1 within LB0 - o -- are fixed at size 1 and enter as
constants (their ``r`` and tokens), so the LP has a few dozen sequences, not thousands.

Fractional sizes let the relaxation run a long sequence partly on a small group (cheap
rank-seconds) and partly on a large one (short time alone), which no plan can. So the LP sits in
a best-first branch and bound over sizes: a node fixes some free sequences' sizes (their ``y``
to 0 or 1); the node with the least value is expanded on the longest free sequence (by its
least time alone) that it runs at a mix of sizes, one child per size, each valued first by the
larger of its parent's value and its closed form (the longest time alone among its fixed
sequences, or the mean busy time with them there and every other sequence at its cheapest
``r``), and solved when it is the least again. It stops when the least node is solved and has
nothing fractional to branch on, after ``max_solves`` LPs, or after ``STALLED_SOLVES`` LPs in a
row that left the least open value where it was; the least value over the open nodes is
reported.

Why it is a lower bound (a valid plan P of S step seconds gives a feasible point of the LP of the
open node whose fixings agree with P, with T = S - o):

- y = P's sizes (one per sequence); n[c] = the fractional count its tokens need, which is at most
  P's real count N[c] (each P micro-batch holds at most c C padded tokens: memory);
- P has waves with levels M_w (slowest group) and S = sum_w (M_w + o) >= sum_w M_w + o, so T =
  S - o >= sum_w M_w. A sequence's micro-batch lies inside one wave: T >= its time >= alone
  (the protocol: adding sequences never makes a micro-batch faster);
- every rank's busy time is at most sum_w M_w <= T. Busy time sums, over the rank's micro-batches,
  ``microbatch_seconds >= F[c] + sum r / c`` (protocol contract 2), so the ranks' total is at least
  sum r + sum_c c F[c] N[c] (area). With U <= W ranks busy and k >= U micro-batch-rank slots, the
  busiest rank has at least (sum r + extra + F[1] max(U, k)) / U >= (sum r + extra) / W + F[1]
  (active), where extra = sum_c c (F[c] - F[1]) n[c] and F[c] >= F[1];
- a big sequence fills more than half a micro-batch, so two never share one: their micro-batches
  are distinct, each holds c ranks for at least ``alone``, and groups running at the same time are
  disjoint, so these rank-seconds fit in W T (big);
- LB0 is a valid bound (its own proof) and S >= LB0;
- (exists, spill, count) speak of P as it is, wherever P runs the fixed sequences: with m[c] =
  the largest of the three right-hand sides of (exists), m[c] <= N[c], since P has a micro-batch
  at c when any sequence runs there, one per big sequence there, and enough for the free
  sequences' tokens. P's micro-batches at c > 1 beyond m[c] number d[c] = N[c] - m[c] >= 0. The
  fixed sequences' tokens (at least their lengths, ``pad`` at size 1) that P runs at c > 1 fit in
  the room its micro-batches there leave, c C N[c] - sum_{free} pad[i, c] y[i, c]; the rest run
  at size 1, so C N[1] >= free tokens at 1 + C z - C sum_{c > 1} c d[c], with z the (spill)
  minimum (clamped at 0, where N[1] >= free tokens at 1 / C alone serves). The ranks' total is
  at least sum r + sum_{c > 1} c F[c] (m[c] + d[c]) + F[1] N[1]; as F[c] >= F[1], the d[c]
  terms cancel what they take from N[1], leaving the right-hand side of (count). Sum r over P's
  sizes is at least the LP's, which charges the fixed sequences their r at size 1, their least;
- fixing a sequence at size 1 keeps P's point feasible for the other rows: moving it there lowers
  or keeps every left side (r, pad and F are smallest at size 1; its ``alone`` there is within
  LB0 - o <= T; the big row only counts c > 1; (exists, spill, count) do not move it);
- P runs every sequence at one size, so exactly one open node's fixings agree with P (the root
  does; expanding a node replaces it by children covering every size of one sequence). Every
  value that node records is at most S: its LP's Lagrangian bound (+ o), at most its LP
  optimum + o <= S; its parent's recorded value, at most the parent's LP optimum + o, which is
  at most the child's (the child's feasible set lies in the parent's); its closed form, LB0's
  argument for the fixed sequences at their sizes (each runs alone at least ``alone``; the
  mean busy time is at least the sum of r at P's sizes, each other sequence at its cheapest,
  over W). A node whose LP is infeasible holds no plan within the variable boxes; such plans
  are slower than the serial plan (each sequence alone at its fastest size, one wave each),
  whose node is feasible. So the least open value is at most S.

The two longest (by least time alone) free sequences i, j are branched on first, whatever the
LP does with them; once a node fixes their sizes c_i, c_j (times alone a_i, a_j, rank-seconds
r_i, r_j), its value is also at least the least of what each way a plan can run them costs:

- in one micro-batch (c_i = c_j, their tokens fit): S >= its seconds + o (contract 1);
- in one group, or in two waves: their micro-batches run one after the other, S >= a_i + a_j + o;
- in one wave w, two groups (c_i + c_j <= W): with L = a* = max(a_i, a_j) <= L_w, the ranks of
  both groups spend (c_i + c_j) L_w in w. Every other micro-batch (outside those two groups in
  w) costs its ranks at least the r of its sequences (contract 2), at least their least r,
  ``rmin``. A sequence s that runs in one of the two groups ("rides") saves its rmin there but
  takes r(s, c) >= w_s = min(r(s, c_i), r(s, c_j)) >= rmin(s) of the groups' busy time, which is
  at most c (L_w - F[c]) - r_i (resp. r_j) per group (contract 2 over the group's micro-batches
  in w). So W (S - o) >= (c_i + c_j) L_w + sum_{s != i, j} rmin(s) - saved, where saved, the
  riders' rmin, is at most K(X(L_w)), K(X) the fractional knapsack of values rmin(s), weights
  w_s, capacity X(L) = X_i(L) + X_j(L), X_i(L) = c_i (L - F[c_i]) - r_i (each clamped at 0):
  the riders' weights fit both rooms together. It is also at most K_i(X_i(L_w)) +
  K_j(X_j(L_w)), K_g the fractional knapsack at weights r(s, c_g): the riders of group g take
  r(s, c_g) of its room alone, so they are a packing of that knapsack, and saved splits into
  the two groups' riders. The smaller of the two bounds serves. Every ratio rmin / w_s and
  rmin / r(s, c_g) is <= 1, so each knapsack grows at most as fast as its capacity, which
  grows as (c_i + c_j) L (resp. c_g L): the right side is least at L = a*.

The node's value is the larger of its LP's and the least of these (the pair bound).

So the reported value is at most S for every plan. It is not GLOP's objective but the Lagrangian
bound of its dual solution evaluated in float64 over explicit variable boxes (each containing
the point above: T <= the serial plan's seconds, n[c] <= all tokens at c, m[c] <= that plus the
number of free sequences, z <= the fixed tokens / C), valid for any multipliers, so solver
tolerances cannot make the bound too high. If GLOP fails, LB0 is returned.

Cost: about 5-25 ms per 512-sequence step here (build + one to six solves); the simulator
computes it every step; the plan service may skip it (``Planner(bound="simple")``).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from ortools.linear_solver.python import model_builder as mb

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.bound import lower_bound, min_cp_sizes

__all__ = ["LpBound", "lp_lower_bound", "MAX_SOLVES"]

# LPs the branch and bound may solve per step (each 2-5 ms for 512 sequences here), and how many
# in a row may leave the least open value where it was before it stops.
MAX_SOLVES = 6
STALLED_SOLVES = 3


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
) -> LpBound:
    """Seconds no valid plan of ``lengths`` on ``topology`` beats under ``model`` (see module)."""
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

    # Best-first branch and bound on the sequences' sizes (module docstring).
    rmin = r.min(axis=0)
    options = [np.flatnonzero(pj == j) for j in range(nf)]

    # Branching order: the longest sequences first (by their least time alone).
    by_time = np.argsort(-alone[:, free].min(axis=0), kind="stable").tolist() if nf else []
    shared: dict[tuple[int, int], float] = {}

    def pair(fix: dict[int, int]) -> float:
        """The two longest sequences' bound once both sizes are fixed (module docstring)."""
        if nf < 2 or by_time[0] not in fix or by_time[1] not in fix:
            return 0.0
        qa, qb = fix[by_time[0]], fix[by_time[1]]
        key = (int(pk[qa]), int(pk[qb]))
        if key not in shared:
            i, j = int(pi[qa]), int(pi[qb])
            together = np.inf
            if key[0] == key[1] and yp[qa] + yp[qb] <= csz[key[0]] * cap:
                together = model.microbatch_seconds(sizes[key[0]], lengths[[i, j]])
            shared[key] = _pair_value(
                (i, j), key, (float(ya[qa]), float(ya[qb])), together, (sizes, w, r, rmin, fixed)
            )
        return shared[key] + wo

    def closed(fix: dict[int, int]) -> float:
        if not fix:
            return 0.0
        qs = np.asarray(list(fix.values()))
        spread = (rmin.sum() - rmin[pi[qs]].sum() + yr[qs].sum()) / w
        return max(max(float(ya[qs].max()), spread) + wo, pair(fix))

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
        return max(got, pair(fix)), x[iy], status.name

    def branch(fix: dict[int, int], y: np.ndarray) -> int | None:
        """The longest free sequence the node runs at a mix of sizes; first, the two longest
        until both sizes are fixed (the pair bound needs them)."""
        top = next((j for j in by_time[:2] if j not in fix), None) if nf >= 2 else None
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
                return LpBound(lb0, lb0, status, nf, time.perf_counter() - start, solves)
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
        return LpBound(lb0, lb0, "INFEASIBLE", nf, time.perf_counter() - start, solves)
    return LpBound(max(best, lb0), lb0, name, nf, time.perf_counter() - start, solves)


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


def _pair_value(
    ids: tuple[int, int],
    rows: tuple[int, int],
    times: tuple[float, float],
    together: float,
    tables: tuple[list[int], int, np.ndarray, np.ndarray, np.ndarray],
) -> float:
    """Seconds (without the wave overhead) no plan beats that runs sequences ``ids`` at the
    sizes of ``rows`` (times alone ``times``), whether they share a wave or not (module
    docstring, "the two longest"); ``together``: one micro-batch of both (inf when their
    tokens do not fit one).

    tables: the allowed sizes, W, r (rank-seconds per size and sequence, inf where not
    allowed), its least per sequence, and the fixed seconds per size.
    """
    sizes, world, r, rmin, fixed = tables
    (i, j), (ki, kj) = ids, rows
    ci, cj = sizes[ki], sizes[kj]
    apart = min(times[0] + times[1], together)
    if ci + cj > world:
        return apart
    level = max(times)
    room_i = max(ci * (level - fixed[ki]) - r[ki, i], 0.0)
    room_j = max(cj * (level - fixed[kj]) - r[kj, j], 0.0)
    rest = np.ones(r.shape[1], dtype=bool)
    rest[[i, j]] = False
    value = rmin[rest]
    # What riders save: at most the fractional knapsack of both rooms together at each rider's
    # cheaper weight of the two groups, and at most the sum of each group's own knapsack at its
    # own weights (the riders of one group fit that group's room).
    saved = min(
        _knapsack(value, np.minimum(r[ki, rest], r[kj, rest]), room_i + room_j),
        _knapsack(value, r[ki, rest], room_i) + _knapsack(value, r[kj, rest], room_j),
    )
    shared = ((ci + cj) * level + float(value.sum()) - saved) / world
    return min(shared, apart)


def _knapsack(value: np.ndarray, weight: np.ndarray, room: float) -> float:
    """The fractional knapsack: the most ``value`` items of ``weight`` fit in ``room`` (items
    of infinite or zero weight left out)."""
    ok = np.isfinite(weight) & (weight > 0)
    ratio = value[ok] / weight[ok]
    order = np.argsort(-ratio, kind="stable")
    cum_w = np.cumsum(weight[ok][order])
    cum_v = np.cumsum(value[ok][order])
    n = int(np.searchsorted(cum_w, room))
    if n >= len(order):
        return float(cum_v[-1]) if len(order) else 0.0
    before_w = float(cum_w[n - 1]) if n else 0.0
    before_v = float(cum_v[n - 1]) if n else 0.0
    return before_v + (room - before_w) * float(ratio[order[n]])
