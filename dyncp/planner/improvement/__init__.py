"""Improvement: what may replace the constructed plan when it is valid and predicted faster.

Modules:

- ``cpsat``: CP-SAT re-assigns sequences to the plan's slots;
- ``laminar``: the layout search of small batches (CP-SAT over nested layouts);
- ``head_split``: each group's head split u x r = c, and the envelope the search prices;
- ``pass_align``: pass-aligned plans for full sharding (``Planner(passes="aligned")``);
- ``pass_moves``: the moves that align one wave's passes (grow, rebalance, split, merge).
"""

from dyncp.planner.improvement.cpsat import CpSatImprover, CpSatResult
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits, layout_histogram
from dyncp.planner.improvement.laminar import LaminarImprover, LaminarResult
from dyncp.planner.improvement.pass_align import (
    PASSES,
    AlignBudget,
    AlignmentReport,
    align_best,
    align_passes,
    aligned_waves,
)
from dyncp.planner.improvement.pass_moves import DraftGroup, WaveDraft

__all__ = [
    "PASSES",
    "AlignmentReport",
    "CpSatImprover",
    "DraftGroup",
    "CpSatResult",
    "LaminarImprover",
    "LaminarResult",
    "SplitEnvelope",
    "WaveDraft",
    "AlignBudget",
    "align_best",
    "align_passes",
    "aligned_waves",
    "choose_splits",
    "layout_histogram",
]
