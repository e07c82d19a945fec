"""Baselines: the simple policies dyncp is compared with, and kept as its candidates.

Modules:

- ``static``: static CP and batch-adaptive CP;
- ``dp_balanced``: Megatron Core's ``dp_balanced`` packing at one CP size;
- ``megatron``: Megatron-LM's dev-branch packing-aware dynamic-CP greedy (not in a release);
- ``megatron_core``: megatron-core's released schedule format read as a plan and written from one;
- ``megatron_min_cp``: Megatron Core's first dynamic-CP scheduler (every sequence at its minimum);
- ``candidates``: the baselines built as candidates of the dyncp policies;
- ``pipeline``: Megatron dev's dynamic CP with PP and static CP with PP (pipelined plans).
"""

from dyncp.planner.baselines.candidates import BASELINES, SECONDS_PER_SEQUENCE, BaselineCandidates
from dyncp.planner.baselines.dp_balanced import dp_balanced_packs, dp_balanced_plan
from dyncp.planner.baselines.megatron import megatron_plan
from dyncp.planner.baselines.megatron_min_cp import megatron_min_cp_plan
from dyncp.planner.baselines.pipeline import (
    PIPELINE_BASELINES,
    align_groups,
    megatron_pp_plan,
    static_pp_plan,
)
from dyncp.planner.baselines.static import batch_adaptive_plan, fixed_cp_plan, static_cp_size

__all__ = [
    "BASELINES",
    "PIPELINE_BASELINES",
    "SECONDS_PER_SEQUENCE",
    "BaselineCandidates",
    "align_groups",
    "batch_adaptive_plan",
    "dp_balanced_packs",
    "dp_balanced_plan",
    "fixed_cp_plan",
    "megatron_min_cp_plan",
    "megatron_plan",
    "megatron_pp_plan",
    "static_cp_size",
    "static_pp_plan",
]
