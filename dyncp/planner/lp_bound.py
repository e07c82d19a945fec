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
- two facts carry every row below under both timings (``dyncp.cost_model.evaluate``). (F1) a
  group of P lasts at least o + its micro-batches' seconds: barrier, its wave lasts its level
  M_w >= them plus o; dataflow, it takes o plus them. (F2) a rank that takes part in k >= 1
  groups is busy (micro-batch seconds, overheads excluded) for at most S - k o <= S - o:
  barrier, S = sum_w (M_w + o) and the rank is busy at most M_w in each wave; dataflow, it runs
  its groups one after another, each o plus its micro-batches. So with T = S - o, T >= a
  sequence's micro-batch time >= alone (F1; the protocol: adding sequences never makes a
  micro-batch faster);
- every rank's busy time is at most T (F2; an idle rank's is 0). Busy time sums, over the
  rank's micro-batches, ``microbatch_seconds >= F[c] + sum r / c`` (protocol contract 2), so
  the ranks' total is at least sum r + sum_c c F[c] N[c] (area). With U <= W ranks busy and
  k >= U micro-batch-rank slots, the busiest rank has at least (sum r + extra + F[1] max(U, k))
  / U >= (sum r + extra) / W + F[1] (active), where extra = sum_c c (F[c] - F[1]) n[c] and
  F[c] >= F[1];
- a big sequence fills more than half a micro-batch, so two never share one: their micro-batches
  are distinct, each keeps its c ranks busy for at least ``alone``, and the ranks' busy time is
  at most W T (F2), so these rank-seconds fit in W T (big);
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

Any menu (``dyncp.plan.menu``): c ranges over ``topology.group_sizes`` and the only use of where
groups sit is that groups running at once hold disjoint ranks, at most W in a wave (dataflow: a rank
runs one group at a time, any ranks per group). Neither needs sizes
that are powers of two, nor aligned blocks; the placement rules only remove plans, so the bound
holds for every menu (tests/unit/planner/test_lp_bound_exact.py checks it against the exhaustive
optimum on menus of 3, 5, 6 and 12).

The ``TOP`` longest (by least time alone) free sequences are branched on first, whatever the LP
does with them. A node that fixes the sizes of a set H of them (each h at size c_h, time alone
a_h, rank-seconds r_h) also gets the holding bound of H: the least, over every way a plan can lay
H out, of what that layout costs. It depends on the timing.

Wave-holding (``timing="barrier"``). A layout is a partition of H into groups (one size each),
and of the groups into waves (sizes summing to at most W). In a plan P with that layout:

- a group g spends at least t_g in its wave: the cheapest split of its sequences into
  micro-batches that fit (c C tokens), each at least its contract-1 seconds (one alone: a_h);
- a wave q holding groups G_q has level L_q >= A_q = max_{g in G_q} t_g, and S >= sum_q (L_q + o),
  so S - o >= sum_q L_q + (p - 1) o for p waves;
- the (rank, wave) cells of P are disjoint, and W (S - o) >= W sum_w M_w counts them all with
  their levels. Group g holds its c_g ranks for L_q in its wave q: c_g L_q. Every other sequence
  s runs either in one of those groups (it "rides") or in a micro-batch outside them, of some
  size c, which holds at most c C padded tokens and costs its c ranks at least c F[c] + the sum
  of its sequences' r (contract 2); shared by tokens, s pays at least r(s, c) + F[c] len(s) / C
  >= v_s = rmin(s) + F_min len(s) / C. Let R be the sizes of H's groups in this layout, w_s =
  min_{c in R} r(s, c) and u_s = min(v_s, w_s) <= v_s. So W (S - o) >= sum_q sum_{g in G_q}
  c_g L_q + sum_{s not in H} u_s - saved, where saved, the riders' u, is bounded twice. A
  rider of g takes r(s, c_g) >= w_s of g's busy time, which is at most X_g = c_g (L_q - F[c_g])
  - sum_{h in g} r_h (contract 2 over g's micro-batches in q; clamped at 0): saved <= K(sum_g
  X_g), K the fractional knapsack of values u_s, weights w_s; and saved <= sum_g K_g(X_g), K_g
  at weights r(s, c_g) (g's riders are a packing of g's own knapsack). The smaller serves.
- Each ratio u_s / w_s and u_s / r(s, c_g) is <= 1 (c_g in R), so each knapsack, and so their
  minimum, grows at most as fast as its capacity, which grows as sum_{g in G_q} c_g L_q: both
  sides are least at L_q = A_q, where the layout's value is (p - 1) o + max(sum_q A_q,
  (sum_q sum_{g in G_q} c_g A_q + sum_{s not in H} u_s - saved) / W).

P has one layout of H, so S - o is at least the least layout value. The node's value is the
larger of its LP's and this; ``TOP`` = 2 is the pair bound (two groups in one wave, or the two
one after the other).

Dataflow holding (``timing="dataflow"``, the default). Under dataflow no group waits for a wave
to end, so a group's ranks are not held for its wave's level (they start their next group as
soon as it is over) and overheads are paid per group, not per wave: the barrier layout value
above can exceed a dataflow plan (tests/unit/planner/test_lp_bound_exact.py builds one). A layout
is a partition of H into groups (one size each); in a plan P with that layout:

- group g lasts at least o + t_g (F1; t_g as above) on c_g ranks, each of which runs it apart
  from its other groups (one after another), and it starts when its last member is free. So P's
  groups are a schedule of rigid tasks (c ranks for d seconds, any ranks, none running two at
  once), and S >= the least makespan of H's groups alone as such tasks with d_g = o + t_g
  (leaving out tasks and shortening them never lengthens the least makespan). With ranks
  interchangeable, starting the tasks in the order of an optimal schedule's start times, each
  no earlier than the one before and as soon as c ranks are free, starts each no later than
  the optimum (the ranks busy then run tasks that are running in the optimum too), so the least
  makespan is the least over the orders of H's groups (at most 4! here) of that list schedule;
- busy time: W (S - o) >= the ranks' total busy time + o sum_rho (k_rho - 1)^+ (F2, rank by
  rank), and sum_rho (k_rho - 1)^+ >= sum_g c_g - W. The micro-batches that hold H's sequences
  in group g cost its ranks at least max(c_g t_g, c_g F[c_g] + sum_{h in g} r_h + rho_g),
  rho_g the r of the other sequences riding in them (contract 2; contract 1 for t_g), that is
  c_g t_g + max(0, rho_g - X_g) with X_g = c_g (t_g - F[c_g]) - sum_{h in g} r_h: the
  wave-holding argument with L_q replaced by t_g (no level to idle to), riders, knapsacks and
  the u_s as there.

The layout's value is max(that makespan - o, (sum_g c_g t_g + o (sum_g c_g - W)^+ + sum_{s not in
H} u_s - saved) / W); P has one layout, so S - o is at least the least value.

So the reported value is at most S for every plan. It is not GLOP's objective but the Lagrangian
bound of its dual solution evaluated in float64 over explicit variable boxes (each containing
the point above: T <= the serial plan's seconds, n[c] <= all tokens at c, m[c] <= that plus the
number of free sequences, z <= the fixed tokens / C), valid for any multipliers, so solver
tolerances cannot make the bound too high. If GLOP fails, LB0 is returned.

``timing="barrier"`` gives the bound of the barrier objective (bit for bit what it was before
dataflow); ``"dataflow"`` one that holds for both (dataflow is never slower than barrier on a
plan): the holding part differs, and the dataflow bound is then raised to the rounding bound of
``dyncp.planner.rounding`` (valid under both by F1 and F2; left out of the barrier bound only to
keep it as it was). Every other part holds under both, by F1 and F2: the LP rows, the closed
form LB0 (``dyncp.planner.bound``) and each node's closed form. The reported value is never
below LB0.

Cost: about 5-25 ms per 512-sequence step here (build + one to six solves, and up to a few
hundred layouts of the ``TOP`` = 4 longest sequences per distinct set of their sizes; the
rounding bound adds a few milliseconds: where the LP is tight its first check fails and it
stops); the simulator computes it every step; the plan service may skip it
(``Planner(bound="simple")``).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from ortools.linear_solver.python import model_builder as mb

from dyncp.cost_model.evaluate import check_timing
from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.bound import lower_bound, min_cp_sizes
from dyncp.planner.rounding import ROUNDINGS, rounding_bound

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
    ``timing`` (``dyncp.cost_model.evaluate.TIMINGS``; see the module docstring)."""
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

    # Best-first branch and bound on the sequences' sizes (module docstring).
    rmin = r.min(axis=0)
    options = [np.flatnonzero(pj == j) for j in range(nf)]

    # Branching order: the longest sequences first (by their least time alone).
    by_time = np.argsort(-alone[:, free].min(axis=0), kind="stable").tolist() if nf else []
    riders = _Riders(r, rmin + fixed.min() * lengths / cap)
    held_cache: dict[tuple[tuple[int, int], ...], float] = {}

    def held(fix: dict[int, int]) -> float:
        """The wave-holding bound of the longest sequences the node fixes (module docstring)."""
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
    """``bound`` raised to the rounding bound (``dyncp.planner.rounding``) where that is
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


def _partitions(items: list) -> Iterator[list[list]]:
    """Every set partition of ``items`` (blocks as lists)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for b in range(len(part)):
            yield [*part[:b], [first, *part[b]], *part[b + 1 :]]


class _Riders:
    """Fractional knapsacks of the sequences other than a held set. A sequence outside the held
    groups costs at least ``u`` = min(least r + F_min tokens / C, its least r over ``vrows``);
    as a rider it weighs its r at one size, or the least over several (``wrows``, a subset of
    ``vrows``, so u / weight <= 1). Sorted once per (wrows, vrows, held set)."""

    def __init__(self, r: np.ndarray, floor: np.ndarray) -> None:
        self.r, self.floor = r, floor
        self.values: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
        self.tables: dict[tuple[tuple[int, ...], ...], tuple[np.ndarray, ...]] = {}

    def value(self, vrows: tuple[int, ...], held: tuple[int, ...]) -> np.ndarray:
        """u per sequence, 0 for the held ones."""
        key = (vrows, held)
        if key not in self.values:
            u = np.minimum(self.floor, self.r[list(vrows)].min(axis=0))
            u[list(held)] = 0.0
            self.values[key] = u
        return self.values[key]

    def rest(self, vrows: tuple[int, ...], held: tuple[int, ...]) -> float:
        """What the sequences not held cost at least, riding nowhere."""
        return float(self.value(vrows, held).sum())

    def best(
        self, wrows: tuple[int, ...], vrows: tuple[int, ...], held: tuple[int, ...], room: float
    ) -> float:
        """Most u the non-held sequences fit in ``room`` at weights min over ``wrows``."""
        if room <= 0:
            return 0.0
        key = (wrows, vrows, held)
        if key not in self.tables:
            weight = self.r[list(wrows)].min(axis=0)
            u = self.value(vrows, held)
            ok = np.isfinite(weight) & (weight > 0)
            ok[list(held)] = False
            ratio = u[ok] / weight[ok]
            order = np.argsort(-ratio, kind="stable")
            self.tables[key] = (
                np.cumsum(weight[ok][order]),
                np.cumsum(u[ok][order]),
                ratio[order],
            )
        cum_w, cum_v, ratio = self.tables[key]
        n = int(np.searchsorted(cum_w, room))
        if n >= len(cum_w):
            return float(cum_v[-1]) if len(cum_w) else 0.0
        before_w = float(cum_w[n - 1]) if n else 0.0
        before_v = float(cum_v[n - 1]) if n else 0.0
        return before_v + (room - before_w) * float(ratio[n])


def _held_value(
    items: list[tuple[int, int, float, float]],
    riders: _Riders,
    model: CostModel,
    lengths: np.ndarray,
    tables: tuple[list[int], int, int, np.ndarray, float],
    *,
    timing: str = "barrier",
) -> float:
    """Seconds (without one wave overhead) no plan beats that runs each of ``items`` (sequence,
    size row, time alone, r) at its size, however it lays them out in groups and waves (module
    docstring, "wave-holding" for ``"barrier"``, "dataflow holding" for ``"dataflow"``).

    tables: the allowed sizes, W, C, the fixed seconds per size, the wave overhead.
    """
    sizes, world, cap, fixed, wo = tables
    held = tuple(sorted(i for i, *_ in items))
    best = np.inf
    for groups in _partitions(items):
        if any(len({k for _, k, *_ in g}) > 1 for g in groups):
            continue  # a group has one size
        times = [_group_seconds(g, sizes[g[0][1]], cap, model, lengths) for g in groups]
        if not all(np.isfinite(times)):
            continue
        if timing == "dataflow":
            best = min(best, _dataflow_layout(groups, times, riders, held, tables))
            continue
        for waves in _partitions(list(range(len(groups)))):
            if any(sum(sizes[groups[g][0][1]] for g in q) > world for q in waves):
                continue
            span, hold, rooms, rows = 0.0, 0.0, [], []
            for q in waves:
                level = max(times[g] for g in q)
                span += level
                for g in q:
                    k = groups[g][0][1]
                    hold += sizes[k] * level
                    room = sizes[k] * (level - fixed[k]) - sum(x[3] for x in groups[g])
                    rooms.append(max(room, 0.0))
                    rows.append(k)
            every = tuple(sorted(set(rows)))
            saved = min(
                sum(riders.best((k,), every, held, x) for k, x in zip(rows, rooms, strict=True)),
                riders.best(every, every, held, sum(rooms)),
            )
            rest = riders.rest(every, held)
            value = (len(waves) - 1) * wo + max(span, (hold + rest - saved) / world)
            best = min(best, value)
    return best


def _dataflow_layout(
    groups: list[list[tuple[int, int, float, float]]],
    times: list[float],
    riders: _Riders,
    held: tuple[int, ...],
    tables: tuple[list[int], int, int, np.ndarray, float],
) -> float:
    """The dataflow value of one grouping of the held sequences (module docstring, "dataflow
    holding"): the larger of the least makespan of the groups as rigid tasks (size, wave
    overhead + least seconds) minus one overhead, and the ranks' busy time with the riders'
    knapsacks, each group charged its own seconds (no wave level to idle to)."""
    sizes, world, _, fixed, wo = tables
    rows = [g[0][1] for g in groups]
    tasks = [(sizes[k], wo + t) for k, t in zip(rows, times, strict=True)]
    rooms = [
        max(sizes[k] * (t - fixed[k]) - sum(x[3] for x in g), 0.0)
        for k, t, g in zip(rows, times, groups, strict=True)
    ]
    busy = sum(sizes[k] * t for k, t in zip(rows, times, strict=True))
    # Every rank pays the overhead once per group it is in; one is the caller's.
    busy += wo * max(sum(sizes[k] for k in rows) - world, 0)
    every = tuple(sorted(set(rows)))
    saved = min(
        sum(riders.best((k,), every, held, x) for k, x in zip(rows, rooms, strict=True)),
        riders.best(every, every, held, sum(rooms)),
    )
    rest = riders.rest(every, held)
    return max(_rigid_makespan(tasks, world) - wo, (busy + rest - saved) / world)


def _rigid_makespan(tasks: list[tuple[int, float]], world: int) -> float:
    """Least makespan of non-preemptive rigid tasks (ranks, seconds) on ``world`` ranks, any
    ranks per task: the best over task orders of the schedule that starts each task, in that
    order, no earlier than the previous one, as soon as enough ranks are free. Such a schedule
    in the order of some optimal schedule's start times starts every task no later than it
    does (by induction: the ranks busy at that task's start are busy in the optimum too), so
    the least over orders is the optimum."""
    best = np.inf
    for order in _orders(len(tasks)):
        free = [(0.0, world)]  # (time a rank becomes free, how many), sorted by time
        start = end = 0.0
        for t in order:
            need, seconds = tasks[t]
            left, at = need, 0.0
            for time_free, count in free:
                at = time_free
                left -= count
                if left <= 0:
                    break
            start = max(start, at)
            done = start + seconds
            end = max(end, done)
            # The ``need`` earliest-free ranks now become free at ``done``.
            out, left = [], need
            for time_free, count in free:
                take = min(left, count)
                left -= take
                if count > take:
                    out.append((time_free, count - take))
            out.append((done, need))
            free = sorted(out)
        best = min(best, end)
    return best


def _orders(n: int) -> list[tuple[int, ...]]:
    """Every order of ``n`` items."""
    return list(itertools.permutations(range(n)))


def _group_seconds(
    group: list[tuple[int, int, float, float]],
    c: int,
    cap: int,
    model: CostModel,
    lengths: np.ndarray,
) -> float:
    """Least seconds a group of size ``c`` spends running ``group``'s sequences (time alone
    given) in one wave: the cheapest split into micro-batches that fit, each block at least its
    contract-1 seconds; inf when none fits (the last sequence alone always fits)."""
    if len(group) == 1:
        return group[0][2]
    best = np.inf
    for part in _partitions(group):
        total = 0.0
        for block in part:
            if len(block) == 1:
                total += block[0][2]
                continue
            ids = np.asarray([x[0] for x in block])
            if CostModel.padded(c, lengths[ids]).sum() > c * cap:
                total = np.inf
                break
            total += model.microbatch_seconds(c, lengths[ids])
        best = min(best, total)
    return best


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
