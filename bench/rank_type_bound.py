"""An offline, slower relaxation than the tight LP bound: how much of a gap is the bound's.

    python bench/rank_type_bound.py [--per-rank 4] [--batches 3]

On ``bench/planner_bench.py``'s sparse batches (64 ranks, 4 per node, capacity 2,048,
``--sparse-profile``) it prints the planner's plan (``time_limit`` 1 s), the tight bound
(``dyncp.planner.bounds.lp_bound``) and this relaxation's value over plans whose groups have at most
8 ranks (the planner's plans here use at most 4), found by bisection on T (each T an LP
feasibility problem solved with HiGHS; seconds per batch: an analysis, not a per-step bound).

The relaxation. T = step - one wave overhead. A rank's *type* is how many micro-batches it runs
at each CP size, k = (k_c); N_k >= 0 ranks have type k (sum N_k <= W). q[i, c, k] >= 0 is how
many of sequence i's c rank-shares (it runs at size c on c ranks) lie on ranks of type k, with
sum_k q[i, c, k] = c y[i, c], sum_c y[i, c] = 1, y[i, c] = 0 where i alone at c exceeds T. Per
type: (time) sum q r[i, c] / c <= N_k (T - sum_c k_c F[c]); (memory) sum q pad[i, c] / c <=
N_k k_c C for every c. What it adds to the LP: each rank runs a whole number of micro-batches
at each size and fits in T by itself (the LP counts micro-batches fractionally over all ranks).

Why every plan of step S gives a feasible point at T = S - o (under both timings; the facts F1,
F2 of ``dyncp.planner.bounds.lp_bound``): each rank runs whole micro-batches, k_c of them at size c,
and is busy at most T (F2); a micro-batch at c lasts at least F[c] + the sum of its sequences' r / c
(protocol contract 2) and holds on each of its c ranks at most C of their padded tokens / c. Give
each rank its type, N_k the count of ranks of type k, q the sequences' rank-shares where they
run: the time and memory rows hold rank by rank, so summed over a type's ranks. The types
enumerated are those whose k_c - 1 micro-batches at each size, full, fit within T at the least
r per padded token at c: a rank whose tokens at c would fit in k_c - 1 micro-batches is given
that type instead (its memory row still holds, its time row is looser), and one whose tokens do
not fit has at least (k_c - 1) C of them, which cost that much. T is infeasible when no point
exists.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

sys.path.insert(0, os.path.dirname(__file__))
import planner_bench as pb  # noqa: E402

from dyncp.cost_model import CostModel  # noqa: E402
from dyncp.planner import Planner  # noqa: E402


def tables(lengths: np.ndarray, model: CostModel, capacity: int, sizes: tuple[int, ...]):
    """r, pad, alone per size and sequence (inf where it does not fit), F per size."""
    k, n = len(sizes), len(lengths)
    r, alone, pad = np.full((k, n), np.inf), np.full((k, n), np.inf), np.zeros((k, n))
    for j, c in enumerate(sizes):
        ok = CostModel.padded(c, lengths) <= c * capacity
        r[j, ok] = model.bound_rank_seconds(c, lengths[ok])
        pad[j, ok] = CostModel.padded(c, lengths[ok])
        alone[j, ok] = model.alone_seconds(c, lengths[ok])
    fixed = np.asarray([model.fixed_seconds(c) for c in sizes])
    return r, pad, alone, fixed


def rank_types(t: float, fixed: np.ndarray, rate: np.ndarray, capacity: int) -> list[tuple]:
    """Types whose micro-batches beyond the first at each size could be full within ``t``."""
    most = [int(np.ceil(max(t - f, 0) / (capacity * q))) + 1 for f, q in zip(fixed, rate)]
    out = []
    for k in itertools.product(*[range(m + 1) for m in most]):
        busy = sum(kc * f for kc, f in zip(k, fixed))
        busy += sum(max(kc - 1, 0) * capacity * q for kc, q in zip(k, rate))
        if sum(k) and busy <= t:
            out.append(k)
    return out


def feasible(t: float, lengths: np.ndarray, world: int, capacity: int, sizes, tabs) -> bool:
    """Whether the relaxation (module docstring) has a point at T = ``t``."""
    r, pad, alone, fixed = tabs
    n, csz = len(lengths), np.asarray(sizes, dtype=np.float64)
    rate = np.where(np.isfinite(r), r / np.maximum(pad, 1), np.inf).min(axis=1)
    types = rank_types(t, fixed, rate, capacity)
    nt = len(types)
    kc = np.asarray(types, dtype=np.float64)  # (types, sizes)
    pairs = [(i, j) for i in range(n) for j in range(len(sizes)) if alone[j, i] <= t]
    if len({i for i, _ in pairs}) < n:
        return False
    keys = [(i, j, x) for i, j in pairs for x in range(nt) if types[x][j] > 0]
    if not keys:
        return False
    ki, kj, kx = (np.asarray(v) for v in zip(*keys))
    nq = len(keys)
    a_eq = sp.csr_matrix((1.0 / csz[kj], (ki, np.arange(nq))), shape=(n, nq + nt))
    rows, cols, vals = [], [], []
    row = 0

    def per_type(coef: np.ndarray, sel: np.ndarray, capacity_of: np.ndarray) -> None:
        nonlocal row
        rows.extend([row + kx[sel], row + np.arange(nt)])
        cols.extend([np.flatnonzero(sel), nq + np.arange(nt)])
        vals.extend([coef, -capacity_of])
        row += nt

    everything = np.ones(nq, dtype=bool)
    per_type(r[kj, ki] / csz[kj], everything, t - kc @ fixed)  # time
    for j, c in enumerate(sizes):
        sel = kj == j
        share = pad[j, ki[sel]] / c
        per_type(share, sel, kc[:, j] * capacity)  # memory
    rows.append(np.full(nt, row))
    cols.append(nq + np.arange(nt))
    vals.append(np.ones(nt))
    a_ub = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(row + 1, nq + nt),
    )
    b_ub = np.zeros(row + 1)
    b_ub[-1] = world
    res = linprog(
        np.zeros(nq + nt), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(n), method="highs"
    )
    return res.status == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-rank", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparse-profile", default="h100-megatron-dcp-gpt-plain")
    ap.add_argument("--steps", type=int, default=10, help="bisection steps on T")
    args = ap.parse_args()
    world, rpn, capacity = pb.SPARSE_WORLD, pb.SPARSE_RANKS_PER_NODE, pb.SPARSE_CAPACITY
    model = CostModel.load(args.sparse_profile, ranks_per_node=rpn)
    sizes = (1, 2, 4, 8)  # the relaxation covers plans with these group sizes only
    wo = model.wave_overhead
    print(f"sparse-{args.per_rank}, {args.sparse_profile}; sizes {sizes}")
    print(f"{'batch':>5}{'plan ms':>10}{'LP ms':>10}{'gap':>8}{'types ms':>10}{'gap':>8}")
    batches = pb.sparse_documents(args.per_rank * world, args.batches, args.seed)
    for b, batch in enumerate(batches):
        planner = Planner(
            model,
            world=world,
            ranks_per_node=rpn,
            capacity=capacity,
            max_length=pb.SPARSE_MAX,
            time_limit=1.0,
        )
        plan = planner.plan(batch)
        step, bound = plan.stats["predicted_step_seconds"], plan.stats["lower_bound_seconds"]
        tabs = tables(batch, model, capacity, sizes)
        lo, hi = bound - wo, step - wo
        for _ in range(args.steps):
            mid = 0.5 * (lo + hi)
            if feasible(mid, batch, world, capacity, sizes, tabs):
                hi = mid
            else:
                lo = mid
        types = lo + wo
        print(
            f"{b:>5}{step * 1e3:>10.2f}{bound * 1e3:>10.2f}{step / bound - 1:>8.2%}"
            f"{types * 1e3:>10.2f}{step / types - 1:>8.2%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
