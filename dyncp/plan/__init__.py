"""The plan contract and what travels with it; torch-free.

Modules: ``contract`` (StepPlan, Wave, Group, MicroBatch, Topology, validate(), the plan digest),
``stats`` (PlanStats: what produced a plan, typed), ``slice`` (per-rank slices under a Merkle
root: what a rank reads at scale), ``menu`` (group-size menus shaped by the machine, and where
each size may be placed).
"""

from dyncp.plan.contract import (
    SCHEMA_VERSION,
    Group,
    MicroBatch,
    PlanError,
    StepPlan,
    Topology,
    Wave,
    padded_length,
    plan_digest,
)
from dyncp.plan.stats import PlanStats

__all__ = [
    "SCHEMA_VERSION",
    "Group",
    "MicroBatch",
    "PlanError",
    "PlanStats",
    "StepPlan",
    "Topology",
    "Wave",
    "padded_length",
    "plan_digest",
]
