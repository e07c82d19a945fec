"""Hybrid head x context parallelism: an all-to-all over u ranks around a ring of r ranks.

A group of c = u * r ranks keeps the plan's token layout (the zigzag at c: rank p of the group
holds chunks p and 2c-1-p of every sequence, padded to a multiple of 2c) and splits its attention
in two. Position p = i*u + j has ring index i and head index j::

    c = 4, u = 2, r = 2            head sub-group i: positions [i*u, (i+1)*u)   (all-to-all)
        positions 0 1 | 2 3        ring sub-group j: positions {i*u + j}        (ring, stride u)
        ring i:    0   |  1
        c-chunks held by head sub-group 0: 0 1 6 7 = ring chunks 0 and 3 at r = 2
                     ... sub-group 1:      2 3 4 5 = ring chunks 1 and 2

The union of the shards of head sub-group i is exactly the zigzag shard of ring position i in a
ring of r ranks whose chunks are u c-chunks long (ring chunk i = c-chunks [i*u, (i+1)*u), ring
chunk 2r-1-i = c-chunks [2c-(i+1)*u, 2c-i*u)). So one all-to-all over the head sub-group that
scatters heads and gathers tokens, followed by a reordering of the gathered rows, leaves rank
(i, j) with ring position i's shard for heads slice j; ordinary zigzag ring attention over ring
sub-group j (r ranks, sequences padded to 2c, ``RingLayout.pad_multiple``) computes it, and the
reverse all-to-all brings the output back. With r = 1 the ring is a single rank holding whole
(padded) sequences: all-to-all only. u = 1 is the plain ring and never builds a HybridLayout.

Heads: rank j of a head sub-group gets query heads [j*H/u, (j+1)*H/u). KV heads are split the
same way when ``Hkv % u == 0``; when there are fewer KV heads than u (``u % Hkv == 0``) they are
replicated: rank j gets KV head ``j // (u // Hkv)``, the one its query heads use, and the
gradients of the replicas are summed on the way back.

One exchange moves q, k and v together (one fused ``all_to_all_single``); the forward's reverse
is its backward and the other way round, so each direction costs one all-to-all per tensor set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dyncp.ring_attention.layout import (
    RingLayout,
    _cumsum,
    _locate,
    make_ring_layout,
    pad_to,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HybridLayout", "heads_to_ring", "hybrid_token_order", "make_hybrid_layout",
           "ring_to_heads"]  # fmt: skip


def hybrid_token_order(*, seqlens: Sequence[int], cp: int, heads: int) -> torch.Tensor:
    """Row of the gathered all-to-all buffer behind each row of the ring shard (int64).

    After the exchange a rank of ring index i holds, from each head-group member j' (in order),
    that member's zigzag shard at ``cp``: row ``j' * T + t`` is local token t of position
    ``i*u + j'``. Row k of the ring shard (ring position i at ``r = cp // heads`` ranks, padded
    to 2*cp) is gathered row ``order[k]``. Every source holds [first chunk | second chunk] of
    each sequence whatever i is, so the order does not depend on i. Pure arithmetic on lengths.
    """
    c, u = cp, heads
    padded = torch.tensor([pad_to(s, 2 * c) for s in seqlens], dtype=torch.int64)
    m = padded // (2 * c)  # c-chunk length per sequence
    local_c = padded // c
    tokens = int(local_c.sum())
    offset_c = torch.cumsum(local_c, 0) - local_c  # sequence start in a source's shard
    # 2u blocks of m rows per sequence: c-chunks i*u + b (first local chunk of source b), then
    # c-chunks 2c-(i+1)u + b = 2c-1-(i*u + u-1-b) (second local chunk of source u-1-b).
    b = torch.arange(2 * u)
    source = torch.where(b < u, b, 2 * u - 1 - b)
    second = (b >= u).to(torch.int64)
    block_start = source[None, :] * tokens + offset_c[:, None] + second[None, :] * m[:, None]
    block_len = m[:, None].expand(-1, 2 * u)
    starts, lens = block_start.reshape(-1), block_len.reshape(-1)
    first_row = torch.cumsum(lens, 0) - lens
    return torch.repeat_interleave(starts - first_row, lens) + torch.arange(int(lens.sum()))


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """One micro-batch of a hybrid group on one rank (see the module docstring).

    Prefer :func:`make_hybrid_layout`. Attributes:
        cp: the group's size c (the token layout is the zigzag at c).
        heads: head-parallel degree u (>= 2; u = 1 is a plain :class:`RingLayout`).
        rank: this rank's position in the group, ``ring.rank * heads + head_index``.
        head_index: j, this rank's index in its head sub-group (which heads slice it computes).
        head_group: the head sub-group's process group (u ranks).
        head_ranks: its global ranks in order.
        ring: the inner ring over the ring sub-group (r = c / u ranks, sequences padded to 2c).
        seqlens: original lengths of the packed sequences.
        cu_seqlens_local: cumulative local lengths at c (``padded / c`` per sequence).
        to_ring: ``hybrid_token_order`` (gathered row of each ring row); ``from_ring`` its
            inverse.

    Raises:
        ValueError: fields inconsistent with each other (names the field).
    """

    cp: int
    heads: int
    rank: int
    head_index: int
    head_group: ProcessGroup
    head_ranks: tuple[int, ...]
    ring: RingLayout
    seqlens: tuple[int, ...]
    cu_seqlens_local: tuple[int, ...]
    to_ring: torch.Tensor = field(compare=False, repr=False)
    from_ring: torch.Tensor = field(compare=False, repr=False)
    _moved: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        u, c = self.heads, self.cp
        if not isinstance(u, int) or u < 2 or not isinstance(c, int) or c % u:
            raise ValueError(
                f"HybridLayout.heads must be an integer >= 2 dividing cp={c}, got {u!r} "
                "(heads == 1 is the plain ring: make_ring_layout)"
            )
        r = c // u
        if self.ring.cp != r or self.ring.unit != 2 * c:
            raise ValueError(
                f"HybridLayout.ring must be a ring of cp // heads = {r} ranks padding to "
                f"2 * cp = {2 * c}, got cp={self.ring.cp} padding to {self.ring.unit}"
            )
        if not 0 <= self.head_index < u or self.rank != self.ring.rank * u + self.head_index:
            raise ValueError(
                f"HybridLayout.rank={self.rank} must be ring.rank * heads + head_index = "
                f"{self.ring.rank} * {u} + {self.head_index} with head_index in [0, {u})"
            )
        if len(self.head_ranks) != u or len(set(self.head_ranks)) != u:
            raise ValueError(
                f"HybridLayout.head_ranks must list heads={u} distinct ranks, got {self.head_ranks}"
            )
        if tuple(self.seqlens) != self.ring.seqlens:
            raise ValueError(
                f"HybridLayout.seqlens={self.seqlens} differ from its ring's {self.ring.seqlens}"
            )
        local = _cumsum(pad_to(s, 2 * c) // c for s in self.seqlens)
        if tuple(self.cu_seqlens_local) != local:
            raise ValueError(
                f"HybridLayout.cu_seqlens_local={self.cu_seqlens_local} does not match "
                f"seqlens={self.seqlens} at cp={c}: expected {local}"
            )
        rows = u * local[-1]
        if self.to_ring.shape != (rows,) or self.from_ring.shape != (rows,):
            raise ValueError(
                f"HybridLayout.to_ring / from_ring must hold heads * local_tokens = {rows} rows, "
                f"got {tuple(self.to_ring.shape)} and {tuple(self.from_ring.shape)}"
            )

    @property
    def local_tokens(self) -> int:
        """Rows of the local q/k/v tensors (the zigzag shard at cp, padding included)."""
        return self.cu_seqlens_local[-1]

    def orders(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(to_ring, from_ring)`` on ``device``, copied there once per layout."""
        if self.to_ring.device == device:
            return self.to_ring, self.from_ring
        if device not in self._moved:
            self._moved[device] = (self.to_ring.to(device), self.from_ring.to(device))
        return self._moved[device]

    @property
    def ring_cp(self) -> int:
        return self.ring.cp

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)


def make_hybrid_layout(
    *,
    seqlens: Sequence[int],
    cp: int,
    heads: int,
    head_group: ProcessGroup,
    ring_group: ProcessGroup | None,
    rank: int | None = None,
    device: torch.device | str = "cpu",
) -> HybridLayout:
    """Build the layout of one micro-batch of a hybrid group (u = ``heads``, r = cp / u).

    Args:
        seqlens: original length of each packed sequence, in packing order.
        cp: the group's size c.
        heads: u >= 2, dividing ``cp``.
        head_group: this rank's head sub-group (u ranks, position order).
        ring_group: this rank's ring sub-group (r ranks, ring order); ``None`` when r == 1.
        rank: this process's global rank (default ``torch.distributed.get_rank()``).
        device: where the token permutations live (the device of q/k/v).

    Raises:
        ValueError: bad cp or heads, groups of the wrong size or without this rank.
    """
    seqlens = tuple(int(s) for s in seqlens)
    for name, value in (("cp", cp), ("heads", heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if heads < 2 or cp % heads:
        raise ValueError(
            f"heads must be >= 2 and divide cp={cp}, got {heads} (heads == 1: make_ring_layout)"
        )
    if not seqlens or min(seqlens) < 1:
        raise ValueError(f"seqlens must be a non-empty list of lengths >= 1, got {seqlens}")
    if rank is None:
        rank = dist.get_rank()
    head_ranks, head_index = _locate(group=head_group, cp=heads, rank=rank)
    r = cp // heads
    if r == 1 and ring_group is not None:
        raise ValueError(f"heads == cp == {cp} is all-to-all only: pass ring_group=None")
    ring = make_ring_layout(seqlens=seqlens, cp=r, group=ring_group, rank=rank, pad_multiple=2 * cp)
    to_ring = hybrid_token_order(seqlens=seqlens, cp=cp, heads=heads)
    from_ring = torch.empty_like(to_ring)
    from_ring[to_ring] = torch.arange(to_ring.numel())
    return HybridLayout(
        cp=cp,
        heads=heads,
        rank=ring.rank * heads + head_index,
        head_index=head_index,
        head_group=head_group,
        head_ranks=head_ranks,
        ring=ring,
        seqlens=seqlens,
        cu_seqlens_local=_cumsum(pad_to(s, 2 * cp) // cp for s in seqlens),
        to_ring=to_ring.to(device),
        from_ring=from_ring.to(device),
    )


# ---------------------------------------------------------------------------- the head exchange


def _all_to_all(send: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``(u, ...)`` to ``(u, ...)``: block j goes to rank j of the group; block j of the result
    came from rank j. Its own inverse, so the backward of an exchange is the same call."""
    send = send.contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def _kv_index(kv_heads: int, heads: int, device: torch.device) -> torch.Tensor | None:
    """KV head sent to each head rank when KV heads are fewer than u (replicas), else None."""
    if kv_heads % heads == 0:
        return None
    return torch.arange(heads, device=device) // (heads // kv_heads)


def _split_heads(x: torch.Tensor, heads: int, index: torch.Tensor | None) -> torch.Tensor:
    """``(T, H, D)`` to ``(u, T, H/u * D)``: block j holds heads slice j (replica ``index[j]``)."""
    if index is not None:
        x = x.index_select(1, index)
    tokens, h, d = x.shape
    return x.reshape(tokens, heads, h // heads * d).transpose(0, 1)


def _merge_heads(
    y: torch.Tensor, *, heads: int, dim: int, index: torch.Tensor | None
) -> torch.Tensor:
    """Inverse of :func:`_split_heads`; replicas of one KV head are summed (their gradients)."""
    u, tokens, width = y.shape
    x = y.transpose(0, 1).reshape(tokens, u * width // dim, dim)
    if index is None:
        return x
    return x.new_zeros((tokens, heads, dim)).index_add_(1, index, x)


class _HeadsToRing(torch.autograd.Function):
    """Forward: scatter heads, gather tokens (one all-to-all for q, k, v), reorder to the ring
    shard. Backward: the reverse, summing the gradients of replicated KV heads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: HybridLayout,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, tokens = layout.heads, q.shape[0]
        index = _kv_index(k.shape[1], u, q.device)
        parts = [_split_heads(q, u, None), _split_heads(k, u, index), _split_heads(v, u, index)]
        widths = [p.shape[2] for p in parts]
        received = _all_to_all(torch.cat(parts, dim=2), layout.head_group)
        rows = received.view(u * tokens, sum(widths)).index_select(0, layout.orders(q.device)[0])
        kv_local = max(k.shape[1] // u, 1)
        heads = (q.shape[1] // u, kv_local, kv_local)
        dims = (q.shape[2], k.shape[2], v.shape[2])
        ctx.exchange = (layout, index, widths, (q.shape[1], k.shape[1], v.shape[1]), dims)
        return tuple(
            part.reshape(u * tokens, h, d).contiguous()
            for part, h, d in zip(rows.split(widths, dim=1), heads, dims)
        )  # type: ignore[return-value]

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        layout, index, widths, all_heads, dims = ctx.exchange
        u = layout.heads
        some = next(g for g in grads if g is not None)
        rows = some.shape[0]
        flat = [
            g.reshape(rows, w) if g is not None else some.new_zeros((rows, w))
            for g, w in zip(grads, widths)
        ]
        send = torch.cat(flat, dim=1).index_select(0, layout.orders(some.device)[1])
        received = _all_to_all(send.view(u, rows // u, sum(widths)), layout.head_group)
        parts = received.split(widths, dim=2)
        dq = _merge_heads(parts[0], heads=all_heads[0], dim=dims[0], index=None)
        dk = _merge_heads(parts[1], heads=all_heads[1], dim=dims[1], index=index)
        dv = _merge_heads(parts[2], heads=all_heads[2], dim=dims[2], index=index)
        return dq, dk, dv, None


class _RingToHeads(torch.autograd.Function):
    """Forward: the ring's output back to this rank's tokens with all heads (the reverse
    exchange). Backward: the output gradient the way q came (scatter heads, gather tokens)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, out: torch.Tensor, layout: HybridLayout
    ) -> torch.Tensor:
        u, rows, heads, dim = layout.heads, *out.shape
        send = out.reshape(rows, heads * dim).index_select(0, layout.orders(out.device)[1])
        received = _all_to_all(send.view(u, rows // u, heads * dim), layout.head_group)
        ctx.exchange = layout
        return _merge_heads(received, heads=u * heads, dim=dim, index=None).contiguous()

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        layout = ctx.exchange
        u, tokens, heads, dim = layout.heads, *dout.shape
        received = _all_to_all(_split_heads(dout, u, None), layout.head_group)
        rows = received.view(u * tokens, heads // u * dim)
        rows = rows.index_select(0, layout.orders(dout.device)[0])
        return rows.view(u * tokens, heads // u, dim), None


def heads_to_ring(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: HybridLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ring shard (u times the tokens) of its heads slice of q, k and v.

    Inputs are the local zigzag shards at ``layout.cp`` with all heads (checked by the caller:
    ``ring_attention``). Differentiable; collective over the head sub-group.
    """
    return _HeadsToRing.apply(q, k, v, layout)


def ring_to_heads(out: torch.Tensor, layout: HybridLayout) -> torch.Tensor:
    """Inverse of :func:`heads_to_ring` for the attention output. Differentiable; collective."""
    return _RingToHeads.apply(out, layout)
