"""The plan contract and what travels with it; torch-free.

Modules: ``contract`` (StepPlan, Wave, Group, MicroBatch, validate(), the plan digest),
``topology`` (Topology: the ranks, the allowed group sizes and head splits, what fits),
``padding`` (the zigzag padding rule: a multiple of 2c over c ranks),
``errors`` (PlanError, naming the broken rule),
``codec`` (plan JSON: schema versions and the hardened decoding of untrusted documents),
``slice`` (per-rank slices under a Merkle root: what a rank reads at scale), ``menu`` (group-size
menus shaped by the machine, and where each size may be placed).
"""

from dyncp.plan.codec import SCHEMA_VERSION
from dyncp.plan.contract import Group, MicroBatch, StepPlan, Wave, plan_digest
from dyncp.plan.errors import PlanError
from dyncp.plan.padding import padded_length, padded_lengths, padding_multiple
from dyncp.plan.topology import Topology

__all__ = [
    "SCHEMA_VERSION",
    "Group",
    "MicroBatch",
    "PlanError",
    "StepPlan",
    "Topology",
    "Wave",
    "padded_length",
    "padded_lengths",
    "padding_multiple",
    "plan_digest",
]
