"""The bound fields of a plan's stats: which bounds are computed, when, and the gaps reported.

``Planner.plan`` reports the closed-form bound and, with ``bound="tight"``, the tight one beside
every plan, and the plan's gap to each. At 16,384 ranks the tight bound takes as long as building
the plan, so it may be computed after ``plan()`` returns (``deferred``); ``defers`` decides, from
the batch's size and the step's planning limit only, so the decision costs nothing.
"""

from __future__ import annotations

import time

import numpy as np

from dyncp.cost_model.model import CostModel
from dyncp.plan import Topology
from dyncp.planner.bounds.closed_form import lower_bound
from dyncp.planner.bounds.lp_bound import lp_lower_bound
from dyncp.planner.improvement.head_split import SplitEnvelope

__all__ = [
    "BOUND_SECONDS_PER_SEQUENCE",
    "DEFER_MIN_SECONDS",
    "DEFER_SHARE",
    "bound_fields",
    "defers",
]

#: ``defer_bound="auto"``'s prediction of the bounds' wall time per sequence of the batch.
#: Measured here (one core, quiet): 3.3-3.6 s for 131,072 sequences on 16,384 ranks (25-27 us),
#: 0.4 s for 32,768 on 4,096 (12 us), 12-15 ms for 512 on 64 (23-29 us); rounded up.
BOUND_SECONDS_PER_SEQUENCE = 30e-6
#: ``"auto"`` defers the bounds when predicted to take more than this share of ``time_limit``
#: (the constructor's reserve for validation and bounds is at most half of it)...
DEFER_SHARE = 0.25
#: ... and more than this many seconds (so batches of at most 3,333 sequences never defer).
DEFER_MIN_SECONDS = 0.1


def defers(
    *, bound: str, defer_bound: str, deterministic: bool, sequences: int, limit: float
) -> bool:
    """Whether a batch's bounds are computed after ``plan()`` returns: the tight bound only; in
    ``"auto"`` mode with a wall-clock deadline only, when predicted to take more than
    ``DEFER_SHARE`` of the step's ``limit`` and ``DEFER_MIN_SECONDS``."""
    if bound != "tight" or defer_bound == "never":
        return False
    if defer_bound == "always":
        return True
    predicted = BOUND_SECONDS_PER_SEQUENCE * sequences
    return not deterministic and predicted > max(DEFER_SHARE * limit, DEFER_MIN_SECONDS)


def bound_fields(
    lengths: np.ndarray,
    topology: Topology,
    seconds: float,
    search_model: CostModel | SplitEnvelope,
    *,
    timing: str,
    tight: bool,
    failed: BaseException | None = None,
    simple: float | None = None,
) -> dict:
    """The bound fields of ``stats`` for a plan of ``seconds``: the closed-form bound, the
    tight one when ``tight``, the gaps, ``bound`` (what was computed) and ``bound_seconds``
    (wall clock). ``failed``: the tight bound's error, reported with the closed form.
    ``simple``: the closed-form bound when ``plan()`` already computed it (for a budget)."""
    t0 = time.perf_counter()
    if simple is None:
        simple = lower_bound(lengths, topology, search_model)  # type: ignore[arg-type]
    bound, bound_info = simple, {"kind": "simple"}
    if failed is not None:
        bound_info["status"] = f"tight bound failed: {failed!r}"
    elif tight:
        lp = lp_lower_bound(lengths, topology, search_model, simple=simple, timing=timing)  # type: ignore[arg-type]
        bound = lp.seconds
        bound_info = {"kind": "tight", "status": lp.status, "variables": lp.variables}
    return {
        "lower_bound_seconds": bound,
        "simple_lower_bound_seconds": simple,
        "gap_to_lower_bound": seconds / bound - 1.0 if bound > 0 else 0.0,
        "gap_to_simple_bound": seconds / simple - 1.0 if simple > 0 else 0.0,
        "bound": bound_info,
        "bound_seconds": time.perf_counter() - t0,
    }
