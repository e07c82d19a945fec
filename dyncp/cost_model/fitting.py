"""Non-negative least squares on relative error: the one fit every profile builder makes.

Profiles are built from timings that span orders of magnitude (a 32-token attention call and a
32k-token one; a 1 kB transfer and a 100 MB one). A plain least-squares fit would be decided by
the longest timings alone, so every builder (``dyncp.cost_model.reference`` on the DistCA data,
the profiler ``dyncp.profiling``) fits ``basis @ coef ~ target`` with each row divided by its
``scale`` (by default the target itself: the relative error), and coefficients >= 0 (a time
never has a negative term). The named fits below are the forms the builders use.

Torch-free (numpy and scipy).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

__all__ = ["fit_linear", "fit_link", "fit_quadratic", "fit_relative", "relative_errors"]


def fit_relative(
    basis: np.ndarray, target: np.ndarray, *, scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients >= 0 minimising ``sum(((basis @ coef - target) / scale) ** 2)``.

    Args:
        basis: one row per measurement, one column per coefficient.
        target: what the rows should add up to.
        scale: what each row's error is relative to (default: ``target``).

    Returns:
        ``(coef, errors)``: the coefficients and each row's ``|basis @ coef - target| / scale``.
    """
    if scale is None:
        coef, _ = nnls(basis / target[:, None], np.ones(len(target)))
    else:
        coef, _ = nnls(basis / scale[:, None], target / scale)
    return coef, relative_errors(basis, coef, target, scale=scale)


def relative_errors(
    basis: np.ndarray, coef: np.ndarray, target: np.ndarray, *, scale: np.ndarray | None = None
) -> np.ndarray:
    """Each row's ``|basis @ coef - target| / scale`` (``scale`` default: ``target``)."""
    return np.abs(basis @ coef - target) / (target if scale is None else scale)


def fit_quadratic(lengths: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float, float]:
    """``seconds = a s^2 + b s + k`` (attention of causal sequences of ``lengths`` tokens);
    ``(a, b, k, max relative error)``."""
    s = lengths.astype(float)
    basis = np.stack([s * s, s, np.ones_like(s)], 1)
    coef, errors = fit_relative(basis, seconds)
    return float(coef[0]), float(coef[1]), float(coef[2]), float(np.max(errors))


def fit_linear(x: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """``seconds = slope * x + constant``; ``(slope, constant, max relative error)``."""
    basis = np.stack([x.astype(float), np.ones(len(x))], 1)
    coef, errors = fit_relative(basis, seconds)
    return float(coef[0]), float(coef[1]), float(np.max(errors))


def fit_link(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """``seconds = latency + bytes / bandwidth``; ``(latency, bandwidth, max relative error)``."""
    per_byte, latency, err = fit_linear(nbytes, seconds)
    return latency, 1.0 / max(per_byte, 1e-18), err
