"""Improvement: what may replace the constructed plan when it is valid and predicted faster.

Modules:

- ``cpsat``: CP-SAT re-assigns sequences to the plan's slots;
- ``laminar``: the layout search of small batches (CP-SAT over nested layouts);
- ``head_split``: each group's head split u x r = c, and the envelope the search prices.
"""

from dyncp.planner.improvement.cpsat import CpSatImprover, CpSatResult
from dyncp.planner.improvement.head_split import SplitEnvelope, choose_splits, layout_histogram
from dyncp.planner.improvement.laminar import LaminarImprover, LaminarResult

__all__ = [
    "CpSatImprover",
    "CpSatResult",
    "LaminarImprover",
    "LaminarResult",
    "SplitEnvelope",
    "choose_splits",
    "layout_histogram",
]
