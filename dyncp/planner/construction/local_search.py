"""Local search on a plan's slots: move or swap sequences out of each wave's critical slot.

The constructor decides the structure; its realisation still leaves slack where coarse sequences
did not divide evenly (a wave is as long as its slowest group, so one overfull slot costs the
whole wave). With the layout fixed (``Assignment``: the plan's groups plus an empty single-rank
slot per idle rank), a step's additive cost is the sum over waves of the largest slot load. A
move takes one sequence out of the critical (largest) slot of a wave into any slot that can hold
it (size >= its minimum CP size, so its CP size and its wave may change); a swap exchanges it with
a sequence elsewhere. Either is applied only when it lowers that sum; the first improving move of
the critical slot's costliest sequences is taken, else the best swap. Deterministic (ties: lowest
index) and anytime: it stops at ``deadline`` or when no wave's critical slot can be improved.

The caller prices the result with the exact cost model and keeps it only when it is faster.
"""

from __future__ import annotations

import time

import numpy as np

from dyncp.planner.construction.assignment import Assignment

__all__ = ["improve"]

# Improvements smaller than this (seconds) are not worth a move: the additive model's error.
EPS = 1e-7
# Sequences of a critical slot tried, costliest first.
MAX_TRIED = 24


def improve(
    a: Assignment, deadline: float | None = None, max_rounds: int = 400
) -> tuple[Assignment, int]:
    """A copy of ``a`` with a lower additive step time, and how many moves and swaps it applied."""
    t = a.costs.seconds  # [row, seq]
    n = t.shape[1]
    items = [list(ids) for ids in a.items]
    where = np.zeros(n, dtype=np.int64)
    for j, ids in enumerate(items):
        where[ids] = j
    loads = a.loads()
    waves = a.wave
    rows = a.row
    n_waves = a.n_waves
    applied = 0
    stuck = np.zeros(n_waves, dtype=bool)
    for _ in range(max_rounds):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        levels = np.full(n_waves, 0.0)
        np.maximum.at(levels, waves, loads)
        open_waves = np.flatnonzero(~stuck)
        if len(open_waves) == 0:
            break
        w = int(open_waves[np.argmax(levels[open_waves])])  # the longest wave first
        in_w = np.flatnonzero(waves == w)
        crit = int(in_w[np.argmax(loads[in_w])])
        others = loads[in_w[in_w != crit]]
        second = float(others.max()) if len(others) else 0.0
        if second >= loads[crit] - EPS or not items[crit]:
            stuck[w] = True  # a tie: no single move lowers this wave
            continue
        if _move(crit, w, second, items, where, loads, levels, waves, t, rows):
            applied += 1
            stuck[:] = False
            continue
        if _swap(crit, w, second, items, where, loads, levels, waves, t, rows):
            applied += 1
            stuck[:] = False
            continue
        stuck[w] = True
    return Assignment(a.wave, a.start, a.size, a.row, items, a.costs), applied


def _order(crit: int, items: list[list[int]], t: np.ndarray, rows: np.ndarray) -> list[int]:
    return sorted(items[crit], key=lambda i: (-t[rows[crit], i], i))[:MAX_TRIED]


def _move(crit, w, second, items, where, loads, levels, waves, t, rows) -> bool:
    top = loads[crit]
    for i in _order(crit, items, t, rows):
        left = top - t[rows[crit], i]
        drop = top - max(second, left)  # how much wave w shortens without i
        new = loads + t[rows, i]  # every slot's load with i added
        gain = drop - np.maximum(new - levels[waves], 0.0)
        same = waves == w
        # In wave w the new level is max(second, left, new load of the target).
        gain[same] = top - np.maximum(max(second, left), new[same])
        gain[crit] = -np.inf
        j = int(np.argmax(gain))
        if gain[j] > EPS and np.isfinite(new[j]):
            _apply_move(i, crit, j, items, where, loads, t, rows)
            return True
    return False


def _swap(crit, w, second, items, where, loads, levels, waves, t, rows) -> bool:
    top = loads[crit]
    n = t.shape[1]
    seqs = np.arange(n)
    home = where  # slot of every sequence
    home_rows = rows[home]
    best = (EPS, -1, -1)
    for i in _order(crit, items, t, rows):
        # crit loses i, gains i2; home(i2) loses i2, gains i.
        new_crit = top - t[rows[crit], i] + t[rows[crit], seqs]
        new_home = loads[home] - t[home_rows, seqs] + t[home_rows, i]
        other_wave = waves[home] != w
        level_w = np.maximum(second, new_crit)
        level_w = np.where(other_wave, level_w, np.maximum(level_w, new_home))
        rise = np.where(other_wave, np.maximum(new_home - levels[waves[home]], 0.0), 0.0)
        gain = top - level_w - rise
        gain[home == crit] = -np.inf
        gain[~np.isfinite(gain)] = -np.inf
        k = int(np.argmax(gain))
        if gain[k] > best[0]:
            best = (float(gain[k]), i, k)
    if best[1] < 0:
        return False
    _, i, k = best
    j = int(home[k])
    _apply_move(i, crit, j, items, where, loads, t, rows)
    _apply_move(k, j, crit, items, where, loads, t, rows)
    return True


def _apply_move(i, src, dst, items, where, loads, t, rows) -> None:
    items[src].remove(i)
    items[dst].append(i)
    where[i] = dst
    loads[src] -= t[rows[src], i]
    loads[dst] += t[rows[dst], i]
