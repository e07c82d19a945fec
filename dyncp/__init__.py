"""dyncp: schedules variable-length LLM training batches over dynamic context parallelism."""

from dyncp.plan import Group, MicroBatch, PlanError, StepPlan, Topology, Wave

__all__ = ["Group", "MicroBatch", "PlanError", "StepPlan", "Topology", "Wave"]
__version__ = "0.1.0"
