"""One batch's per-sequence facts, derived once for every stage of the planner.

The constructor, the bounds and the baselines all start from the same facts about a batch (which
CP sizes can hold each sequence); they are derived here, in one place.
"""

from __future__ import annotations

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology

__all__ = ["min_cp_sizes"]


def min_cp_sizes(lengths: np.ndarray, topology: Topology) -> np.ndarray:
    """Smallest allowed CP size holding each sequence alone; ValueError naming any that none can."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(len(lengths), dtype=np.int64)
    for cp in reversed(topology.group_sizes):
        padded = CostModel.padded(cp, lengths)
        out[padded <= cp * topology.capacity] = cp
    if (out == 0).any():
        bad = np.flatnonzero(out == 0)[:10].tolist()
        raise ValueError(
            f"sequences {bad} (lengths {lengths[bad].tolist()}) exceed the longest sequence any "
            f"allowed group holds ({topology.max_length()} tokens: group sizes "
            f"{list(topology.group_sizes)}, capacity {topology.capacity}); truncate or skip them"
        )
    return out
