"""A dyncp step on an FSDP2 model with FSDP2's own full sharding: memory per block, lockstep passes.

    for block in model.blocks:
        fully_shard(block, mesh=mesh)                 # per block ...
    fully_shard(model, mesh=mesh)                     # ... and the root
    runner = ShardedFSDPRunner(model)                 # reduce="every-pass" (the default)
    report = runner.step(plan, pool, step_fn)         # as FSDPRunner.step
    optimizer.step(); optimizer.zero_grad()

Why a second FSDP2 runner: :class:`~dyncp.integrations.fsdp.FSDPRunner` gathers every unit once
and keeps the whole model unsharded for the step (its parameters and a full gradient buffer on
every rank), the fastest way when that fits. When it does not, this runner leaves FSDP2's
per-block all-gather, reshard-after-forward, prefetch and reduce-scatter exactly as FSDP2 runs
them, so a rank holds at any time the root unit's and about two blocks' unsharded parameters
(the one computing and the one prefetched), beyond its shards.

FSDP2's block collectives span every rank, in every forward and every backward. So every rank
must run the same number of forward+backward passes, and the k-th pass of every rank must meet
the k-th of the others. The runner runs the plan as passes (:mod:`dyncp.plan.passes`, through
``execute(..., lockstep=True)``): in each wave every rank runs as many passes as the wave's
busiest group has micro-batches; a rank whose group has fewer, or that is idle in the wave, runs
*empty passes* there. An empty pass calls the user's ``step_fn`` with a filler context
(:func:`dyncp.runtime.filler_context`: the batch's shortest sequence alone at CP 1, with
``ctx.loss_scale == 0.0``), so ``step_fn`` needs no change and backwards a loss that is exactly
zero: every gradient gets exactly zero added, while FSDP2 still issues the pass's collectives.
A pass-aligned plan (``pass_schedule(plan).aligned``) has no empty pass; every other plan pays
one forward+backward of the shortest sequence, and a full pass's collectives, per empty pass.

When the gradients are reduced (``reduce=``), chosen by memory:

- ``"every-pass"`` (default): FSDP2 reduce-scatters each block's gradients in every backward and
  sums them into the sharded ``.grad`` (FSDP2's own accumulation). Gradient memory: the shards
  (1/W of the model in the parameters' dtype) plus one or two blocks' unsharded gradients in
  flight. Collectives: one reduce-scatter per unit per pass.
- ``"once"``: gradient sync is off until the step's last pass, so FSDP2 keeps every unit's
  unsharded gradient (in its reduce dtype) and reduce-scatters the sum once, in the last pass.
  Gradient memory: a whole unsharded gradient of the trainable parameters (what gather-once
  holds too), for one reduce-scatter per unit per step instead of per pass.

Rule: take ``"once"`` when a whole unsharded gradient (trainable parameters x reduce-dtype
bytes) fits the rank's memory budget beside the rest, else ``"every-pass"``;
:func:`dyncp.integrations.fsdp_mode.choose_fsdp_mode` applies it.

Gradients: the SUM over the DP x CP axis of ``ctx.loss_scale``-weighted token losses, the same as
FSDPRunner's (the global batch's mean token loss, see :mod:`dyncp.runtime.executor`). FSDP2
would average over the mesh; during a step the runner sets every unit's gradient divide factor to
1.0 and forces SUM reductions (``set_gradient_divide_factor(1.0)``,
``set_force_sum_reduction_for_comms(True)``: a divide factor of 1 on gloo would otherwise ask for
a pre-multiplied sum gloo lacks), and restores the units' own settings after the step. A
gradient already on a sharded parameter before the step is set aside and added back at the end
(``.grad`` + this step's), so that a failed step leaves it as it was.

Failure handling, as FSDPRunner: whatever ``execute`` raises (PlanMismatchError, PlanError,
StepFailed) passes through; then FSDP2's iteration state is reset (``reset_iter_state`` on the
root: in-flight collectives waited, every unit resharded), the failed step's gradients dropped,
the earlier ``.grad`` put back and the settings restored. A collective of FSDP2's that fails
because another rank failed names that rank (a lockstep execute blames any rank of the axis).

Meshes (tested exact against one process in ``tests/multirank/test_fsdp_sharded.py`` and
``tests/multirank/test_fsdp_sharded_mesh.py``):

- 1-D: ``fully_shard(..., mesh=mesh)`` on the pool's DP x CP ranks.
- HSDP: ``fully_shard(..., mesh=mesh2d)``, replicate x shard. FSDP2 reduce-scatters over the
  shard dim and all-reduces over the replicate dim; the divide factor of 1 with forced SUM
  covers both collectives (no averaging over either), and every rank of the 2-D mesh is one
  DP x CP rank of the plan: the pool spans them all, and the lockstep passes run over all.
- FSDP2 + tensor parallel: a ("dp_cp", "tp") mesh, ``parallelize_module(block, mesh["tp"], ...)``
  inside each block, then ``fully_shard`` on ``mesh["dp_cp"]``. dyncp schedules the DP x CP axis
  only: each TP index has its own pool over the DP x CP ranks with that index (the plan's world
  is the dp_cp size), and the TP ranks of one DP x CP position run the same plan position, so
  the same micro-batches and the same empty passes (the filler is a function of the plan), and
  meet in the same TP collectives.

Anything else (HSDP + TP, two model-parallel dims: 3-D) is refused with the placements named.

Requirements (checked, with a clear error): FSDP2 (``fully_shard``) on one of the meshes above,
whose DP x CP ranks (at this rank's TP index) are the pool's ranks; every trainable parameter
under some ``fully_shard`` module; a whole :class:`~dyncp.plan.StepPlan` (not a PlanSlice: every
group's micro-batch count is needed to align the passes). ``step_fn`` runs exactly one
forward+backward through the model per call and backwards ``loss * ctx.loss_scale``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dyncp.plan import StepPlan, pass_schedule
from dyncp.runtime import GroupPool, MicroBatchContext, RankReport, execute

__all__ = ["REDUCE_MODES", "ShardedFSDPRunner"]

#: When gradients are reduced: in every pass (sharded gradients) or once, in the last pass.
REDUCE_MODES = ("every-pass", "once")

Reduce = Literal["every-pass", "once"]


class ShardedFSDPRunner:
    """Runs dyncp step plans on an FSDP2 model in lockstep passes, FSDP2's collectives unchanged.

    Args:
        model: the root module; ``fully_shard`` applied to its blocks and to itself.
        reduce: ``"every-pass"`` (reduce-scatter in every backward: sharded gradients) or
            ``"once"`` (accumulate unsharded gradients, reduce in the last pass); see the
            module docstring for the memory rule.

    Raises:
        ValueError: the model is not an FSDP2 root, uses a mesh this runner does not support, has
            trainable parameters outside every ``fully_shard`` module, or ``reduce`` is unknown.
    """

    def __init__(self, model: nn.Module, *, reduce: Reduce = "every-pass") -> None:
        if not isinstance(model, FSDPModule):
            raise ValueError(
                f"ShardedFSDPRunner needs the root module sharded with fully_shard (and its "
                f"blocks); got a {type(model).__name__} that is not an FSDPModule"
            )
        if reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
        self.model = model
        self.reduce = reduce
        self._modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._dp_ranks = _dp_ranks(model)

    @property
    def units(self) -> int:
        """FSDP units (``fully_shard`` modules): FSDP2 all-gathers each at least once per pass."""
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
        """Run this rank's passes of ``plan``; on return the sharded parameters hold the gradients.

        The arguments are those of :func:`dyncp.runtime.execute`; ``step_fn`` is also called for
        this rank's empty passes, with ``ctx.loss_scale == 0.0`` (see the module docstring).
        Collective on the FSDP mesh, which must be the pool's DP x CP axis. The report's
        ``timings`` list the real micro-batches; ``empty_passes`` counts the others.

        Raises:
            ValueError: the FSDP mesh is not on the pool's ranks, or ``plan`` is a PlanSlice.
            PlanMismatchError, PlanError, StepFailed: from ``execute``, unchanged; the
                gradients are then as before the step.
        """
        if list(self._dp_ranks) != sorted(pool.ranks):
            raise ValueError(
                f"the FSDP mesh spans ranks {list(self._dp_ranks)}, the pool's DP x CP axis "
                f"ranks {sorted(pool.ranks)}; gradients must be summed over exactly the plan's "
                f"ranks (under tensor parallelism: a pool per TP index, over its DP x CP ranks)"
            )
        if not isinstance(plan, StepPlan):
            raise ValueError(
                f"ShardedFSDPRunner needs the whole StepPlan to align the passes, got a "
                f"{type(plan).__name__}"
            )
        passes = pass_schedule(plan).passes
        saved = self._set_aside_grads()
        settings = self._configure()
        calls = 0

        def run(ctx: MicroBatchContext) -> object:
            nonlocal calls
            calls += 1
            if self.reduce == "once" and calls == passes:  # the last pass reduces the sum
                for module in self._modules:
                    module.set_requires_gradient_sync(True, recurse=False)
            return step_fn(ctx)

        try:
            report = execute(
                plan,
                pool,
                run,
                labels_per_sequence=labels_per_sequence,
                synchronize=synchronize,
                agree=agree,
                lockstep=True,
            )
        except BaseException:
            self._reset()
            self._restore(settings)
            for param, grad in saved:
                param.grad = grad
            raise
        self._restore(settings)
        with torch.no_grad():
            for param, grad in saved:
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.to_local().add_(grad.to_local())
        return report

    def _set_aside_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Take every sharded ``.grad`` off its parameter (put back or added after the step)."""
        saved = []
        for param in self.model.parameters():
            if param.grad is not None:
                saved.append((param, param.grad))
                param.grad = None
        return saved

    def _configure(self) -> list[tuple[object, tuple]]:
        """SUM reductions with no divide factor (and sync off for ``"once"``); the old values."""
        settings = []
        for module in self._modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                settings.append(
                    (
                        group,
                        (
                            group.reduce_grads,
                            group.all_reduce_grads,
                            group.gradient_divide_factor,
                            group.force_sum_reduction_for_comms,
                        ),
                    )
                )
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            if self.reduce == "once":
                module.set_requires_gradient_sync(False, recurse=False)
        return settings

    @staticmethod
    def _restore(settings: list[tuple[object, tuple]]) -> None:
        for group, values in settings:
            (
                group.reduce_grads,
                group.all_reduce_grads,
                group.gradient_divide_factor,
                group.force_sum_reduction_for_comms,
            ) = values

    def _reset(self) -> None:
        """After a failed step: FSDP2's iteration state reset, every unit resharded (no
        collective), the failed step's gradients (sharded and unsharded) dropped."""
        reset = getattr(self.model, "reset_iter_state", None)
        if reset is not None and self.model._get_fsdp_state()._is_root:  # after a forward
            reset()
        for module in self._modules:
            module.reshard()
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    fsdp_param.unsharded_accumulated_grad = None
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        for param in self.model.parameters():
            param.grad = None


def _dp_ranks(model: nn.Module) -> tuple[int, ...]:
    """The DP x CP ranks every trainable parameter's gradient is summed over (checked).

    Read from each unit's FSDP2 mesh (the mesh given to ``fully_shard``): a 1-D mesh shards over
    its ranks; an HSDP 2-D mesh (replicate x shard) reduce-scatters over the shard dim and
    all-reduces over the replicate dim, so it sums over all its ranks. A parameter's own mesh may
    add one tensor-parallel dim to a 1-D FSDP mesh (``fully_shard`` on the "dp_cp" sub-mesh
    after ``parallelize_module``); the gradient is then summed over this TP index's ranks only.
    """
    owner: dict[int, tuple[int, int]] = {}  # id(param) -> (FSDP mesh dims, ranks) of its unit
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            mesh = group.mesh_info.mesh
            ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
            for fsdp_param in group.fsdp_params:
                owner[id(fsdp_param.sharded_param)] = (mesh.ndim, ranks)
    found, stray = None, []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) not in owner or not isinstance(param, DTensor):
            stray.append(name)
            continue
        fsdp_dims, ranks = owner[id(param)]
        model_dims = param.device_mesh.ndim - fsdp_dims
        if param.device_mesh.ndim > 2 or (fsdp_dims, model_dims) not in ((1, 0), (2, 0), (1, 1)):
            raise ValueError(
                f"parameter {name!r} is placed {tuple(param.placements)} on a "
                f"{param.device_mesh.ndim}-D mesh ({fsdp_dims}-D FSDP mesh); ShardedFSDPRunner "
                f"supports fully_shard on a 1-D mesh, HSDP on a 2-D (replicate, shard) mesh, and "
                f"a 1-D FSDP mesh with one tensor-parallel dim (2-D in all)"
            )
        if found is None:
            found = (ranks, name)
        elif ranks != found[0]:
            raise ValueError(
                f"parameters {found[1]!r} and {name!r} are sharded over different DP x CP ranks "
                f"({list(found[0])} vs {list(ranks)}); shard every unit on the one DP x CP mesh"
            )
    if stray:
        raise ValueError(
            f"trainable parameters outside every fully_shard module: {stray[:5]}; shard the root "
            f"module too (fully_shard(model)) so each parameter has one owner"
        )
    if found is None:
        raise ValueError("the model has no trainable parameter under fully_shard")
    return found[0]
