"""The diagonal linear recurrence under CP by all-to-all to channel parallelism.

The alternative to passing chunk states (``scan.py``): one all-to-all gives every rank all tokens
of every sequence for ``1 / cp`` of the channels, the rank scans them as one process would, and a
second all-to-all returns its outputs to the zigzag layout. Bytes per rank grow with the tokens
(``2 T / cp`` values in, ``T / cp`` out, per channel slice), not with the number of sequences, so
it wins for packs of many short documents with large states; the state passing wins for a few
long ones. ``dyncp.cost_model.layer_mix`` prices both, and the caller picks per micro-batch.

Each all-to-all is point-to-point sends and receives (gloo has no all-to-all of tensor lists for
subgroups), in a small autograd Function whose backward is the same exchange of the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dyncp.ring_attention.layout import RingLayout, make_ring_layout
from dyncp.ring_attention.sharding import zigzag_shard, zigzag_unshard
from dyncp.ssm.scan import diagonal_scan

__all__ = ["channel_parallel_scan"]


def channel_parallel_scan(a: torch.Tensor, x: torch.Tensor, layout: RingLayout) -> torch.Tensor:
    """``h_t = a_t * h_{t-1} + x_t`` like :func:`diagonal_scan`, exchanged by all-to-all.

    Args:
        a, x: ``(layout.local_tokens, D)`` zigzag shards; ``D`` a multiple of ``layout.cp``.
        layout: the micro-batch's ring layout (a collective over its group when ``cp > 1``).

    Raises:
        ValueError: a channel count that ``cp`` does not divide, or what ``diagonal_scan``
            refuses.
    """
    c = layout.cp
    if c == 1:
        return diagonal_scan(a, x, layout)
    if a.dim() != 2 or a.shape != x.shape or a.shape[0] != layout.local_tokens:
        raise ValueError(
            f"a and x must both be (layout.local_tokens={layout.local_tokens}, channels), got "
            f"{tuple(a.shape)} and {tuple(x.shape)}"
        )
    if a.shape[1] % c:
        raise ValueError(f"channels ({a.shape[1]}) must be a multiple of cp={c}")
    both = torch.stack([a, x], dim=-1)  # (T, D, 2)
    got = _AllToAll.apply(layout, *both.chunk(c, dim=1))
    whole = zigzag_unshard(list(got), seqlens=layout.seqlens)  # (sum seqlens, D / c, 2)
    one = make_ring_layout(seqlens=layout.seqlens, cp=1)
    h = diagonal_scan(whole[..., 0].contiguous(), whole[..., 1].contiguous(), one)
    back = [zigzag_shard(h, seqlens=layout.seqlens, cp=c, rank=r) for r in range(c)]
    mine = _AllToAll.apply(layout, *back)
    return torch.cat(list(mine), dim=1)


def _exchange(parts: list[torch.Tensor], layout: RingLayout) -> list[torch.Tensor]:
    """Send ``parts[j]`` to the group's rank ``j``; receive like shapes from every rank."""
    me = layout.rank
    received = [torch.empty_like(p) for p in parts]
    received[me] = parts[me].clone()
    ops = []
    for j, peer in enumerate(layout.group_ranks):
        if j != me:
            ops.append(dist.P2POp(dist.isend, parts[j].contiguous(), peer, layout.group, 31))
            ops.append(dist.P2POp(dist.irecv, received[j], peer, layout.group, 31))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, layout: RingLayout, *parts: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.layout = layout
        return tuple(_exchange(list(parts), layout))

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return (None, *_exchange([g.contiguous() for g in grads], ctx.layout))
