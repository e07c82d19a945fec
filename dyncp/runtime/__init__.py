"""Runtime: pre-built communicators and the execution of a StepPlan on every rank."""

from dyncp.runtime.executor import (
    MicroBatchContext,
    MicroBatchTiming,
    RankReport,
    StepFailed,
    execute,
    label_tokens,
)
from dyncp.runtime.group_pool import GroupPool, job_timeout
from dyncp.runtime.reduce import reduce_gradients, reduce_loss

__all__ = [
    "GroupPool",
    "MicroBatchContext",
    "MicroBatchTiming",
    "RankReport",
    "StepFailed",
    "execute",
    "job_timeout",
    "label_tokens",
    "reduce_gradients",
    "reduce_loss",
]
