"""Planning pipelined steps: slots from any plan, their count, their order, the choice.

Modules:

- ``slots``: an ordinary plan read as slots; the slot count aligned by halving slots;
- ``order``: verl's ends-small order and the local search over slot orders;
- ``search``: the pipelined candidates priced and the fastest chosen and ordered;
- ``stage``: the planner's pipeline stage (candidates, constructions, budget, stats).
"""

from dyncp.planner.pipeline.order import (
    OrderPrice,
    OrderPricer,
    OrderResult,
    OrderSearch,
    Price,
    by_plan,
    ends_small_order,
)
from dyncp.planner.pipeline.search import PipelineCandidate, PipelineChoice, PipelineSearch
from dyncp.planner.pipeline.slots import (
    repack,
    slot_seconds,
    split_steps,
    split_to,
    target_slots,
    to_slots,
    with_order,
)

__all__ = [
    "OrderPrice",
    "OrderPricer",
    "OrderResult",
    "OrderSearch",
    "PipelineCandidate",
    "PipelineChoice",
    "PipelineSearch",
    "Price",
    "by_plan",
    "ends_small_order",
    "repack",
    "slot_seconds",
    "split_steps",
    "split_to",
    "target_slots",
    "to_slots",
    "with_order",
]
