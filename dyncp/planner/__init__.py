"""Planners: the policies that turn a batch of lengths into a StepPlan, and the lower bound.

Modules and subpackages (the data flow of ``Planner.plan``):

- ``planner``: the facade, ``Planner`` (one ``plan(lengths)`` call, any policy, stats attached);
- ``config``: ``PlannerConfig``, a planner's options, frozen and validated;
- ``stages``: the planner's construction and improvement stages;
- ``batch``: ``Batch``, a batch's per-sequence facts (padded tokens, minimum CP sizes, seconds
  alone), derived once per ``plan()`` and shared by every stage;
- ``costs``: per-sequence cost tables, one row per CP size;
- ``budget``: ``StepBudget``, planning time as a share of the predicted step;
- ``construction``: the greedy constructor and its parts (structure search, pouring, packing);
- ``improvement``: CP-SAT, the layout search of small batches, head splits;
- ``bounds``: the closed-form and tight lower bounds, deferred bounds;
- ``baselines``: static, batch-adaptive, dp-balanced and Megatron's schedulers, as candidates;
- ``versioned``: ``VersionedPlanner``, plans tagged with their cost-model version.
"""

from dyncp.planner.batch import Batch, min_cp_sizes
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.budget import StepBudget
from dyncp.planner.config import PlannerConfig
from dyncp.planner.planner import POLICIES, Improver, Planner
from dyncp.planner.versioned import VersionedPlanner

__all__ = [
    "Batch",
    "POLICIES",
    "Improver",
    "Planner",
    "PlannerConfig",
    "StepBudget",
    "VersionedPlanner",
    "lower_bound",
    "min_cp_sizes",
]
