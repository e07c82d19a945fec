"""Which FSDP2 runner a rank's memory allows: gather-once when it fits, else full sharding.

    choice = choose_fsdp_mode(model, memory_budget=70 * 2**30, activation_bytes=act)
    print(choice.reason)          # the bytes each mode needs against the budget
    runner = choice.runner(model) # an FSDPRunner, or a ShardedFSDPRunner(reduce=...)
    planner = Planner(cost, world=..., ranks_per_node=8, capacity=...,
                      **choice.planner_options(cost.profile, ranks_per_node=8))

The two runners trade memory for communication. Gather-once
(:class:`~dyncp.integrations.fsdp.FSDPRunner`) all-gathers every unit once and reduces once per
step, whatever the plan: the fewest collectives and no empty pass, but a whole unsharded model and
a whole gradient buffer on every rank. Full sharding
(:class:`~dyncp.integrations.fsdp_sharded.ShardedFSDPRunner`) keeps FSDP2's per-block memory and
pays FSDP2's collectives in every pass, plus an empty pass wherever the plan is not
pass-aligned. So the rule is: the fastest mode that fits. In order: gather-once; full sharding
with gradients reduced once (``reduce="once"``: one reduce-scatter per unit per step, a whole
unsharded gradient held); full sharding with gradients reduced every pass (sharded gradients).

Per-rank bytes, with P parameters (T of them trainable; under tensor parallelism, this TP rank's
parts of them), W ranks on the FSDP mesh's shard dim (HSDP replicates over the other), compute
(unsharded parameter) dtype bytes b_c, reduce dtype bytes b_r, master (sharded parameter) bytes
b_m, optimizer bytes per trainable parameter b_o, the root unit's own parameters R (T_R
trainable) and the largest other unit's B (T_B trainable), A the activations' peak (measured by
the caller; the same in every mode, since every mode runs the same micro-batches):

- every mode: ``P b_m / W + T (b_m + b_o) / W + A`` (shards, sharded gradients, optimizer state);
- gather-once adds ``P b_c + T b_r + T b_r / W`` (every unit unsharded, the flat gradient
  buffer and its reduce-scatter output: what :class:`FSDPRunner` holds at its reduce-scatter);
- full sharding adds ``(R + 2 B) b_c`` (the root stays unsharded through forward and backward;
  the block computing and, on a GPU, the one FSDP2 prefetches) and, for its gradients,
  ``T b_r`` with ``reduce="once"`` (every unit's unsharded gradient until the last pass) or
  ``(T_R + 2 T_B) b_r`` with ``"every-pass"`` (the units' unsharded gradients before their
  reduce-scatter).

The planner prices the chosen mode: ``FSDPModeChoice.planner_options`` gives gather-once the
default (dataflow) planner and full sharding ``passes="aligned"`` with a ``ShardingCost`` of the
model's own units, dtypes and reduce mode (``dyncp.cost_model.sharding``).

These are the tensors the runners keep alive, counted the way the multirank tests measure them
(gather-once's peak is in ``bench/fsdp_bench.py``; full sharding's unsharded parameters never
exceed the root and one block on CPU, see ``tests/multirank/test_fsdp_sharded.py``; the second
block is the GPU's prefetch, an upper bound here). Allocator fragmentation, the CUDA context and
kernels' workspaces are not in them: keep them out of ``memory_budget``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from dyncp.cost_model import Profile, ShardingCost

__all__ = ["FSDPModeChoice", "FSDPSizes", "choose_fsdp_mode", "mode_bytes"]

Mode = Literal["gather-once", "sharded-once", "sharded-every-pass"]
#: The modes, fastest first: the order the choice tries them in.
MODES: tuple[Mode, ...] = ("gather-once", "sharded-once", "sharded-every-pass")


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPSizes:
    """What the modes' memory depends on: parameter counts per rank and the dtypes' bytes.

    Counts are whole (unsharded) parameters, under tensor parallelism the TP rank's parts, and
    ``world`` the FSDP shard dim's size (HSDP's replicate dim holds copies); ``root``: the root
    unit's own, ``block``: the largest other unit's (``*_trainable``: those with
    ``requires_grad``).
    """

    params: int
    trainable: int
    root: int
    root_trainable: int
    block: int
    block_trainable: int
    world: int
    compute_bytes: int
    reduce_bytes: int
    master_bytes: int
    optimizer_bytes: float  # per trainable parameter (AdamW: two moments, 2 x master bytes)
    #: Every unit's parameters, root first, then the others in module order (the order their
    #: forwards run in for a sequential stack); what the planner's ``ShardingCost`` prices.
    #: Empty when the sizes were not read from a model.
    unit_params: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        units = tuple(int(n) for n in self.unit_params)
        object.__setattr__(self, "unit_params", units)
        if units and (min(units) < 0 or sum(units) != self.params):
            raise ValueError(
                f"unit_params must be >= 0 each and sum to params ({self.params}), got {units}"
            )
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        counts = (self.params, self.trainable, self.root, self.root_trainable, self.block)
        if min(counts + (self.block_trainable,)) < 0:
            raise ValueError("parameter counts must be >= 0")
        if self.trainable > self.params or self.root + self.block > self.params:
            raise ValueError(
                f"trainable ({self.trainable}) and root + block ({self.root + self.block}) must "
                f"not exceed params ({self.params})"
            )
        if min(self.compute_bytes, self.reduce_bytes, self.master_bytes) < 1:
            raise ValueError("dtype bytes must be >= 1")
        if self.optimizer_bytes < 0:
            raise ValueError(f"optimizer_bytes must be >= 0, got {self.optimizer_bytes}")

    @classmethod
    def of(cls, model: nn.Module, *, optimizer_bytes: float | None = None) -> FSDPSizes:
        """Read from an FSDP2 root (``fully_shard`` on its blocks and itself).

        ``optimizer_bytes`` per trainable parameter defaults to AdamW's two moments in the
        master dtype (2 x its bytes)."""
        if not isinstance(model, FSDPModule):
            raise ValueError(
                f"choose_fsdp_mode needs the root module sharded with fully_shard; got a "
                f"{type(model).__name__} that is not an FSDPModule"
            )
        units = []  # (own params, own trainable) of every fully_shard module, root first
        compute = reduce = master = world = None
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            total = trainable = 0
            for group in module._get_fsdp_state()._fsdp_param_groups:
                policy = group.mp_policy
                for fsdp_param in group.fsdp_params:
                    param = fsdp_param.sharded_param
                    numel = _model_local_numel(param, group.mesh_info.mesh.ndim)
                    total += numel
                    trainable += numel if param.requires_grad else 0
                    if master is None and isinstance(param, DTensor):
                        master = param.dtype
                        world = group.mesh_info.shard_mesh_size
                        compute = policy.param_dtype or param.dtype
                        reduce = policy.reduce_dtype or compute
            units.append((total, trainable))
        if master is None or world is None or compute is None or reduce is None:
            raise ValueError("the model has no parameter under fully_shard")
        m = _bytes(master)
        biggest = max(units[1:], default=(0, 0))
        return cls(
            params=sum(u[0] for u in units),
            trainable=sum(u[1] for u in units),
            root=units[0][0],
            root_trainable=units[0][1],
            block=biggest[0],
            block_trainable=biggest[1],
            world=world,
            compute_bytes=_bytes(compute),
            reduce_bytes=_bytes(reduce),
            master_bytes=m,
            optimizer_bytes=2.0 * m if optimizer_bytes is None else optimizer_bytes,
            unit_params=tuple(u[0] for u in units),
        )


def _model_local_numel(param: torch.Tensor, fsdp_dims: int) -> int:
    """Elements of the tensor FSDP2 shards on this rank: the whole parameter, or under tensor
    parallelism (mesh dims after the ``fully_shard`` mesh's) this TP rank's part of it."""
    if not isinstance(param, DTensor):
        return param.numel()
    mesh, shape = param.device_mesh, list(param.shape)
    for j, placement in enumerate(param.placements):
        if j >= fsdp_dims and isinstance(placement, Shard):
            size, n, k = shape[placement.dim], mesh.size(j), mesh.get_local_rank(j)
            step = -(-size // n)
            shape[placement.dim] = min(max(size - k * step, 0), step)
    return math.prod(shape)


def mode_bytes(sizes: FSDPSizes, *, activation_bytes: int = 0) -> dict[Mode, int]:
    """Per-rank bytes of each mode (see the module docstring for the terms)."""
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes}")
    s, w = sizes, sizes.world
    common = (
        s.params * s.master_bytes / w
        + s.trainable * (s.master_bytes + s.optimizer_bytes) / w
        + activation_bytes
    )
    gathered = (s.root + 2 * s.block) * s.compute_bytes
    need = {
        "gather-once": common
        + s.params * s.compute_bytes
        + s.trainable * s.reduce_bytes * (1 + 1 / w),
        "sharded-once": common + gathered + s.trainable * s.reduce_bytes,
        "sharded-every-pass": common
        + gathered
        + (s.root_trainable + 2 * s.block_trainable) * s.reduce_bytes,
    }
    return {mode: int(round(b)) for mode, b in need.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPModeChoice:
    """The chosen mode, the bytes every mode needs, and why (one line)."""

    mode: Mode
    needs: dict[Mode, int]
    memory_budget: int
    reason: str
    sizes: FSDPSizes | None = None  # what the choice was made from (``planner_options``)

    @property
    def reduce(self) -> Literal["every-pass", "once"] | None:
        """The sharded runner's ``reduce=`` (None for gather-once)."""
        if self.mode == "gather-once":
            return None
        return "once" if self.mode == "sharded-once" else "every-pass"

    def runner(self, model: nn.Module):  # noqa: ANN201 - FSDPRunner | ShardedFSDPRunner
        """The runner of this mode on ``model``."""
        if self.reduce is None:
            from dyncp.integrations.fsdp import FSDPRunner

            return FSDPRunner(model)
        from dyncp.integrations.fsdp_sharded import ShardedFSDPRunner

        return ShardedFSDPRunner(model, reduce=self.reduce)

    def planner_options(
        self,
        profile: Profile,
        *,
        ranks_per_node: int,
        world: int | None = None,
        unit_compute: tuple[float, ...] = (),
    ) -> dict[str, object]:
        """The ``PlannerConfig`` fields that make the planner price this mode.

        Gather-once runs a plan dataflow, with no collective in its passes:
        ``{"passes": "free", "sharding": None}`` (the default planner). Full sharding runs
        lockstep passes whose collectives span every rank: ``{"passes": "aligned",
        "sharding": ShardingCost.for_model(...)}`` with the model's own unit sizes, its gather
        and reduce dtypes, this mode's ``reduce`` and the collectives over ``world`` ranks
        (default: the FSDP mesh's) from ``profile``. Use as
        ``Planner(model, world=..., ranks_per_node=..., capacity=..., **options)``.

        Raises:
            ValueError: full sharding, but the sizes carry no ``unit_params`` (give
                ``choose_fsdp_mode`` the model, or ``FSDPSizes`` with them).
        """
        if self.reduce is None:
            return {"passes": "free", "sharding": None}
        sizes = self.sizes
        if sizes is None or not sizes.unit_params:
            raise ValueError(
                "planner_options needs each FSDP unit's parameters: choose the mode from the "
                "fully_shard model (choose_fsdp_mode(model, ...)) or from FSDPSizes with "
                "unit_params"
            )
        sharding = ShardingCost.for_model(
            sizes.unit_params,
            param_dtype=sizes.compute_bytes,
            reduce_dtype=sizes.reduce_bytes,
            profile=profile,
            world=sizes.world if world is None else world,
            ranks_per_node=ranks_per_node,
            unit_compute=unit_compute,
            reduce=self.reduce,
        )
        return {"passes": "aligned", "sharding": sharding}


def choose_fsdp_mode(
    model: nn.Module | FSDPSizes,
    *,
    memory_budget: int,
    activation_bytes: int = 0,
    optimizer_bytes: float | None = None,
) -> FSDPModeChoice:
    """The fastest FSDP2 mode whose per-rank bytes fit ``memory_budget`` (see the module).

    Args:
        model: an FSDP2 root, or its :class:`FSDPSizes`.
        memory_budget: bytes a rank may hold (tensors only: leave the CUDA context, the
            allocator's fragmentation and kernels' workspaces out).
        activation_bytes: the activations' peak per rank (measured), the same in every mode.
        optimizer_bytes: per trainable parameter (default: AdamW, 2 x master bytes).

    Raises:
        ValueError: no mode fits (naming what each needs), or bad arguments.
    """
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget}")
    if isinstance(model, FSDPSizes):
        if optimizer_bytes is not None:
            raise ValueError("optimizer_bytes is part of FSDPSizes; pass it there")
        sizes = model
    else:
        sizes = FSDPSizes.of(model, optimizer_bytes=optimizer_bytes)
    needs = mode_bytes(sizes, activation_bytes=activation_bytes)
    listed = ", ".join(f"{mode} {_mib(b)}" for mode, b in needs.items())
    for mode in MODES:
        if needs[mode] <= memory_budget:
            faster = MODES[: MODES.index(mode)]
            why = (
                f"{mode} needs {_mib(needs[mode])} per rank <= budget {_mib(memory_budget)}"
                + (
                    f" ({', '.join(f'{m} needs {_mib(needs[m])}' for m in faster)}: over)"
                    if faster
                    else ""
                )
                + f"; {_SPEED[mode]}"
            )
            return FSDPModeChoice(
                mode=mode, needs=needs, memory_budget=memory_budget, reason=why, sizes=sizes
            )
    raise ValueError(
        f"no FSDP2 mode fits the budget of {_mib(memory_budget)} per rank ({listed}); shrink the "
        f"model per rank first (tensor or pipeline parallel) or lower the activations"
    )


_SPEED = {
    "gather-once": "fastest: one all-gather and one reduce-scatter per unit per step",
    "sharded-once": "FSDP2's all-gathers every pass, one reduce-scatter per unit per step",
    "sharded-every-pass": "FSDP2's all-gathers and reduce-scatters every pass (sharded grads)",
}


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _mib(b: float) -> str:
    """Bytes in words: GiB or MiB with decimals, plain bytes below a MiB."""
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{int(b):,} B"
