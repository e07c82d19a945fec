"""A dyncp step on a model sharded with FSDP2 (``fully_shard``): fixed collectives per step.

    model = build()                                   # e.g. a transformers causal LM
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)                 # per transformer block ...
    fully_shard(model, mesh=mesh)                     # ... and the root
    runner = FSDPRunner(model)
    report = runner.step(plan, pool, step_fn)         # instead of execute + reduce_gradients
    optimizer.step(); optimizer.zero_grad()

Why a runner at all: FSDP2 all-gathers a block's parameters in every forward (and again in the
backward when they were freed) and reduce-scatters its gradients in every backward. Those are
collectives over all ranks, so every rank must run the same number of forwards and backwards. A
dyncp plan gives ranks different micro-batch counts (a CP-1 rank runs many packs while a CP-4
ring runs one; a rank may run none in a wave, or in the whole step): plain FSDP2 hangs.

The design: **gather once, compute locally, reduce once.** :meth:`FSDPRunner.step`

1. all-gathers every FSDP unit's parameters (``FSDPModule.unshard``, one all-gather per unit, in
   the same order on every rank; units with only frozen parameters too), and tells FSDP2 to keep
   them (no reshard after forward or backward) and not to reduce
   (``set_requires_gradient_sync(False)``), so the micro-batches, activation-checkpoint
   recomputation included, issue no FSDP collective at all;
2. runs the plan with :func:`dyncp.runtime.execute` (the rank's own micro-batches, whatever their
   number, including zero, with ``ctx.loss_scale`` as usual). Each parameter's gradient is added,
   as soon as autograd has produced it, into a flat buffer per unit, in the reduction dtype and
   already laid out as the reduce-scatter input (rank r's rows of every parameter side by side),
   then dropped: no second copy of the gradients is ever held;
3. reduce-scatters each unit's buffer (one collective per unit, SUM, same order everywhere; a rank
   that ran nothing sends zeros) straight into its shard, writes it as the sharded parameter's
   ``.grad`` (added to any gradient already there), and reshards.

So every rank issues exactly one all-gather and one reduce-scatter per FSDP unit per step (no
reduce-scatter for a unit whose parameters are all frozen), whatever the plan: the same count
FSDP2 itself issues for a single forward + backward. The gradients are the
SUM over the DP x CP axis of ``ctx.loss_scale``-weighted token losses, i.e. exactly those of the
global batch's mean token loss (see :mod:`dyncp.runtime.executor`); FSDP2's own averaging is not
used, so no divide factor is involved.

The trade-off, and why this design: between the all-gather and the reduce-scatter every rank holds
all parameters in the compute dtype and all gradients in the reduction dtype (the memory of an
unsharded model's parameters and gradients; the optimizer state and the master weights stay
sharded, which is what ZeRO-2/FSDP save most of: AdamW's two moments and an fp32 master copy are
12 bytes per parameter). In exchange the parameters cross the network once per step instead of
once per micro-batch forward and once more per backward (FSDP2 with ``reshard_after_forward``),
and the gradients once per step instead of once per micro-batch. The alternatives that keep
FSDP2's per-block memory all cost compute or communication in proportion to the longest rank's
micro-batch count: padding every rank to the same count with dummy forwards and backwards (a CP-1
rank running 12 packs makes a CP-4 ring run 11 empty ones, each with a full all-gather and
reduce-scatter), or re-gathering per micro-batch. When even one unsharded copy of the parameters
and gradients does not fit, dyncp's plans are the wrong tool at that scale without tensor or
pipeline parallelism to shrink the per-rank model first.

Sizing the planner's ``capacity`` (tokens per rank in one micro-batch) for this runner: with P
parameters on a rank (the whole model; per TP/PP shard if those are used), W ranks on the FSDP
mesh, compute dtype bytes b_c (2 for bf16), reduction dtype bytes b_r (4 for fp32), master weight
bytes b_m (4) and optimizer bytes per parameter b_o (8 for AdamW), the memory left for activations
is ``M - P * (b_c + b_r) - P * (b_m + b_o) / W - M_reserve`` (M: the GPU memory; M_reserve: the
CUDA context, allocator fragmentation and kernels' workspaces, a few GiB). Divide it by the
activation bytes one token costs in forward + backward at CP 1 (measure it: run one micro-batch of
T tokens, read ``torch.cuda.max_memory_allocated()``, subtract the line above, divide by T;
activation checkpointing lowers it to about one hidden state per layer) and round down.

Mixed precision: with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=
torch.float32)`` the unsharded parameters are bf16, each micro-batch's bf16 gradient is added into
the fp32 buffer (as FSDP2 accumulates without sync), the reduction runs in fp32 and the shard is
cast to the sharded parameter's dtype. Pass ``reduce_dtype`` to :class:`FSDPRunner` to choose the
accumulation and reduction dtype (default: the sharded parameter's dtype, the master weights').

Settings this runner owns: during a step it sets every unit's reshard-after-forward and -backward
to False and gradient sync off; after the step it restores gradient sync and resharding after
backward, and sets resharding after forward back to FSDP2's default (True, except the root).

2-D meshes. **HSDP** (``fully_shard(..., mesh=replicate x shard mesh)``, placements
``(Replicate(), Shard(0))``): every rank of the mesh is one DP x CP rank of the plan (a pool over
all of them); each unit's buffer is reduce-scattered over the shard dim, then all-reduced over the
replicate dim (one all-gather over the shard dim, one reduce-scatter and one all-reduce per unit).
**FSDP2 + tensor parallel** (``parallelize_module(block, mesh["tp"], plan)`` in each block, then
``fully_shard(..., mesh=mesh["dp_cp"])``): the TP ranks of one DP x CP position run the same
micro-batches, so the plan's world is the ``dp_cp`` size and each TP index has its own
:class:`GroupPool` over the ranks with that index (built by every rank, in the same order; for
a row-major ``("dp_cp", "tp")`` mesh ``[GroupPool(ranks=range(t, world, tp)) for t in
range(tp)]``); dyncp schedules only the DP x CP axis, and ring attention runs over the TP
rank's local heads. A TP parameter's gradient stays on its TP rank (its local shard, as FSDP2
reduces it); the reduce-scatter is over the ``dp_cp`` dim only. The layout is read from each
sharded parameter's placements (:mod:`dyncp.integrations.fsdp_layout`).

Trainable parameters may change between steps: each step re-reads ``requires_grad`` and, when
the set changed (a stage frozen or unfrozen), rebuilds the units' layout, so an unfrozen
parameter gets its gradient and a frozen one none.

Requirements (checked, with a clear error): the FSDP2 root (``fully_shard`` applied to it; not a
unit inside another ``fully_shard`` module); FSDP2's dim-0 sharding (no ``shard_placement_fn``
on other dims) on a 1-D mesh ``(Shard(0),)``, an HSDP mesh ``(Replicate(), Shard(0))``, or
either followed by tensor-parallel dims whose placements are ``Replicate()`` or ``Shard(d)``;
the DP dims' ranks (shard x replicate) are the pool's DP x CP axis; every trainable parameter
under some ``fully_shard`` module. Not supported: FSDP2's SPMD path (``dp_mesh_dims``) with
model-parallel dims before the DP dims, ``Partial`` parameters. Tested on gloo: 1-D, HSDP
2 x 2 and DP-CP 2 x TP 2; HSDP with TP (a 3-D mesh) passes the checks but is untested.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dyncp.integrations.fsdp_layout import (
    Slot,
    Unit,
    check_root,
    own_parameters,
    trainable_flags,
    units,
)
from dyncp.plan import StepPlan
from dyncp.runtime import GroupPool, MicroBatchContext, RankReport, execute
from dyncp.runtime.reduce import naming_failures

__all__ = ["FSDPRunner"]

# The layout helpers under the names they had here (other FSDP runners import them).
_Slot, _Unit, _own_parameters, _units = Slot, Unit, own_parameters, units


class FSDPRunner:
    """Runs dyncp step plans on an FSDP2 model with one all-gather and one reduce-scatter per unit.

    Args:
        model: the FSDP2 root module; ``fully_shard`` applied to its blocks and to itself, on a
            1-D, HSDP or DP x TP mesh (see the module docstring).
        reduce_dtype: dtype the gradients are accumulated and reduced in (default: each sharded
            parameter's dtype, i.e. the master weights'; fp32 under a bf16 mixed-precision policy).

    Raises:
        ValueError: the model is not an FSDP2 model or not its root, uses a mesh or placement
            this runner does not support, or has trainable parameters outside every
            ``fully_shard`` module.
    """

    def __init__(self, model: nn.Module, *, reduce_dtype: torch.dtype | None = None) -> None:
        if not isinstance(model, FSDPModule):
            raise ValueError(
                f"FSDPRunner needs the root module sharded with fully_shard (and its blocks); "
                f"got a {type(model).__name__} that is not an FSDPModule"
            )
        check_root(model)
        self.model = model
        self.reduce_dtype = reduce_dtype
        self._units = _units(model)  # those with trainable parameters: one reduce-scatter each
        self._trainable = trainable_flags(model)  # what _units was built from
        # every fully_shard module, frozen ones too: a forward through a sharded one would gather
        self._modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._hooks: list = []

    @property
    def units(self) -> int:
        """FSDP units (``fully_shard`` modules): the all-gathers this runner issues per step.

        The reduce-scatters per step are the units that hold trainable parameters."""
        return len(self._modules)

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
        """Run this rank's share of ``plan``; on return the sharded parameters hold the gradients.

        The arguments are those of :func:`dyncp.runtime.execute`. Collective on the FSDP mesh,
        whose DP dims must be the pool's DP x CP axis (under TP: the pool of this TP index).
        ``step_fn`` backwards ``loss * ctx.loss_scale`` as usual.

        Whatever ``execute`` raises (PlanMismatchError, PlanError, StepFailed) passes through;
        then no gradient is written, the parameters are resharded locally (no collective) and
        the accumulated gradients are dropped. ``agree=False`` as in ``execute``.

        Raises:
            ValueError: the FSDP mesh is not on the pool's ranks, or a parameter (un)frozen since
                the last step is sharded in a way the runner does not support.
            StepFailed: also from the reduce-scatter, when a rank failed the step in a group
                this rank was not in (``execute`` has no barrier between waves).
        """
        if trainable_flags(self.model) != self._trainable:  # frozen or unfrozen since the last step
            self._units = _units(self.model)
            self._trainable = trainable_flags(self.model)
        for unit in self._units:
            if sorted(unit.dp_ranks) != sorted(pool.ranks):
                raise ValueError(
                    f"the FSDP mesh spans ranks {sorted(unit.dp_ranks)}, the pool's DP x CP axis "
                    f"ranks {sorted(pool.ranks)}; gradients must be summed over exactly the "
                    f"plan's ranks"
                )
        buffers = self._unshard()
        try:
            report = execute(
                plan,
                pool,
                step_fn,
                labels_per_sequence=labels_per_sequence,
                synchronize=synchronize,
                agree=agree,
            )
            with naming_failures(pool):
                self._reduce(buffers)
        except BaseException:
            self._finish()
            raise
        self._finish()
        return report

    def _unshard(self) -> list[torch.Tensor]:
        """All-gather every unit once and route its gradients into a zeroed flat buffer."""
        buffers = []
        for module in self._modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
            module.set_requires_gradient_sync(False, recurse=False)
        handles = [module.unshard(async_op=True) for module in self._modules]
        for handle in handles:
            if handle is not None:
                handle.wait()
        for unit in self._units:
            world = unit.group.size()
            dtype = self.reduce_dtype or unit.slots[0].sharded.dtype
            flat = torch.zeros(world * unit.segment, dtype=dtype, device=unit.device)
            buffers.append(flat)
            params = dict(own_parameters(unit.module))
            for slot in unit.slots:
                param = params[slot.name]  # the unsharded parameter forward uses
                view = flat.as_strided((world, slot.numel), (unit.segment, 1), slot.offset)
                self._hooks.append(param.register_post_accumulate_grad_hook(_adder(slot, view)))
        return buffers

    def _reduce(self, buffers: list[torch.Tensor]) -> None:
        """One reduce-scatter (SUM) per unit into its shard (HSDP: then one all-reduce over the
        replicate dim); then the shards' ``.grad``."""
        works, outputs = [], []
        for unit, flat in zip(self._units, buffers):
            out = flat.new_empty(unit.segment)
            works.append(_reduce_scatter(out, flat, group=unit.group, async_op=True))
            outputs.append(out)
        replicas = []
        for unit, work, out in zip(self._units, works, outputs):
            work.wait()
            if unit.replicate is not None:
                replicas.append(dist.all_reduce(out, group=unit.replicate, async_op=True))
        for work in replicas:
            work.wait()
        for unit, out in zip(self._units, outputs):
            me = unit.group.rank()
            for slot in unit.slots:
                local_rows = min(max(slot.rows - me * slot.chunk, 0), slot.chunk)
                local = slot.sharded.to_local()
                grad = out[slot.offset : slot.offset + local_rows * slot.row_numel]
                grad = grad.view(local.shape).to(local.dtype)
                if slot.sharded.grad is None:
                    slot.sharded.grad = DTensor.from_local(
                        grad,
                        slot.sharded.device_mesh,
                        slot.sharded.placements,
                        run_check=False,
                        shape=slot.sharded.shape,
                        stride=slot.sharded.stride(),
                    )
                else:
                    slot.sharded.grad.to_local().add_(grad)

    def _finish(self) -> None:
        """Remove the gradient hooks, reshard (local) and give FSDP2 its settings back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._modules:
            for _, param in own_parameters(module):
                param.grad = None  # an unsharded gradient left by a failed step
            module.reshard()
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.set_reshard_after_forward(module is not self.model, recurse=False)


def _reduce_scatter(
    out: torch.Tensor, flat: torch.Tensor, *, group: dist.ProcessGroup, async_op: bool
) -> dist.Work:
    """SUM ``flat`` over ``group``, rank r keeping segment r (``reduce_scatter_single`` is the
    newer torch's name for ``reduce_scatter_tensor``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, flat, group=group, async_op=async_op)


def _adder(slot: Slot, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """The hook that moves a fresh unsharded gradient into the unit's buffer (padded layout)."""
    full = slot.rows // slot.chunk  # ranks whose chunk is full
    rest = slot.rows - full * slot.chunk

    def add(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor):  # a tensor-parallel parameter: its TP rank's shard
            if grad.placements != param.placements:  # e.g. Partial: as FSDP2 does, redistribute
                grad = grad.redistribute(placements=param.placements)
            grad = grad.to_local()
        grad = grad.reshape(slot.rows * slot.row_numel)
        view[:full].add_(grad[: full * slot.numel].view(full, slot.numel))
        if rest:
            view[full, : rest * slot.row_numel].add_(grad[full * slot.numel :])
        param.grad = None

    return add
