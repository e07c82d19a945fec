"""dyncp: schedules variable-length LLM training batches over dynamic context parallelism."""

from dyncp import _compat
from dyncp.plan import Group, MicroBatch, PlanError, StepPlan, Topology, Wave

_compat.install()  # dyncp 0.1's import paths, for one release (dyncp/_compat.py)

__all__ = ["Group", "MicroBatch", "PlanError", "StepPlan", "Topology", "Wave"]
__version__ = "0.2.0"
