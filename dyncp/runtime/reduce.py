"""After ``execute``: sum what every rank computed over the DP x CP axis.

With ``ctx.loss_scale`` applied in ``step_fn``, the gradients summed over all ranks are the
global batch's mean-loss gradients (see ``dyncp.runtime.executor``). A rank that ran no
micro-batch (or none touching a parameter) holds no ``.grad`` there: it must still take part in
every all-reduce, in the same order as the others, so it contributes zeros. Frozen parameters
(``requires_grad=False``) take no part and keep ``.grad`` None, as under plain DDP.

Every rank must send buffers of the same size and dtype (gloo aborts the process on a mismatch,
NCCL reads past the buffer), and an idle rank cannot see what dtype the others computed in. So
the step's loss travels as one fixed float64 buffer on every rank, which also carries how many
losses of each dtype the ranks held: the result's dtype is agreed in the same all-reduce.

The reduction is where every rank meets after ``execute`` (which has no barrier between waves):
a rank whose groups never touched a failed rank learns of the failure here. Given ``pool=``, a
reduction that fails (a rank never arrives: the group's timeout) raises the executor's
``StepFailed`` naming the rank that failed the last ``execute`` call, from the failure board.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dyncp.control.failures import is_communication_error
from dyncp.runtime.executor import reduction_failed
from dyncp.runtime.group_pool import GroupPool

__all__ = ["BUCKET_BYTES", "naming_failures", "reduce_gradients", "reduce_loss"]

#: Gradient bytes per all-reduce of ``reduce_gradients``: torch DDP's default bucket
#: (``bucket_cap_mb=25``). One call per parameter tensor pays a call's latency per tensor: on 2
#: gloo processes the tiny decoder's 17 tensors took 33.5 ms that way against 1.2 ms as one
#: buffer (medians of 30 interleaved, load average 6.4), and the cost model prices the
#: reduction as one buffer of the gradients' bytes (``dyncp.cost_model.step_parts``).
BUCKET_BYTES = 25 * 2**20


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
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    pool: GroupPool | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> dict[str, torch.Tensor]:
    """SUM every trainable parameter's gradient over ``group`` (default: all ranks), in place.
    Collective.

    Consecutive gradients of one dtype and device go as one flat buffer of at most
    ``bucket_bytes`` (a larger tensor alone): one all-reduce per bucket, not per tensor
    (``BUCKET_BYTES``). Each element is summed over the same ranks either way.

    A trainable parameter (``requires_grad``) without a gradient on this rank (it ran no
    micro-batch touching it) gets zeros first, which stay as its ``.grad``. A frozen one is
    skipped: its ``.grad`` stays what it was (None after ``zero_grad``), as under plain DDP,
    which registers no hook for it; a zero gradient would not be harmless, since optimizers with
    decoupled weight decay (AdamW) move every parameter that has a gradient, zero or not. Which
    parameters are trainable must be the same on every rank (the all-reduces go in parameter
    order). Returns the reduced gradients by parameter name (trainable parameters only).

    Raises:
        StepFailed: with ``pool``: the reduction failed because a rank failed the last
            ``execute`` call (named, see the module docstring).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    grads = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads[name] = param.grad
    with naming_failures(pool):
        for bucket in _buckets(list(grads.values()), bucket_bytes):
            if len(bucket) == 1:
                dist.all_reduce(bucket[0], group=group)
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))
    return grads


def _buckets(grads: list[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    """Runs of consecutive tensors of one dtype and device, each at most ``cap`` bytes (a larger
    tensor alone), in order: the same buckets on every rank, whose tensors are the same."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (
            size + nbytes > cap or (g.dtype, g.device) != (bucket[0].dtype, bucket[0].device)
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def reduce_loss(
    losses: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    pool: GroupPool | None = None,
) -> torch.Tensor:
    """The step's loss: this rank's micro-batch losses (already scaled by ``ctx.loss_scale``)
    summed, then SUMmed over ``group``; detached, the same value and dtype on every rank.
    Collective; a rank with no micro-batch adds zero.

    Every rank sends the same buffer whatever its losses (see :func:`_loss_buffer`), so ranks
    whose loss dtypes differ, or a rank with no loss at all, can never send mismatched sizes
    (gloo aborts the process on that; NCCL would read past the buffer). The sum accumulates in
    float64, at least as precise as any loss dtype, and is rounded to the result's dtype once.

    Args:
        losses: this rank's micro-batch losses (each summed if it has more than one element).
        dtype: the result's dtype. Default: torch's type promotion over every rank's losses (an
            fp64 loss stays fp64, bf16 and fp16 together give fp32), agreed in the same
            all-reduce; float32 when no rank has a loss.
        device: where a rank without losses builds its buffer; the others use their losses'
            (on NCCL pass the rank's CUDA device).
        group: the ranks to sum over (default: all).
        pool: as in :func:`reduce_gradients`.

    Raises:
        ValueError: ``dtype`` is not floating point; or, on every rank alike (after the
            all-reduce), some rank passed a loss that is not a float16, bfloat16, float32 or
            float64 tensor.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"reduce_loss dtype must be a floating-point torch.dtype, got {dtype!r}")
    buffer, wrong = _loss_buffer(losses, device)
    with naming_failures(pool):
        dist.all_reduce(buffer, group=group)
    if buffer[-1] > 0:
        mine = f" (this rank: {wrong})" if wrong else ""
        raise ValueError(
            f"reduce_loss takes float16, bfloat16, float32 or float64 loss tensors; "
            f"{int(buffer[-1])} loss(es) over the group were something else{mine}"
        )
    if dtype is None:
        present = [t for t, n in zip(_LOSS_DTYPES, buffer[1:-1].tolist()) if n > 0]
        dtype = functools.reduce(torch.promote_types, present) if present else torch.float32
    return buffer[0].to(dtype)


#: The loss dtypes ``reduce_loss`` counts, in the order of their slots in the buffer.
_LOSS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _loss_buffer(
    losses: Sequence[torch.Tensor], device: torch.device | str
) -> tuple[torch.Tensor, str]:
    """This rank's float64 buffer ``[sum, count per dtype of _LOSS_DTYPES..., other]``, and the
    kinds of the losses counted as other (named in the error).

    Always float64 and ``2 + len(_LOSS_DTYPES)`` long, on every rank: the all-reduce's size
    never depends on what a rank computed. A loss that cannot be summed is counted, not raised
    on, so that every rank still reaches the all-reduce and all of them raise the same error.
    """
    where = next((t.device for t in losses if isinstance(t, torch.Tensor)), torch.device(device))
    buffer = torch.zeros(2 + len(_LOSS_DTYPES), dtype=torch.float64, device=where)
    wrong = []
    for loss in losses:
        if isinstance(loss, torch.Tensor) and loss.dtype in _LOSS_DTYPES:
            buffer[0] += loss.detach().to(device=where, dtype=torch.float64).sum()
            buffer[1 + _LOSS_DTYPES.index(loss.dtype)] += 1
        else:
            buffer[-1] += 1
            wrong.append(str(loss.dtype) if isinstance(loss, torch.Tensor) else type(loss).__name__)
    return buffer, ", ".join(sorted(set(wrong)))
