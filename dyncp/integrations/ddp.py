"""A dyncp step on a ``DistributedDataParallel`` model: no collective per micro-batch, one reduce.

    model = DistributedDataParallel(build())
    runner = DDPRunner(model)
    report = runner.step(plan, pool, step_fn)         # instead of execute + reduce_gradients
    optimizer.step(); optimizer.zero_grad()

Why: DDP all-reduces gradient buckets during every backward, so every rank must run the same
number of backwards; a dyncp plan gives ranks different micro-batch counts (none, for a rank idle
in the whole step), and plain DDP hangs. :meth:`DDPRunner.step` runs the plan inside
``model.no_sync()`` (gradients accumulate locally, DDP issues nothing) and then sums the gradients
once over DDP's process group with :func:`dyncp.runtime.reduce_gradients` (one all-reduce per
25 MiB bucket of gradients, in the same order on every rank; a rank without a gradient sends
zeros). Summing (not
DDP's averaging) of ``ctx.loss_scale``-weighted losses gives exactly the gradients of the global
batch's mean token loss. Frozen parameters (``requires_grad=False``) are left out, as DDP leaves
them out: their ``.grad`` stays None, so an optimizer with weight decay never moves them.

DDP also broadcasts module buffers from rank 0 before a forward when ``broadcast_buffers`` is set
(on the first forward after construction or after a synchronised backward), another collective per
forward. The runner does that broadcast itself once per step, before the micro-batches, and tells
DDP the forwards need no sync, so buffers keep DDP's semantics at a fixed cost.

Memory is DDP's: every rank holds the whole model, its gradients and its optimizer state, so the
planner's ``capacity`` is what is left of the GPU memory after those, divided by the activation
bytes per token (see :mod:`dyncp.integrations.fsdp` for how to measure it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dyncp.integrations.axis import check_same_ranks
from dyncp.plan import StepPlan
from dyncp.runtime import GroupPool, MicroBatchContext, RankReport, execute, reduce_gradients

__all__ = ["DDPRunner"]


class DDPRunner:
    """Runs dyncp step plans on a DDP model with a fixed number of collectives per step.

    Args:
        model: the ``DistributedDataParallel`` module; ``step_fn`` may call it or its ``.module``.

    Raises:
        ValueError: ``model`` is not a DistributedDataParallel module.
    """

    def __init__(self, model: DistributedDataParallel) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"DDPRunner needs a torch.nn.parallel.DistributedDataParallel model, got a "
                f"{type(model).__name__}"
            )
        self.model = model

    def step(
        self,
        plan: StepPlan,
        pool: GroupPool,
        step_fn: Callable[[MicroBatchContext], object],
        *,
        labels_per_sequence: Sequence[int] | None = None,
        synchronize: Callable[[], None] | None = None,
        agree: bool = True,
    ) -> RankReport:
        """Run this rank's share of ``plan``; on return every rank holds the summed gradients.

        The arguments are those of :func:`dyncp.runtime.execute`. Collective on DDP's process
        group, which must be the pool's DP x CP axis.

        Whatever ``execute`` raises passes through; then no reduction runs (the local
        gradients stay). ``agree=False`` as in ``execute``.

        Raises:
            ValueError: DDP's process group is not on the pool's ranks.
            StepFailed: also from the reduction, when a rank failed the step in a group this
                rank was not in (``execute`` has no barrier between waves).
        """
        model = self.model
        group = model.process_group
        check_same_ranks(group, pool, what="DDP's process group")
        if model.broadcast_buffers:
            source = dist.get_global_rank(group, 0) if group is not None else 0
            for buffer in model.module.buffers():
                dist.broadcast(buffer, src=source, group=group)
        # DDP decides at the end of each forward whether the next one syncs buffers; the runner
        # did it above for the whole step.
        model.require_forward_param_sync = False
        with model.no_sync():
            report = execute(
                plan,
                pool,
                step_fn,
                labels_per_sequence=labels_per_sequence,
                synchronize=synchronize,
                agree=agree,
            )
        reduce_gradients(model.module, group, pool=pool)
        return report
