"""Planners: the policies that turn a batch of lengths into a StepPlan, and the lower bound."""

from dyncp.planner.bound import lower_bound, min_cp_sizes
from dyncp.planner.budget import StepBudget
from dyncp.planner.planner import POLICIES, Improver, Planner
from dyncp.planner.versioned import VersionedPlanner

__all__ = [
    "POLICIES",
    "Improver",
    "Planner",
    "StepBudget",
    "VersionedPlanner",
    "lower_bound",
    "min_cp_sizes",
]
