"""The plan service: plan steps ahead on one rank (or ``python -m dyncp.service``) and publish them.

Modules: ``publisher`` (PlanService, PlanClient, the Store protocol, the fallback planner),
``cli`` (``python -m dyncp.service``: the service standalone, next to a training job).
"""

from dyncp.service.publisher import (
    FALLBACK,
    BatchSource,
    Fetched,
    PlanClient,
    PlanMismatchError,
    PlanService,
    ServiceCounters,
    SliceUnavailable,
    check_plan,
    check_slice_header,
    fallback_planner,
    lookahead_targets,
    plan_batch,
    plan_digest,
    slice_key,
    step_key,
)

__all__ = [
    "FALLBACK",
    "BatchSource",
    "Fetched",
    "PlanClient",
    "PlanMismatchError",
    "PlanService",
    "ServiceCounters",
    "SliceUnavailable",
    "check_plan",
    "check_slice_header",
    "fallback_planner",
    "lookahead_targets",
    "plan_batch",
    "plan_digest",
    "slice_key",
    "step_key",
]
