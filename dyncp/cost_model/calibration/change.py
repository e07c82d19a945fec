"""Change detection of online calibration: did the machine change, and at which step.

Residuals are ``log(predicted / measured)`` of the current model, one per buffered measurement,
with its kind (CP size, heads) and step. :func:`shifted_window` asks whether the newest steps
moved away from the older measurements of their own kind by more than noise explains (a run
that starts using a CP size the model prices badly is not a change of the machine);
:func:`change_point` places the step where a change began. ``OnlineCalibrator`` (``online``)
holds the buffer and acts on both.
"""

from __future__ import annotations

import math

import numpy as np

from dyncp.cost_model.calibration.level import biweight_location, biweight_shift

__all__ = [
    "CHANGE_MIN",
    "CHANGE_WINDOWS",
    "CHANGE_Z",
    "LEVEL_MIN_REFERENCE",
    "LEVEL_WINDOWS",
    "change_point",
    "shifted_window",
]

#: Change detection: the newest steps compared, the smallest shift (log) acted upon, and the
#: standard errors it must exceed.
CHANGE_WINDOWS, CHANGE_MIN, CHANGE_Z = (2, 4), math.log(1.05), 4.0
#: The windows with ``follow="level"``: an 8-step window sees a 1.4x change through sigma-0.3
#: noise with 20% stragglers where 2 and 4 steps may not (4 standard errors of a median of 32
#: measurements are about 0.36 in log there, above log 1.4 = 0.34).
LEVEL_WINDOWS = (2, 4, 8)
#: With ``follow="level"``, the fewest older measurements of a kind its new ones are compared
#: with; the error of their median is counted in the test (with 4 of a kind, at the start of a
#: run, a test that left it out saw changes that were not there).
LEVEL_MIN_REFERENCE = 16


def shifted_window(
    residuals: np.ndarray, keys: np.ndarray, steps: np.ndarray, *, now: int, level: bool
) -> int:
    """How many of the newest steps (up to ``now``) moved away from the older measurements, by
    more than noise explains (0: none did).

    Windows of ``CHANGE_WINDOWS`` steps (``LEVEL_WINDOWS`` with ``level``) are tried, shortest
    first (a short one reacts fast to a large change, a longer one sees a smaller change through
    heavy noise). Each recent residual is compared with the median residual of the older
    measurements of its own kind (``keys``). The shift is the median of those differences (with
    ``level``: a biweight location, the spread within each kind); it must exceed both
    ``CHANGE_MIN`` (5%: smaller drifts are left to the regular refits) and ``CHANGE_Z`` standard
    errors of a median (1.2533 x 1.4826 x MAD / sqrt(n)), so noise alone triggers it about once
    in 10,000 steps.
    """
    for window in LEVEL_WINDOWS if level else CHANGE_WINDOWS:
        new = steps > now - window
        old = ~new
        if new.sum() < 8 or old.sum() < 16:
            continue
        r_old, k_old = residuals[old], keys[old]
        diffs: list[float] = []
        centred: list[float] = []
        variance = 0.0  # of the per-kind medians the new residuals are centred on
        fewest = LEVEL_MIN_REFERENCE if level else 4
        for key in sorted(set(k_old.tolist())):
            ref = r_old[k_old == key]
            if len(ref) >= fewest:
                fresh = residuals[new & (keys == key)]
                diffs += (fresh - np.median(ref)).tolist()
                centred += (ref - np.median(ref)).tolist()
                variance += len(fresh) ** 2 * 1.5708 / len(ref)
        if len(diffs) < 8:
            continue
        if level:  # biweight locations, the spread within each kind
            variance /= len(diffs) ** 2
            signed, error = biweight_shift(
                np.array(diffs), np.array(centred), reference_variance=variance
            )
            shift = abs(signed)
        else:
            spread = 1.4826 * float(np.median(np.abs(r_old - np.median(r_old))))
            error = 1.2533 * spread * math.sqrt(1.0 / len(diffs) + 1.0 / len(r_old))
            shift = abs(float(np.median(diffs)))
        if shift > CHANGE_MIN and shift > CHANGE_Z * error:
            return window
    return 0


def change_point(
    first: int, now: int, residuals: np.ndarray, keys: np.ndarray, steps: np.ndarray
) -> int:
    """The step at which a change began, between ``first`` and ``now`` (the newest step).

    Each step from ``first`` on gets its difference from the reference (the measurements before
    ``first``, per kind; a biweight location, the stragglers' pull taken off), and the change
    point is the split of those steps that fits them best (least absolute deviations) as "no
    shift" before it and one shift (their median) from it on."""
    ref = steps < first
    reference = {}
    centred: list[float] = []
    for key in np.unique(keys[ref]).tolist():
        sel = residuals[ref & (keys == key)]
        if len(sel) >= 4:
            reference[key] = float(np.median(sel))
            centred += (sel - reference[key]).tolist()
    if not reference:
        return first + 2
    spread = 1.4826 * float(np.median(np.abs(centred)))
    base = biweight_location(np.array(centred), spread)
    shifts: list[float] = []
    for step in range(first, now + 1):
        sel = steps == step
        d = [r - reference[k] for r, k in zip(residuals[sel], keys[sel]) if k in reference]
        shifts.append(biweight_location(np.array(d), spread) - base if d else 0.0)
    costs = []
    for split in range(len(shifts)):
        after = np.array(shifts[split:])
        costs.append(float(np.abs(shifts[:split]).sum() + np.abs(after - np.median(after)).sum()))
    return first + int(np.argmin(costs))
