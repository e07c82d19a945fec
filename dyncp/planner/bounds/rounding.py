"""The rounding bound: a lower bound from rounding each group's share of the step.

Per rank, the groups it runs fit in one step, so any dual-feasible rounding of their shares of
the step does too.

A plan whose step is S seconds, with T = S - o (o the wave overhead), has, under either timing of
``dyncp.cost_model.evaluate`` (facts F1 and F2 of ``dyncp.planner.bounds.lp_bound``): every rank's
groups, run one after another, last at most T together (F2 counts their micro-batches; a group
lasts at least the sum of its micro-batches). Give sequence i at size c a share x[i, c] of T such
that the shares of a micro-batch's sequences add up to at most its seconds / T:

- ``a[i, c] = r[i, c] / c + F[c] pad[i, c] / (c C)``, over T: a micro-batch at c lasts at least
  F[c] + the sum of its r / c (contract 2) and holds at most c C padded tokens;
- ``alone[i, c] / T`` when i shares its micro-batch with no other sequence in any plan of step
  <= S: it and the smallest other one exceed c C padded tokens, or their r exceed c (T - F[c])
  (then the shared micro-batch would last more than T).

Then on every rank the shares of the sequences of its groups add up to at most 1, and so, for a
dual-feasible function u (sum x <= 1 implies sum u(x) <= 1), do their u(x). Summed over ranks:
sum_i c_i u(x[i, c_i]) <= W. With u(x) = x this is the busy time (W T >= sum_i c_i x T, the
area); with Fekete and Schepers' u_k(x) = floor((k + 1) x) / k (lowered where (k + 1) x is a
whole number, which keeps it dual-feasible), k = 1 says that sequences longer than T / 2 never
share a rank, k = 2 that at most two longer than T / 3 do, and so on.

So T is impossible when no choice of sizes with ``alone <= T`` meets the area and one u_k sum
at once; for a multiplier lam >= 0 it is impossible when sum_i min_c (lam c u_k(x) + c x T) >
lam W + W T (a choice meeting both meets their combination). The least over c is concave in
lam, so the largest excess is found by bisection on its slope. Every T so shown impossible
gives S > T + o; the bound is the largest one found (bisection on T), plus o.

Where it binds: batches whose sequences each want a large share of the ranks for a large share
of the step, where the LP, which charges ranks only for busy time and may run a sequence partly
at two sizes, sees room that whole groups do not leave (tests/unit/planner/test_rounding_bound.py:
2-8 ranks, up to 28 points of the optimum). On the 64-rank scenarios of ``bench/bound_bench.py`` it
has not raised the bound so far; it costs one check there (the first T above the LP's is possible).
"""

from __future__ import annotations

import numpy as np

__all__ = ["rounding_bound", "ROUNDINGS"]

# The u_k used (k = 1: more than half the step; 2: a third; 3: a quarter).
ROUNDINGS = (1, 2, 3)
# The first T tried is low x (1 + FIRST_STEP); then bisection steps on T and on the multiplier.
FIRST_STEP = 1e-3
T_STEPS = 8
LAM_STEPS = 20
# Relative slack on every comparison with T, so that rounding never shows a possible T impossible.
SLACK = 1e-9


def rounding_bound(
    *,
    sizes: np.ndarray,
    alone: np.ndarray,
    r: np.ndarray,
    pad: np.ndarray,
    fixed: np.ndarray,
    world: int,
    capacity: int,
    low: float,
    other_busy: float = 0.0,
    other_r: np.ndarray | None = None,
    other_pad: np.ndarray | None = None,
) -> float:
    """The largest T >= ``low`` (seconds without one wave overhead) shown impossible, or ``low``
    when none is; ``low`` is the caller's bound on T.

    sizes: the allowed sizes (k,); alone, r, pad: (k, n) per size and sequence, inf (alone, r)
    where the sequence does not fit; fixed: F per size (k,). Sequences left out of the arrays:
    ``other_busy``, the rank-seconds they cost at least, none of them with a share above
    1 / (max(ROUNDINGS) + 1) at any size it would choose (the caller's choice: those at most
    that share of ``low`` alone at size 1, and cheapest there); ``other_r``, ``other_pad``: their
    least r and padding per size (k,), for the sharing test.

    First tries T a little above ``low`` (most batches stop there: the LP is tight), then
    doubles the step above ``low`` until a T is possible, then bisects.
    """
    if alone.shape[1] == 0 or not low > 0:
        return low
    c = np.asarray(sizes, dtype=np.float64)[:, None]
    fits = np.isfinite(r)
    shared = r / c + fixed[:, None] * pad / (c * capacity)  # a, seconds
    pad_fit = np.where(fits, pad, np.inf)
    pad_other = _least_other(pad_fit)
    r_other = _least_other(r)
    if other_pad is not None:
        pad_other = np.minimum(pad_other, np.asarray(other_pad, dtype=np.float64)[:, None])
    if other_r is not None:
        r_other = np.minimum(r_other, np.asarray(other_r, dtype=np.float64)[:, None])
    memory_alone = pad + pad_other > c * capacity

    def impossible(t: float) -> bool:
        # Sequences that share a micro-batch with nobody in a plan of step - o <= t.
        alone_only = memory_alone | (
            r + r_other > np.maximum(t - fixed, 0.0)[:, None] * c * (1 + SLACK)
        )
        share = np.where(alone_only, alone, shared)
        return _impossible(t, c, alone, share, world, other_busy)

    step = FIRST_STEP
    if not impossible(low * (1 + step)):
        return low
    best = low * (1 + step)
    while impossible(low * (1 + 2 * step)) and step < 1e3:
        step *= 2
        best = low * (1 + step)
    lo, hi = best, low * (1 + 2 * step)
    for _ in range(T_STEPS):
        t = 0.5 * (lo + hi)
        if impossible(t):
            best = lo = t
        else:
            hi = t
    return best


def _impossible(
    t: float, c: np.ndarray, alone: np.ndarray, share: np.ndarray, world: int, other: float
) -> bool:
    """Whether no plan has step - o <= ``t`` (module docstring); ``share`` in seconds."""
    ok = alone <= t * (1 + SLACK)
    if not ok.any(axis=0).all():
        return True  # a sequence is slower than t at every size
    budget = world * t - other
    area = np.where(ok, c * share, np.inf)
    if float(area.min(axis=0).sum()) > budget * (1 + SLACK):
        return True
    x = share / t
    cols = np.arange(alone.shape[1])
    for k in ROUNDINGS:
        psi = np.where(ok, c * np.floor((k + 1) * x * (1 - SLACK)) / k, 0.0)
        if float(np.where(ok, psi, np.inf).min(axis=0).sum()) > world:
            return True

        def excess(lam: float, psi: np.ndarray = psi) -> tuple[float, float]:
            cost = np.where(ok, lam * psi + area, np.inf)
            at = cost.argmin(axis=0)
            value = float(cost[at, cols].sum()) - lam * world - budget
            return value, float(psi[at, cols].sum()) - world

        spread = float((np.where(ok, area, -np.inf).max(axis=0) - area.min(axis=0)).max())
        step = np.where(ok & (psi > 0), psi, np.inf).min()
        if not np.isfinite(step):
            continue  # no sequence has a share this rounding counts
        lo, hi = 0.0, 2 * spread / float(step) + 1.0
        for _ in range(LAM_STEPS):
            lam = 0.5 * (lo + hi)
            value, slope = excess(lam)
            if value > budget * SLACK:
                return True
            if slope > 0:
                lo = lam
            else:
                hi = lam
    return False


def _least_other(x: np.ndarray) -> np.ndarray:
    """Per row, for each column the least value among the other columns (inf if none)."""
    n = x.shape[1]
    if n < 2:
        return np.full(x.shape, np.inf)
    order = np.argsort(x, axis=1)
    first = np.take_along_axis(x, order[:, :1], axis=1)
    second = np.take_along_axis(x, order[:, 1:2], axis=1)
    is_first = np.zeros(x.shape, dtype=bool)
    np.put_along_axis(is_first, order[:, :1], True, axis=1)
    return np.where(is_first, second, first)
