"""After ``execute``: sum what every rank computed over the DP x CP axis.

With ``ctx.loss_scale`` applied in ``step_fn``, the gradients summed over all ranks are the
global batch's mean-loss gradients (see ``dyncp.runtime.executor``). A rank that ran no
micro-batch (or none touching a parameter) holds no ``.grad`` there: it must still take part in
every all-reduce, in the same order as the others, so it contributes zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["reduce_gradients", "reduce_loss"]


def reduce_gradients(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """SUM every parameter's gradient over ``group`` (default: all ranks), in place. Collective.

    Missing gradients become zeros first (and stay as the parameter's ``.grad``). Returns the
    reduced gradients by parameter name.
    """
    grads = {}
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
) -> torch.Tensor:
    """The step's loss: this rank's micro-batch losses (already scaled by ``ctx.loss_scale``)
    summed, then SUMmed over ``group``. Collective; a rank with no micro-batch adds zero."""
    if losses:
        total = torch.stack(list(losses)).sum()
    else:
        total = torch.zeros((), dtype=dtype, device=device)
    dist.all_reduce(total, group=group)
    return total
