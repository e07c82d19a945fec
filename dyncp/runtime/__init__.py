"""Runtime: pre-built communicators and the execution of a StepPlan on every rank.

Modules: ``executor`` (runs a StepPlan's waves), ``group_pool`` (the pre-built communicators),
``reduce`` (gradient and loss reduction), ``measure`` (timings for calibration), ``labels``
(next-token labels of a packed batch), ``pipeline`` (runs a pipelined plan's stages), with
``pipeline_groups`` (its communicators), ``pipeline_layout`` (its process grid and routing),
``pipeline_reduce`` (its gradient and loss reduction) and ``pipeline_measure`` (its timings for
calibration).
"""

from dyncp.control.job import job_timeout
from dyncp.runtime.executor import (
    MicroBatchContext,
    MicroBatchTiming,
    RankReport,
    StepFailed,
    execute,
    filler_context,
    label_tokens,
    loss_scale,
    microbatch_context,
)
from dyncp.runtime.group_pool import GroupPool
from dyncp.runtime.labels import IGNORE, next_token_labels
from dyncp.runtime.pipeline import Activation, OpTiming, PipelineReport, execute_pipeline
from dyncp.runtime.pipeline_groups import PipelineGroups
from dyncp.runtime.pipeline_layout import PipelineLayout
from dyncp.runtime.pipeline_reduce import reduce_pipeline_loss, reduce_stage_gradients
from dyncp.runtime.reduce import reduce_gradients, reduce_loss

__all__ = [
    "IGNORE",
    "Activation",
    "GroupPool",
    "MicroBatchContext",
    "MicroBatchTiming",
    "OpTiming",
    "PipelineGroups",
    "PipelineLayout",
    "PipelineReport",
    "RankReport",
    "StepFailed",
    "execute",
    "execute_pipeline",
    "filler_context",
    "job_timeout",
    "label_tokens",
    "loss_scale",
    "microbatch_context",
    "next_token_labels",
    "reduce_gradients",
    "reduce_loss",
    "reduce_pipeline_loss",
    "reduce_stage_gradients",
]
