"""After ``execute_pipeline``: sum each stage's gradients over its axis, and the step's loss.

Each stage holds its own parameters, so its gradients are summed over its own DP x CP axis (its
GroupPool's axis group), never across stages; with ``ctx.loss_scale`` applied by the last chunk
the sums are the global batch's mean-loss gradients (``dyncp.runtime.pipeline``). The loss lives
on the last stage only and is summed over the whole grid, so every process gets it. As after
``execute`` (``dyncp.runtime.reduce``), a reduction that fails because a process failed the
last call raises StepFailed naming that process, read from the grid's failure board.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dyncp.control.failures import is_communication_error, name_after_failed_wait
from dyncp.runtime.executor import StepFailed
from dyncp.runtime.pipeline_groups import PipelineGroups
from dyncp.runtime.reduce import reduce_loss

__all__ = ["reduce_pipeline_loss", "reduce_stage_gradients"]


def reduce_stage_gradients(
    chunks: Sequence[nn.Module], groups: PipelineGroups
) -> dict[str, torch.Tensor]:
    """SUM the gradients of this process's chunks over its stage's DP x CP axis, in place
    (collective over the stage). Trainable parameters without a gradient get zeros first, frozen
    ones are skipped, as ``reduce_gradients`` does; a parameter shared by two chunks is reduced
    once. A reduction that fails because a process failed the last call raises StepFailed
    naming it (from the grid's board). Returns the reduced gradients by ``"<chunk>.<name>"``.
    """
    pool = groups.pool
    if pool is None:
        raise ValueError("this process is not on the pipeline grid")
    axis = pool.axis_group
    seen: set[int] = set()
    grads: dict[str, torch.Tensor] = {}
    with _naming(groups):
        for c, chunk in enumerate(chunks):
            for name, param in chunk.named_parameters():
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=axis)
                grads[f"{c}.{name}"] = param.grad
    return grads


def reduce_pipeline_loss(
    losses: Sequence[torch.Tensor], groups: PipelineGroups, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The step's loss on every process of the grid: ``report.losses`` summed over the grid
    (only the last stage holds any). Collective over the grid."""
    with _naming(groups):
        return reduce_loss(
            losses, dtype=dtype, device=groups.agreement_device, group=groups.agreement_group
        )


class _naming:
    """Turn a communication error of a reduction after ``execute_pipeline`` into StepFailed
    naming the process that failed the last call."""

    def __init__(self, groups: PipelineGroups) -> None:
        self.groups = groups

    def __enter__(self) -> None:
        self.entered, self.entered_wall = time.monotonic(), time.time()

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        groups = self.groups
        call, slots = groups.last_call
        if exc is None or call < 0 or groups.position is None:
            return False
        if not (isinstance(exc, RuntimeError) and is_communication_error(exc)):
            return False
        label = f"pipeline call {call} (found at the reduction)"
        culprit = name_after_failed_wait(
            groups.board(f"p{call}"),
            slots,
            groups.position,
            exc,
            entered=self.entered,
            entered_wall=self.entered_wall,
            label=label,
            earlier=range(-1, slots),
        )
        raise StepFailed(culprit.message, culprit.ranks) from exc
