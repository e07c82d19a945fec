"""The plan service: plan steps ahead on one rank (or ``python -m dyncp.service``) and publish them.

Modules: ``protocol`` (the Store keys, what each holds, the cursor; the batches both sides plan),
``publisher`` (PlanService: plans the steps ahead and publishes them),
``client`` (PlanClient: a reader's published plan, or the fallback past its deadline),
``fallback`` (the deterministic fallback planner, planning and checking one step's batch),
``cli`` (``python -m dyncp.service``: the service standalone, next to a training job).
"""

from dyncp.control.agreement import PlanMismatchError
from dyncp.control.signing import FALLBACK
from dyncp.plan import SliceUnavailable, check_slice_header, plan_digest
from dyncp.service.client import Fetched, PlanClient
from dyncp.service.fallback import check_plan, fallback_planner, plan_batch
from dyncp.service.protocol import BatchSource, slice_key, step_key
from dyncp.service.publisher import PlanService, ServiceCounters, lookahead_targets

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
