"""The DistCA measurements the H100 reference profiles are built from: read and fitted.

Measured inputs (DistCA, Apache-2.0, measured on H100 by its authors):

- ``compute-attn-H100.csv``, rows cp=1: causal flash-attention varlen *forward* of one document,
  head dim 128, with 64/tp query heads for tp = 1, 2, 4, 8 (64, 32, 16, 8 heads). The builder
  takes the head count closest to the model's and scales the length-dependent part of the time by
  ``(heads x head_dim) / (measured heads x 128)`` (attention FLOPs are proportional to it); the
  fitted fixed cost per call is not scaled;
- ``nccl_perf.csv``, all_gather on 2/4/8 GPUs in one node: fitted to ``(n-1) * (latency +
  chunk / bandwidth)``, the cost of n-1 ring steps, to get one NVLink ring step's latency and
  bandwidth; and, per GPU count n, to ``latency + size / bandwidth`` for the all-to-all of the
  head exchange (``communication.all_to_all_links``, see ``fit_all_to_all``: no all-to-all was
  measured, the all-gather moving the same bytes per GPU stands in for it).

Every fit is the relative-error fit of ``dyncp.cost_model.fitting``; ``dyncp.cost_model.reference``
and ``dyncp.cost_model.mix_reference`` build profiles from them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dyncp.cost_model.fitting import fit_relative, relative_errors

__all__ = [
    "MEASURED_DTYPE_BYTES",
    "MEASURED_HEADS",
    "MEASURED_HEAD_DIM",
    "REFERENCE_SOURCE",
    "AttentionFit",
    "fit_all_to_all",
    "fit_attention",
    "fit_nvlink",
    "measured_heads",
]

REFERENCE_SOURCE = "hao-ai-lab/DistCA distca/profiling/data (commit 2afd2192), Apache-2.0"

# What the attention table covers: 64/tp query heads at tp = 1, 2, 4, 8, head dim 128, bf16.
MEASURED_HEADS = {64: "1", 32: "2", 16: "4", 8: "8"}
MEASURED_HEAD_DIM = 128
MEASURED_DTYPE_BYTES = 2


@dataclass(frozen=True, slots=True)
class AttentionFit:
    """The measured forward table of one head count and its fit ``a s^2 + b s + k0``."""

    heads: int
    kv_heads: int
    lengths: list[int]
    forward_seconds: list[float]
    coef: np.ndarray
    max_relative_error: float


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def measured_heads(num_heads: int) -> int:
    """The measured head count closest to ``num_heads`` (in ratio; ties go to the larger)."""
    return min(MEASURED_HEADS, key=lambda h: (abs(np.log(h / num_heads)), -h))


def fit_attention(src: Path, heads: int) -> AttentionFit:
    """Forward table of a measured head count and its fit (a, b, k0): fwd = a s^2 + b s + k0."""
    if heads not in MEASURED_HEADS:
        raise ValueError(f"heads {heads} not measured; measured: {sorted(MEASURED_HEADS)}")
    tp = MEASURED_HEADS[heads]
    rows = [r for r in _rows(src / "compute-attn-H100.csv") if r["cp"] == "1" and r["tp"] == tp]
    lengths = np.array([int(r["L"]) for r in rows])
    fwd = np.array([float(r["duration_per_doc"]) for r in rows]) * 1e-3
    order = np.argsort(lengths)
    lengths, fwd = lengths[order], fwd[order]
    # fwd(s) = a s^2 + b s + k0, non-negative, least squares on relative error.
    basis = np.stack([lengths.astype(float) ** 2, lengths.astype(float), np.ones(len(lengths))], 1)
    coef, _ = fit_relative(basis, fwd)
    coef[2] = min(coef[2], 0.9 * fwd.min())
    rel = relative_errors(basis, coef, fwd)
    return AttentionFit(
        heads=heads,
        kv_heads=max(4 // int(tp), 1),
        lengths=lengths.tolist(),
        forward_seconds=fwd.tolist(),
        coef=coef,
        max_relative_error=float(rel.max()),
    )


def fit_nvlink(src: Path) -> tuple[float, float, float]:
    """(latency s, bandwidth B/s, max relative error) of one ring step inside a node."""
    rows = [r for r in _rows(src / "nccl_perf.csv") if r["op"] == "all_gather"]
    n = np.array([int(r["ngpu"]) for r in rows], dtype=float)
    size = np.array([float(r["size_bytes"]) for r in rows])
    t = np.array([float(r["t_us_out"]) for r in rows]) * 1e-6
    basis = np.stack([n - 1, (n - 1) * size / n], 1)
    coef, rel = fit_relative(basis, t)
    return float(coef[0]), float(1.0 / coef[1]), float(rel.max())


def fit_all_to_all(src: Path) -> dict[int, tuple[float, float, float]]:
    """Per GPU count n in ``nccl_perf.csv``: (latency s, bandwidth B/s, max relative error) of an
    all-to-all over n GPUs of one node in which each GPU holds B bytes: ``latency + B /
    bandwidth``.

    No all-to-all was measured. The all_gather rows of output size B stand in for it: both move
    (n-1)/n x B bytes out of and into every GPU (the all-gather sends its B/n chunk to n-1 peers;
    the all-to-all keeps 1/n of its B and sends the rest), and NVSwitch connects every GPU to
    every other at its full NVLink bandwidth at once (full bisection), so the bytes per GPU, not
    the pattern, set the time. Fitted on relative error to the out-of-place times (an
    all-to-all is out of place), one fit per n.
    """
    rows = [r for r in _rows(src / "nccl_perf.csv") if r["op"] == "all_gather"]
    out = {}
    for n in sorted({int(r["ngpu"]) for r in rows}):
        mine = [r for r in rows if int(r["ngpu"]) == n]
        size = np.array([float(r["size_bytes"]) for r in mine])
        t = np.array([float(r["t_us_out"]) for r in mine]) * 1e-6
        basis = np.stack([np.ones(len(t)), size], 1)
        coef, rel = fit_relative(basis, t)
        out[n] = (float(coef[0]), float(1.0 / coef[1]), float(rel.max()))
    return out
