"""Where each FSDP2 parameter's gradient goes in its unit's one reduce-scatter, 1-D or 2-D mesh.

The gather-once runner (:mod:`dyncp.integrations.fsdp`) reduces each ``fully_shard`` unit's
gradients with one collective, so it lays every trainable parameter out in a flat buffer as
FSDP2 shards it. FSDP2 always shards the same tensor the same way: the parameter's *model-local*
tensor (the whole parameter; under tensor parallelism the TP rank's shard) is cut along dim 0
into ``ceil(rows / W)``-row chunks over the W ranks of the FSDP shard mesh dim. The mesh the
sharded DTensor lives on only adds dims around that: a leading ``Replicate()`` dim for HSDP
(``fully_shard(mesh=2-D mesh)``: replicate x shard, gradients summed over it too), and trailing
model-parallel dims for FSDP2 + TP (``DeviceMesh._concatenate([dp_mesh, tp_mesh])``: the
model-local tensor is already local there, and its gradient stays local). This module reads
those dims from the placements (public DTensor API) rather than FSDP2's private state:

- ``(Shard(0),)`` on a 1-D mesh: plain FSDP2;
- ``(Replicate(), Shard(0))``: HSDP, dim 0 replicated, dim 1 sharded;
- ``(Shard(0) | _StridedShard(0), P_tp...)``: FSDP2 + TP (``_StridedShard`` when TP also cuts
  dim 0, the FSDP2 chunk being of the TP-local rows), optionally after an HSDP ``Replicate()``.

Anything else (``Partial``, a ``_StridedShard`` on a model-parallel dim, FSDP2's SPMD
``dp_mesh_dims`` path with model dims before the DP dims) is refused with the placements named.

It also holds the one check of a module being the FSDP2 root, :func:`check_root`.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["Slot", "Unit", "check_root", "own_parameters", "trainable_flags", "units"]


@dataclass(slots=True)
class Slot:
    """One trainable parameter's place in its unit's reduce-scatter buffer.

    The parameter's model-local ``rows`` (dim 0; under TP the TP rank's rows) are split as FSDP2
    shards them, ``chunk`` rows per rank (ceil(rows / W); the last ranks hold fewer, possibly
    none); rank r's chunk, padded to ``chunk`` rows, sits at ``offset`` inside rank r's segment.
    """

    name: str
    sharded: nn.Parameter  # the DTensor parameter the optimizer holds
    rows: int
    row_numel: int
    chunk: int
    offset: int

    @property
    def numel(self) -> int:  # elements of one rank's padded chunk
        return self.chunk * self.row_numel


@dataclass(slots=True)
class Unit:
    """One ``fully_shard`` module: its own trainable parameters (not those of nested units).

    ``group`` is the FSDP shard mesh dim's group (the reduce-scatter), ``replicate`` the HSDP
    replicate dim's (an all-reduce after it; None without HSDP), ``dp_ranks`` every global rank
    of the DP x CP axis this rank's gradients are summed over (shard x replicate dims, at this
    rank's model-parallel coordinate).
    """

    module: FSDPModule
    slots: list[Slot]
    segment: int  # elements of one rank's segment of the buffer
    group: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    dp_ranks: tuple[int, ...]
    device: torch.device


@dataclass(frozen=True, slots=True)
class _Dims:
    """What the placements of one sharded parameter say (see the module docstring)."""

    shard: int  # the FSDP shard mesh dim
    replicate: int | None  # the HSDP replicate mesh dim
    local_shape: tuple[int, ...]  # the model-local tensor's shape (what FSDP2 chunks)
    dp_ranks: tuple[int, ...]


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``module``'s own ``fully_shard`` manages (not those of nested units)."""
    nested = [
        prefix + "."
        for prefix, sub in module.named_modules()
        if sub is not module and isinstance(sub, FSDPModule)
    ]
    return [
        (name, param)
        for name, param in module.named_parameters()
        if not any(name.startswith(p) for p in nested)
    ]


def trainable_flags(model: nn.Module) -> tuple[bool, ...]:
    """``requires_grad`` of every parameter, in order: what :func:`units` was built from."""
    return tuple(p.requires_grad for p in model.parameters())


def units(model: nn.Module) -> list[Unit]:
    """Every FSDP unit under ``model`` (``named_modules`` order) with trainable parameters.

    Raises:
        ValueError: a parameter not sharded the way FSDP2 shards (see the module docstring),
            a unit whose parameters disagree on the DP groups, trainable parameters outside every
            ``fully_shard`` module, or no trainable parameter at all.
    """
    found, seen = [], set()
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        slots, offset, first = [], 0, None
        for name, param in own_parameters(module):
            seen.add(id(param))
            if not param.requires_grad:
                continue
            where = f"{path}.{name}" if path else name
            dims = _dims(where, param)
            mesh = param.device_mesh
            groups = (
                mesh.get_group(dims.shard),
                None if dims.replicate is None else mesh.get_group(dims.replicate),
            )
            key = (
                _ranks(groups[0]),
                None if groups[1] is None else _ranks(groups[1]),
                dims.dp_ranks,
            )
            if first is None:
                first = (groups, key, where)
            elif key != first[1]:
                raise ValueError(
                    f"parameters {first[2]!r} and {where!r} of one fully_shard unit are sharded "
                    f"over different DP groups ({first[1]} vs {key}); one unit needs one mesh"
                )
            rows = dims.local_shape[0]
            world, me = groups[0].size(), groups[0].rank()
            chunk = -(-rows // world)
            slot = Slot(name, param, rows, math.prod(dims.local_shape[1:]), chunk, offset)
            expected = (min(max(rows - me * chunk, 0), chunk), *dims.local_shape[1:])
            if tuple(param.to_local().shape) != expected:
                raise ValueError(
                    f"parameter {where!r}: local shard has shape {tuple(param.to_local().shape)}, "
                    f"FSDP2's even dim-0 split of the model-local shape {dims.local_shape} over "
                    f"{world} ranks gives {expected}; only FSDP2's default sharding is supported"
                )
            slots.append(slot)
            offset += slot.numel
        if slots:
            (group, replicate), key, _ = first
            device = slots[0].sharded.to_local().device
            found.append(Unit(module, slots, offset, group, replicate, key[2], device))
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if stray:
        raise ValueError(
            f"trainable parameters outside every fully_shard module: {stray[:5]}; shard the root "
            f"module too (fully_shard(model)) so each parameter has one owner"
        )
    if not found:
        raise ValueError("the model has no trainable parameter under fully_shard")
    return found


def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _dims(where: str, param: nn.Parameter) -> _Dims:
    """Read the FSDP shard dim, the HSDP replicate dim and the model-local shape of ``param``."""
    if not isinstance(param, DTensor):
        raise ValueError(
            f"parameter {where!r} is not sharded (not a DTensor); call FSDPRunner after "
            f"fully_shard, with the parameters resharded (outside a forward)"
        )
    mesh, placements = param.device_mesh, tuple(param.placements)
    if param.dim() == 0 or param.shape[0] == 0:
        raise ValueError(
            f"parameter {where!r} has shape {tuple(param.shape)}; FSDPRunner needs parameters "
            f"FSDP2 shards along a non-empty dim 0"
        )
    supported = (
        "FSDPRunner supports fully_shard's dim-0 sharding on a 1-D mesh (Shard(0),), HSDP "
        "(Replicate(), Shard(0)), and either followed by tensor-parallel dims (Replicate() or "
        "Shard(d) on the TP mesh)"
    )
    shard = next((i for i, p in enumerate(placements) if _dim0_shard(p)), None)
    lead, tail = placements[: shard or 0], placements[(shard or 0) + 1 :]
    bad = (
        shard is None
        or len(lead) > 1
        or any(not isinstance(p, Replicate) for p in lead)
        or any(type(p) not in (Replicate, Shard) for p in tail)
    )
    if bad:
        raise ValueError(
            f"parameter {where!r} is placed {placements} on a {mesh.ndim}-D mesh; {supported}"
        )
    # The model-local shape: the global one cut by the model-parallel dims, in mesh order.
    shape = list(param.shape)
    for j, p in enumerate(tail, start=shard + 1):
        if isinstance(p, Shard):
            size, n, k = shape[p.dim], mesh.size(j), mesh.get_local_rank(j)
            step = -(-size // n)
            shape[p.dim] = min(max(size - k * step, 0), step)
    tp_rows = math.prod(mesh.size(j) for j, p in enumerate(tail, shard + 1) if p == Shard(0))
    split = getattr(placements[shard], "split_factor", 1)
    if split != tp_rows:
        raise ValueError(
            f"parameter {where!r} is placed {placements}: the FSDP dim splits dim 0 with factor "
            f"{split} but the tensor-parallel dims cut it {tp_rows} ways; {supported}"
        )
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if j <= shard else coord[j] for j in range(mesh.ndim))
    dp_ranks = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
    return _Dims(shard, 0 if shard == 1 else None, tuple(shape), dp_ranks)


def _dim0_shard(p: object) -> bool:
    return isinstance(p, (Shard, _StridedShard)) and p.dim == 0


def check_root(model: FSDPModule) -> None:
    """Raise unless ``model`` is the FSDP2 root: no ``fully_shard`` module holds it.

    FSDP2 marks the root only at the first forward (its lazy initialisation sets each state's
    ``_is_root``); once set, that flag decides. Before it, nothing in FSDP2 links a unit to the
    module above it, and a module keeps no link to its parent: the parents are found as the
    modules whose ``_modules`` dict holds it, through the garbage collector's referrers (a
    scan of the heap, once per level up, at construction only).

    Raises:
        ValueError: ``model`` is a unit inside another ``fully_shard`` module.
    """
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    flag = getattr(state, "_is_root", None)
    if flag is True:
        return
    holder = "an outer fully_shard module (FSDP2 ran it as a non-root unit)"
    if flag is None:
        frontier, seen = [model], {id(model)}
        holder = None
        while frontier and holder is None:
            parents = [p for p in _parents(frontier) if id(p) not in seen]
            seen.update(id(p) for p in parents)
            holder = next((type(p).__name__ for p in parents if isinstance(p, FSDPModule)), None)
            frontier = parents
        if holder is None:
            return
        holder = f"the fully_shard module {holder}"
    raise ValueError(
        f"FSDPRunner needs the FSDP2 root module; this {type(model).__name__} is a unit inside "
        f"{holder}: pass the outermost module fully_shard was applied to"
    )


def _parents(children: list[nn.Module]) -> list[nn.Module]:
    """The modules whose ``_modules`` dict holds one of ``children``."""
    ids = {id(c) for c in children}
    holders = [
        d
        for d in gc.get_referrers(*children)
        if isinstance(d, dict) and any(id(v) in ids for v in d.values())
    ]
    if not holders:
        return []
    held = {id(h) for h in holders}
    parents, dicts = [], []
    for ref in gc.get_referrers(*holders):
        if isinstance(ref, nn.Module) and id(ref.__dict__.get("_modules")) in held:
            parents.append(ref)
        elif isinstance(ref, dict) and id(ref.get("_modules")) in held:
            dicts.append(ref)  # a module's materialised __dict__
    if dicts:
        own = {id(d) for d in dicts}
        parents += [
            m for m in gc.get_referrers(*dicts) if isinstance(m, nn.Module) and id(vars(m)) in own
        ]
    return parents
