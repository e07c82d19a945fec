"""Plans tagged with the cost-model version they were priced with (online calibration).

The calibrator (``dyncp.cost_model.calibration.online``) produces model versions; a planner above
it wraps the planner in use so that each plan says which version priced it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncp.cost_model.calibration.online import ModelVersion
from dyncp.plan.contract import StepPlan

__all__ = ["VersionedPlanner"]


class VersionedPlanner:
    """A planner whose plans carry the model version they were priced with.

    Delegates everything to ``planner`` built on ``version``'s cost model; ``plan()`` adds
    ``plan.stats["model_version"]``. ``planner.model`` must be the version's model (use
    :meth:`rebuild` to move a planner to a new version).
    """

    def __init__(self, planner: Any, version: ModelVersion) -> None:
        self.inner = planner
        self.version = version

    @classmethod
    def rebuild(cls, planner: Any, version: ModelVersion) -> VersionedPlanner:
        """A planner with ``planner``'s options (its ``config``, validated again) on
        ``version``'s model. A new planner: its solver, status counters and timing history are
        its own."""
        base = planner.inner if isinstance(planner, VersionedPlanner) else planner
        inner = type(base)(version.model(base.model.ranks_per_node), base.config)
        return cls(inner, version)

    def plan(self, lengths: Sequence[int] | np.ndarray, **options: Any) -> StepPlan:
        """The inner planner's plan (``options``: its ``plan()`` keywords, e.g. ``budget``),
        tagged with the model version."""
        plan = self.inner.plan(lengths, **options)
        plan.stats["model_version"] = self.version.version
        return plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
