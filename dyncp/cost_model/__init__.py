"""Cost model: profiles (pydantic schema), micro-batch time prediction, plan evaluation."""

from dyncp.cost_model.evaluate import TIMINGS, PlanCost, evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, ProfileError, bundled_profiles, load_profile

__all__ = [
    "TIMINGS",
    "CostModel",
    "PlanCost",
    "Profile",
    "ProfileError",
    "bundled_profiles",
    "evaluate_plan",
    "load_profile",
]
