"""The plan contract and what travels with it; torch-free.

Modules:
``contract`` (StepPlan, Wave, Group, MicroBatch, validate(), the plan digest),
``topology`` (Topology: the ranks, the allowed group sizes and head splits, what fits),
``padding`` (the zigzag padding rule: a multiple of 2c over c ranks),
``pipeline`` (pipeline stages and virtual stages; the 1F1B and interleaved operation orders),
``passes`` (a plan read as lockstep forward+backward passes; empty passes; pass-aligned),
``errors`` (PlanError, naming the broken rule),
``stats`` (PlanStats: what produced a plan, typed fields),
``codec`` (plan JSON: schema versions, the hardened decoding of untrusted documents),
``slice`` (per-rank slices under a Merkle root: what a rank reads at scale),
``menu`` (group-size menus shaped by the machine, and where each size may be placed).
"""

from dyncp.plan.codec import MAX_JSON_DEPTH, READABLE_VERSIONS, SCHEMA_VERSION
from dyncp.plan.contract import Group, MicroBatch, StepPlan, Wave, plan_digest
from dyncp.plan.errors import PlanError
from dyncp.plan.menu import (
    MENU_KINDS,
    NCCL_BUFFSIZE_BYTES,
    PoolCount,
    check_sizes,
    domain_size,
    is_placement,
    menu_sizes,
    placements,
    pool_blocks,
    pool_count,
    split_allowed,
)
from dyncp.plan.padding import padded_length, padded_lengths, padding_multiple
from dyncp.plan.passes import Pass, PassSchedule, pass_schedule
from dyncp.plan.pipeline import SCHEDULES, Pipeline, PipelineOp, stage_layers, stage_order
from dyncp.plan.slice import (
    HASH_BYTES,
    SLICES_FROM,
    PlanSlice,
    SliceHeader,
    SliceUnavailable,
    check_slice_header,
    is_header,
    open_slice,
    own_slice,
    record_index,
    slice_plan,
    slice_span,
    use_slices,
)
from dyncp.plan.stats import PlanStats
from dyncp.plan.topology import PLACEMENT, Topology

__all__ = [
    "HASH_BYTES",
    "MAX_JSON_DEPTH",
    "MENU_KINDS",
    "NCCL_BUFFSIZE_BYTES",
    "PLACEMENT",
    "READABLE_VERSIONS",
    "SCHEDULES",
    "SCHEMA_VERSION",
    "SLICES_FROM",
    "Group",
    "MicroBatch",
    "Pass",
    "PassSchedule",
    "Pipeline",
    "PipelineOp",
    "PlanError",
    "PlanSlice",
    "PlanStats",
    "PoolCount",
    "SliceHeader",
    "SliceUnavailable",
    "StepPlan",
    "Topology",
    "Wave",
    "check_sizes",
    "check_slice_header",
    "domain_size",
    "is_header",
    "is_placement",
    "menu_sizes",
    "open_slice",
    "own_slice",
    "padded_length",
    "padded_lengths",
    "padding_multiple",
    "pass_schedule",
    "placements",
    "plan_digest",
    "pool_blocks",
    "pool_count",
    "record_index",
    "slice_plan",
    "slice_span",
    "stage_layers",
    "stage_order",
    "use_slices",
    "split_allowed",
]
