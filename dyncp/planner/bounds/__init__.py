"""Bounds: seconds no valid plan of a batch can beat, reported beside every plan.

Modules:

- ``closed_form``: the closed-form bound (microseconds);
- ``lp_bound``: the tight bound, an LP relaxation in a branch and bound (docs/lp-bound.md);
- ``holding``: the holding bounds of the longest sequences' groups, part of the tight bound;
- ``rounding``: the rounding bound, part of the tight bound under dataflow;
- ``deferred``: bounds computed on a worker thread after ``Planner.plan`` returns.
"""

from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.deferred import BOUND_KEYS, PENDING, DeferredBounds
from dyncp.planner.bounds.lp_bound import LpBound, lp_lower_bound
from dyncp.planner.bounds.rounding import rounding_bound

__all__ = [
    "BOUND_KEYS",
    "DeferredBounds",
    "LpBound",
    "PENDING",
    "lower_bound",
    "lp_lower_bound",
    "rounding_bound",
]
