"""The zigzag padding rule: a sequence split over c > 1 ranks is padded to a multiple of 2c.

Each sequence is zigzag-split into 2c chunks over a group of c ranks (chunk i and 2c-1-i on rank
i, so that causal attention costs every rank the same), so its tokens are rounded up to a multiple
of 2c; a group of one rank runs it whole and pads nothing. The memory rule of the contract, the
cost model's footprints, the planner's packing, the profiler's packs and the ring-attention
layouts all use this module, so the rule is written once. ``padded_length`` is the scalar form,
``padded_lengths`` the vectorised one (int64, the same integers).
"""

from __future__ import annotations

import numpy as np

__all__ = ["padded_length", "padded_lengths", "padding_multiple"]


def padding_multiple(cp: int) -> int:
    """The multiple a sequence is padded to in a group of ``cp`` ranks: 2*cp, or 1 when cp == 1."""
    return 2 * cp if cp > 1 else 1


def padded_length(length: int, cp: int) -> int:
    """Tokens a sequence occupies in a group of ``cp`` ranks: a multiple of 2*cp when cp > 1."""
    unit = padding_multiple(cp)
    return -(-int(length) // unit) * unit


def padded_lengths(lengths: object, cp: int) -> np.ndarray:
    """``padded_length`` of each of ``lengths`` (an int64 array; ``lengths`` as int64 at cp 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp == 1:
        return lengths  # as given (no copy): nothing to pad
    unit = padding_multiple(cp)
    return -(-lengths // unit) * unit
