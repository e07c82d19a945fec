"""After ``execute``: sum what every rank computed over the DP x CP axis.

With ``ctx.loss_scale`` applied in ``step_fn``, the gradients summed over all ranks are the
global batch's mean-loss gradients (see ``dyncp.runtime.executor``). A rank that ran no
micro-batch (or none touching a parameter) holds no ``.grad`` there: it must still take part in
every all-reduce, in the same order as the others, so it contributes zeros.

The reduction is where every rank meets after ``execute`` (which has no barrier between waves):
a rank whose groups never touched a failed rank learns of the failure here. Given ``pool=``, a
reduction that fails (a rank never arrives: the group's timeout) raises the executor's
``StepFailed`` naming the rank that failed the last ``execute`` call, from the failure board.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dyncp.control.failures import is_communication_error
from dyncp.runtime.executor import reduction_failed
from dyncp.runtime.group_pool import GroupPool

__all__ = ["naming_failures", "reduce_gradients", "reduce_loss"]


@contextlib.contextmanager
def naming_failures(pool: GroupPool | None) -> Iterator[None]:
    """Turn a communication error of a reduction after ``execute`` into StepFailed naming the
    rank that failed the last call (no-op without a pool); for reductions of one's own."""
    entered, entered_wall = time.monotonic(), time.time()
    try:
        yield
    except RuntimeError as exc:
        if pool is None or pool.last_call[0] < 0 or not is_communication_error(exc):
            raise
        raise reduction_failed(pool, exc, entered=entered, entered_wall=entered_wall) from exc


def reduce_gradients(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, pool: GroupPool | None = None
) -> dict[str, torch.Tensor]:
    """SUM every parameter's gradient over ``group`` (default: all ranks), in place. Collective.

    Missing gradients become zeros first (and stay as the parameter's ``.grad``). Returns the
    reduced gradients by parameter name.

    Raises:
        StepFailed: with ``pool``: the reduction failed because a rank failed the last
            ``execute`` call (named, see the module docstring).
    """
    grads = {}
    with naming_failures(pool):
        for name, param in model.named_parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
            grads[name] = param.grad
    return grads


def reduce_loss(
    losses: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    pool: GroupPool | None = None,
) -> torch.Tensor:
    """The step's loss: this rank's micro-batch losses (already scaled by ``ctx.loss_scale``)
    summed, then SUMmed over ``group``. Collective; a rank with no micro-batch adds zero.
    ``pool``: as in :func:`reduce_gradients`."""
    if losses:
        total = torch.stack(list(losses)).sum()
    else:
        total = torch.zeros((), dtype=dtype, device=device)
    with naming_failures(pool):
        dist.all_reduce(total, group=group)
    return total
