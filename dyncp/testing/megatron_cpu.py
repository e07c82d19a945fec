"""megatron-core's dynamic-CP data path on gloo CPU ranks: its CUDA stand-ins, for tests only.

The stand-ins are for the few CUDA and parallel_state calls it makes.

megatron-core 0.16.1's ``HybridCPDataLoaderWrapper`` and
``hybrid_context_parallel_forward_backward`` are torch.distributed code that asks for CUDA in a
handful of places (``Tensor.cuda()``, ``torch.cuda.current_device()``, one
``torch.tensor(..., device='cuda')`` in
``hybrid_cp_schedule``) and for five ``parallel_state`` getters that ``initialize_model_parallel``
would set up with NCCL. ``cpu_megatron(tp_group)`` replaces exactly those, for the duration of a
``with`` block, in one process: everything else (the all-gathers, the scheduler call, the
all-to-all re-routing, the per-round barriers, forward_step and backward_step) is the release's
own code. TP is 1 and every rank is a DP rank (DP x CP = the world).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["cpu_megatron", "hybrid_groups", "tp_groups"]


def _cpu_tensor(*args, device=None, **kwargs):
    if device is not None and str(device).startswith("cuda"):
        device = "cpu"
    return torch.tensor(*args, device=device, **kwargs)


def hybrid_groups(rank: int, world: int) -> dict[int, dist.ProcessGroup]:
    """The aligned power-of-two groups megatron-core builds for hybrid CP
    (``parallel_state.create_hybrid_dp_cp_groups``: sizes 2 .. world/2, and the world), as
    ``{size: the group holding rank}``; every rank must call it (group creation is collective)."""
    mine: dict[int, dist.ProcessGroup] = {}
    size = 2
    while size < world:
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine[size] = group
        size *= 2
    mine[world] = dist.group.WORLD
    return mine


def tp_groups(rank: int, world: int) -> dist.ProcessGroup:
    """This rank's tensor-parallel group of one (TP = 1); collective like ``hybrid_groups``."""
    mine = None
    for r in range(world):
        group = dist.new_group([r])
        if r == rank:
            mine = group
    assert mine is not None
    return mine


@contextlib.contextmanager
def cpu_megatron(tp_group: dist.ProcessGroup) -> Iterator[None]:
    """Run megatron-core's hybrid-CP data path on CPU within the block (see the module)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import hybrid_cp_schedule

    proxy = SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.tensor = _cpu_tensor
    rank = dist.get_rank()
    patches = [
        mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self),
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(hybrid_cp_schedule, "torch", proxy),
        mock.patch.object(parallel_state, "get_data_parallel_rank", lambda **k: dist.get_rank()),
        mock.patch.object(parallel_state, "get_data_parallel_group", lambda **k: dist.group.WORLD),
        mock.patch.object(parallel_state, "get_tensor_model_parallel_rank", lambda: 0),
        mock.patch.object(parallel_state, "get_tensor_model_parallel_src_rank", lambda: rank),
        mock.patch.object(parallel_state, "get_tensor_model_parallel_group", lambda **k: tp_group),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield
