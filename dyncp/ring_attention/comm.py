"""Ring plumbing: send tensors to the next rank and receive the same shapes from the previous one.

Each exchange is one ``batch_isend_irecv`` and returns at once, so the caller computes the current
block while the next one travels. Every kind of tensor has its own tag (K, V, dK, dV), so that a
K/V exchange and a dK/dV exchange in flight at the same time between the same two ranks can never
be matched with each other (gloo matches by peer and tag; NCCL keeps issue order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dyncp.ring_attention.layout import RingLayout

__all__ = ["PendingExchange", "ring_exchange"]


class PendingExchange:
    """An exchange in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, works: list[dist.Work], received: list[torch.Tensor]) -> None:
        self._works = works
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        return self._received


def ring_exchange(
    tensors: Sequence[torch.Tensor], *, layout: RingLayout, tags: Sequence[int]
) -> PendingExchange:
    """Send ``tensors`` to ``layout.next_rank`` and receive like tensors from ``layout.prev_rank``.

    Every rank of the ring must call this with the same shapes, dtypes and tags at the same point.
    """
    assert layout.group is not None and len(tags) == len(tensors)
    received = [torch.empty_like(t) for t in tensors]
    ops = []
    for t, tag in zip(tensors, tags):
        ops.append(dist.P2POp(dist.isend, t.contiguous(), layout.next_rank, layout.group, tag))
    for t, tag in zip(received, tags):
        ops.append(dist.P2POp(dist.irecv, t, layout.prev_rank, layout.group, tag))
    return PendingExchange(dist.batch_isend_irecv(ops), received)
