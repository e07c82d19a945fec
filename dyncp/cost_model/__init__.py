"""Cost model: profiles (pydantic schema), micro-batch time prediction, plan evaluation; torch-free.

Modules, one line each:

- ``schema``: the profile (pydantic), loading bundled and user profiles;
- ``model``: CostModel, the entry point (picks the pricing of a profile);
- ``full_attention``: the pricing of full-attention layers, ring and all-to-all groups;
- ``head_split``: the pricing of hybrid groups (heads by all-to-all, rings over the rest);
- ``layer_mix``: LayerMixCostModel, window and SSM layers on top of full attention;
- ``kernels``: attention kernels' tile sizes, read from their source;
- ``protocol``: what planners, the bound and the simulator need of a cost model;
- ``evaluate``: a plan's predicted time (PlanCost, evaluate_plan);
- ``sharding``: ShardingCost, what FSDP2 full sharding's collectives add to a pass;
- ``pass_timing``: a plan priced as lockstep passes (PassCost, price_passes);
- ``pipeline_timing``: a pipelined plan's operations priced (StageCosts, stage_costs), and
  ``pipeline_schedule`` its timeline along the schedule (PipelineCost, price_pipeline);
- ``fitting``: the non-negative least-squares fit on relative error every builder uses;
- ``shapes``, ``mix_shapes``: decoder shapes and layer mixes of named models;
- ``reference``, ``mix_reference``, ``published``: the builders of the bundled H100 profiles;
- ``calibration``: refitting a profile to measurements, offline and online (subpackage).
"""

from dyncp.cost_model.evaluate import TIMINGS, PlanCost, evaluate_plan
from dyncp.cost_model.layer_mix import LayerMixCostModel
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.pass_timing import PassCost, price_passes
from dyncp.cost_model.pipeline_timing import (
    PipelineCost,
    StageCosts,
    price_pipeline,
    stage_costs,
)
from dyncp.cost_model.schema import Profile, ProfileError, bundled_profiles, load_profile
from dyncp.cost_model.sharding import (
    Collective,
    ShardingCost,
    collective_from_profile,
    dtype_bytes,
)

__all__ = [
    "TIMINGS",
    "Collective",
    "CostModel",
    "LayerMixCostModel",
    "PassCost",
    "PipelineCost",
    "PlanCost",
    "Profile",
    "ProfileError",
    "ShardingCost",
    "StageCosts",
    "bundled_profiles",
    "collective_from_profile",
    "dtype_bytes",
    "evaluate_plan",
    "load_profile",
    "price_passes",
    "price_pipeline",
    "stage_costs",
]
