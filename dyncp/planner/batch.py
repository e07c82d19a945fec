"""One batch's per-sequence facts on one topology, derived once for every stage of the planner.

The constructor, the bounds and the baselines all start from the same facts about a batch: its
lengths as int64, each sequence's padded tokens at every allowed CP size, the smallest CP size
that holds it, and its seconds alone at each size under a model. ``Planner.plan`` builds one
``Batch`` and hands it down; each fact is derived on first use and kept (a batch no stage needs
a fact of never pays for it, and an error, such as a sequence no group holds, surfaces where it
did before). A stage on another topology (the menu's powers of two, Megatron's) derives its own
facts with ``Batch.of(batch, topology)``, which reuses the batch when the topology is its own.
The public functions taking lengths take a ``Batch`` as well (``Batch.of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Protocol

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology

__all__ = ["Batch", "lengths_of", "min_cp_sizes"]


class _AloneModel(Protocol):
    """What ``Batch.alone`` prices with: a cost model, or the head splits' envelope."""

    def alone_seconds(self, cp: int, lengths: np.ndarray) -> np.ndarray: ...


class Batch:
    """The per-sequence facts of ``lengths`` on ``topology`` (module docstring).

    Attributes:
        lengths: the sequence lengths, int64.
        topology: the topology the facts hold for.
        sizes: the allowed CP sizes, ascending (``topology.group_sizes``), int64.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, topology: Topology) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.topology = topology
        self.sizes = np.asarray(topology.group_sizes, dtype=np.int64)
        # Seconds alone per model (identity: a model is kept alive by its entry).
        self._alone: list[tuple[object, np.ndarray]] = []

    @classmethod
    def of(cls, lengths: Batch | Sequence[int] | np.ndarray, topology: Topology) -> Batch:
        """``lengths`` itself when it is a batch on ``topology``, else the facts of its lengths
        on ``topology``."""
        if isinstance(lengths, Batch):
            if lengths.topology == topology:
                return lengths
            lengths = lengths.lengths
        return cls(lengths, topology)

    def __len__(self) -> int:
        return len(self.lengths)

    @cached_property
    def padded(self) -> np.ndarray:
        """``padded[k, i]``: sequence i's memory footprint at ``sizes[k]`` (the plan contract's
        padding, ``CostModel.padded``), int64; read-only."""
        out = np.zeros((len(self.sizes), len(self.lengths)), dtype=np.int64)
        for k, cp in enumerate(self.topology.group_sizes):
            out[k] = CostModel.padded(cp, self.lengths)
        out.flags.writeable = False
        return out

    @cached_property
    def min_cp(self) -> np.ndarray:
        """Smallest allowed CP size holding each sequence alone, int64; read-only.

        Raises:
            ValueError: naming the sequences no allowed group holds.
        """
        topology, lengths = self.topology, self.lengths
        out = np.zeros(len(lengths), dtype=np.int64)
        for k in reversed(range(len(self.sizes))):
            cp = topology.group_sizes[k]
            out[self.padded[k] <= cp * topology.capacity] = cp
        if (out == 0).any():
            bad = np.flatnonzero(out == 0)[:10].tolist()
            raise ValueError(
                f"sequences {bad} (lengths {lengths[bad].tolist()}) exceed the longest sequence "
                f"any allowed group holds ({topology.max_length()} tokens: group sizes "
                f"{list(topology.group_sizes)}, capacity {topology.capacity}); truncate or skip "
                "them"
            )
        out.flags.writeable = False
        return out

    def alone(self, model: _AloneModel) -> np.ndarray:
        """``alone[k, i]``: seconds of sequence i as its own micro-batch at ``sizes[k]`` under
        ``model`` (``alone_seconds``), inf where that size cannot hold it; read-only, derived
        once per model."""
        for known, table in self._alone:
            if known is model:
                return table
        out = np.full((len(self.sizes), len(self.lengths)), np.inf)
        if len(self.lengths):
            for k, cp in enumerate(self.topology.group_sizes):
                ok = self.min_cp <= cp
                if ok.any():
                    out[k, ok] = model.alone_seconds(cp, self.lengths[ok])
        out.flags.writeable = False
        self._alone.append((model, out))
        return out


def min_cp_sizes(lengths: Batch | Sequence[int] | np.ndarray, topology: Topology) -> np.ndarray:
    """Smallest allowed CP size holding each sequence alone; ValueError naming any that none can.

    (``Batch.min_cp``, for callers holding lengths; a fresh, writable array.)
    """
    return Batch.of(lengths, topology).min_cp.copy()


def lengths_of(lengths: Batch | Sequence[int] | np.ndarray) -> np.ndarray:
    """The int64 lengths of a ``Batch`` or of plain lengths (for stages that need no other fact)."""
    if isinstance(lengths, Batch):
        return lengths.lengths
    return np.asarray(lengths, dtype=np.int64)
