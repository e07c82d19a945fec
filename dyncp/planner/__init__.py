"""Planners: the policies that turn a batch of lengths into a StepPlan, and the lower bound.

Modules and subpackages (the data flow of ``Planner.plan``):

- ``planner``: the facade, ``Planner`` (one ``plan(lengths)`` call, any policy, stats attached);
- ``config``: ``PlannerConfig``, a planner's options, frozen and validated;
- ``stages``: the planner's construction and improvement stages;
- ``batch``: the per-sequence facts of a batch (minimum CP sizes), derived once;
- ``costs``: per-sequence cost tables, one row per CP size;
- ``budget``: ``StepBudget``, planning time as a share of the predicted step;
- ``construction``: the greedy constructor and its parts (structure search, pouring, packing);
- ``improvement``: CP-SAT, the layout search of small batches, head splits;
- ``bounds``: the closed-form and tight lower bounds, deferred bounds;
- ``baselines``: static, batch-adaptive, dp-balanced and Megatron's schedulers, as candidates;
- ``versioned``: ``VersionedPlanner``, plans tagged with their cost-model version.
"""

from dyncp.planner.batch import min_cp_sizes
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.budget import StepBudget
from dyncp.planner.config import PlannerConfig
from dyncp.planner.planner import POLICIES, Improver, Planner
from dyncp.planner.versioned import VersionedPlanner

__all__ = [
    "POLICIES",
    "Improver",
    "Planner",
    "PlannerConfig",
    "StepBudget",
    "VersionedPlanner",
    "lower_bound",
    "min_cp_sizes",
]
