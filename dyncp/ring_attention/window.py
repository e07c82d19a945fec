"""Sliding-window causal ring attention: ring steps outside the window are skipped.

Query at position ``i`` of a sequence sees keys ``j`` with ``i - window < j <= i`` (``window``
keys including itself, as in Mistral/gpt-oss sliding layers). In the zigzag layout (chunks ``r``
and ``2c-1-r`` on rank ``r``, chunk size ``m``) query chunk ``a`` sees key chunk ``b`` only if
``b == a`` or ``b < a`` and ``(a - b - 1) * m + 1 < window``. Whether rank ``r`` needs the K/V of
rank ``s`` therefore follows from the lengths alone, so every rank derives the same
:class:`WindowPlan` without talking to the others:

* **compute**: a step whose K/V block holds no key inside the window of any local query is not
  run at all;
* **transfer**: K/V travel ``forward_hops`` steps forward along the ring and ``backward_hops``
  steps backward, the fewest that reach every needed block. A small window needs only the two
  neighbours (chunk ``2c-1-r`` borders chunk ``2c-2-r`` of rank ``r+1``, chunk ``r`` borders chunk
  ``r-1`` of rank ``r-1``): two transfers instead of ``cp - 1``. When the window covers most of a
  sequence the plan degenerates to the full forward ring.

Backward: the received blocks are kept from the forward pass (there are few of them when the
window is small) and each rank's partial dK/dV for a block travels back along the chain it came
by, gathering the other ranks' partials on the way, so it reaches the block's owner after as many
hops as the block made.

The block computation masks by token positions in the accumulation dtype (float64 for float64),
like the math kernel, so it is exact and is the reference for faster windowed kernels; it is
meant for CPUs, tests and moderate blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dyncp.plan import padded_length
from dyncp.ring_attention.autocast import autocast_off
from dyncp.ring_attention.block import acc_dtype
from dyncp.ring_attention.layout import RingLayout
from dyncp.ring_attention.merge import merge_block
from dyncp.ring_attention.sharding import zigzag_positions

__all__ = ["WindowPlan", "window_plan", "windowed_ring_attention"]

_FWD_KV, _BWD_KV, _FWD_DKV, _BWD_DKV = (21, 22), (23, 24), (25, 26), (27, 28)


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """Which ring steps a windowed micro-batch needs, the same on every rank.

    Attributes:
        needed: ``(rank, source)`` pairs whose step has at least one key inside the window.
        forward_hops: how far K/V travel forward (rank ``r`` gets the blocks of ``r-1 .. r-f``).
        backward_hops: how far they travel backward (rank ``r`` gets ``r+1 .. r+b``).
    """

    cp: int
    needed: frozenset[tuple[int, int]]
    forward_hops: int
    backward_hops: int

    @property
    def transfers(self) -> int:
        """K/V transfers per rank in the forward pass (the plain ring makes ``cp - 1``)."""
        return self.forward_hops + self.backward_hops

    @property
    def skipped_steps(self) -> int:
        """Block computations skipped over the whole ring (of ``cp * cp``)."""
        return self.cp * self.cp - len(self.needed)


def _chunks_visible(qa: int, kb: int, *, length: int, m: int, window: int) -> bool:
    """Whether any real query of chunk ``qa`` sees a real key of chunk ``kb`` (causal, window)."""
    if qa * m >= length or kb * m >= length or kb > qa:
        return False
    return kb == qa or (qa - kb - 1) * m + 1 < window


def _rank_chunks(r: int, cp: int) -> tuple[int, ...]:
    return (0,) if cp == 1 else (r, 2 * cp - 1 - r)


def _pair_needed(r: int, s: int, *, seqlens: Sequence[int], cp: int, window: int) -> bool:
    for length in seqlens:
        m = padded_length(length, cp) // (2 * cp) if cp > 1 else length
        for qa in _rank_chunks(r, cp):
            for kb in _rank_chunks(s, cp):
                if _chunks_visible(qa, kb, length=length, m=m, window=window):
                    return True
    return False


def window_plan(*, seqlens: Sequence[int], cp: int, window: int) -> WindowPlan:
    """The steps and transfers a causal window of ``window`` keys needs at CP size ``cp``.

    Raises:
        ValueError: a window below 1, a bad cp or empty lengths.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (keys seen per query), got {window!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an integer >= 1, got {cp!r}")
    if not seqlens or min(seqlens) < 1:
        raise ValueError(f"seqlens must be a non-empty list of lengths >= 1, got {seqlens}")
    needed = frozenset(
        (r, s)
        for r in range(cp)
        for s in range(cp)
        if _pair_needed(r, s, seqlens=seqlens, cp=cp, window=window)
    )
    distances = {(r - s) % cp for r, s in needed if r != s}
    best = (cp, 0)
    for f in range(cp):
        b = max((cp - d for d in distances if d > f), default=0)
        if f + b < sum(best):
            best = (f, b)
    return WindowPlan(cp=cp, needed=needed, forward_hops=best[0], backward_hops=best[1])


def windowed_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RingLayout,
    *,
    window: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Causal sliding-window attention of this rank's zigzag shards (see the module docstring).

    Inputs are checked by ``ring_attention``, which calls this for ``window=...``.
    """
    plan = window_plan(seqlens=layout.seqlens, cp=layout.cp, window=window)
    return _WindowedRing.apply(q, k, v, layout, plan, window, softmax_scale)


# ------------------------------------------------------------------------------ one block


@dataclass(frozen=True, slots=True)
class _Pair:
    """One sequence of one step: local query rows, K/V block rows and the visibility mask."""

    q_rows: torch.Tensor
    k_rows: torch.Tensor
    mask: torch.Tensor  # (nq, nk) bool


def _pairs(layout: RingLayout, source: int, *, window: int, device: torch.device) -> list[_Pair]:
    """The sequences of the step with ``source``'s K/V block whose masks are not all empty."""
    cp, r = layout.cp, layout.rank
    q_pos = zigzag_positions(seqlens=layout.seqlens, cp=cp, rank=r)
    k_pos = zigzag_positions(seqlens=layout.seqlens, cp=cp, rank=source)
    out = []
    for i, length in enumerate(layout.seqlens):
        if not _pair_needed(r, source, seqlens=[length], cp=cp, window=window):
            continue
        lo, hi = layout.cu_seqlens_local[i], layout.cu_seqlens_local[i + 1]
        rows = torch.arange(lo, hi)
        qp, kp = q_pos[lo:hi], k_pos[lo:hi]
        q_rows, k_rows = rows[qp < length], rows[kp < length]
        qp, kp = qp[qp < length], kp[kp < length]
        diff = qp[:, None] - kp[None, :]
        mask = (diff >= 0) & (diff < window)
        out.append(_Pair(q_rows.to(device), k_rows.to(device), mask.to(device)))
    return out


def _scores(
    q: torch.Tensor, k: torch.Tensor, pair: _Pair, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query scores ``(H, nq, nk)`` masked to -inf, and the expanded keys."""
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    qb = q.index_select(0, pair.q_rows).to(acc)
    kb = k.index_select(0, pair.k_rows).to(acc).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
    return s.masked_fill(~pair.mask, -math.inf), kb


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: list[_Pair], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=acc, device=q.device)
    for pair in pairs:
        s, _ = _scores(q, k, pair, scale)
        lse_b = torch.logsumexp(s, dim=-1)  # (H, nq)
        p = torch.exp(s - lse_b.masked_fill(torch.isinf(lse_b), 0.0)[..., None])
        vb = v.index_select(0, pair.k_rows).to(acc).repeat_interleave(group, dim=1)
        out.index_copy_(0, pair.q_rows, torch.einsum("hqk,khd->qhd", p, vb))
        lse.index_copy_(0, pair.q_rows, lse_b.t())
    return out, lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pairs: list[_Pair],
    scale: float,
    dq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds this block's dQ into ``dq``; returns its dK, dV (accumulation dtype)."""
    acc = acc_dtype(q.dtype)
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for pair in pairs:
        s, kb = _scores(q, k, pair, scale)
        lse_q = lse.index_select(0, pair.q_rows).t()  # final lse: finite on every real query
        p = torch.exp(s - lse_q[..., None])
        vb = v.index_select(0, pair.k_rows).to(acc).repeat_interleave(group, dim=1)
        do = dout.index_select(0, pair.q_rows).to(acc)
        o = out.index_select(0, pair.q_rows).to(acc)
        qb = q.index_select(0, pair.q_rows).to(acc)
        dp = torch.einsum("qhd,khd->hqk", do, vb)
        ds = p * (dp - (do * o).sum(-1).t()[..., None])
        nk = pair.k_rows.numel()
        dv_b = torch.einsum("hqk,qhd->khd", p, do).reshape(nk, hkv, group, -1).sum(2)
        dk_b = torch.einsum("hqk,qhd->khd", ds, qb).reshape(nk, hkv, group, -1).sum(2) * scale
        dq.index_add_(0, pair.q_rows, torch.einsum("hqk,khd->qhd", ds, kb) * scale)
        dk.index_add_(0, pair.k_rows, dk_b)
        dv.index_add_(0, pair.k_rows, dv_b)
    return dk, dv


# ------------------------------------------------------------------------------ the chains


def _shift(
    tensors: list[torch.Tensor], layout: RingLayout, *, forward: bool, tags: tuple[int, int]
) -> list[torch.Tensor]:
    """Send to the next rank and receive from the previous one (or the reverse); wait."""
    to, frm = (
        (layout.next_rank, layout.prev_rank) if forward else (layout.prev_rank, layout.next_rank)
    )
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), to, layout.group, tag)
           for t, tag in zip(tensors, tags)]  # fmt: skip
    ops += [dist.P2POp(dist.irecv, t, frm, layout.group, tag) for t, tag in zip(received, tags)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def _chain_sources(layout: RingLayout, plan: WindowPlan) -> list[tuple[int, bool, int]]:
    """(hop, forward, source) of every block this rank receives, in arrival order per chain."""
    r, c = layout.rank, layout.cp
    fwd = [(h, True, (r - h) % c) for h in range(1, plan.forward_hops + 1)]
    bwd = [(h, False, (r + h) % c) for h in range(1, plan.backward_hops + 1)]
    return fwd + bwd


class _WindowedRing(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RingLayout,
        plan: WindowPlan,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        blocks: dict[tuple[int, bool], list[torch.Tensor]] = {(0, True): [k, v]}
        for forward, hops, tags in ((True, plan.forward_hops, _FWD_KV),
                                    (False, plan.backward_hops, _BWD_KV)):  # fmt: skip
            kv = [k, v]
            for h in range(1, hops + 1):
                kv = _shift(kv, layout, forward=forward, tags=tags)
                blocks[(h, forward)] = kv
        steps = [(0, True, layout.rank), *_chain_sources(layout, plan)]
        acc = acc_dtype(q.dtype)
        out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=acc, device=q.device)
        pairs = {}
        for hop, forward, source in steps:
            if (layout.rank, source) not in plan.needed:
                continue
            pairs[(hop, forward)] = _pairs(layout, source, window=window, device=q.device)
            kb, vb = blocks[(hop, forward)]
            block_out, block_lse = _block_forward(q, kb, vb, pairs[(hop, forward)], scale)
            out, lse = merge_block(out, lse, block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse)
        ctx.window_ring = (layout, plan, blocks, pairs, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, out, lse = ctx.saved_tensors
        with autocast_off(q.device):  # a backward inside an autocast region: as the forward
            return _WindowedRing._backward(ctx, dout, q, out, lse)

    @staticmethod
    def _backward(
        ctx: torch.autograd.function.FunctionCtx,
        dout: torch.Tensor,
        q: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        layout, plan, blocks, pairs, scale = ctx.window_ring
        acc = acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k, v = blocks[(0, True)]

        def partial(hop: int, forward: bool) -> list[torch.Tensor]:
            kb, vb = blocks[(hop, forward)]
            if (hop, forward) not in pairs:
                return [torch.zeros(kb.shape, dtype=acc, device=kb.device),
                        torch.zeros(vb.shape, dtype=acc, device=vb.device)]  # fmt: skip
            return list(_block_backward(
                dout, q, kb, vb, out, lse, pairs[(hop, forward)], scale, dq
            ))  # fmt: skip

        dk, dv = partial(0, True)
        for forward, hops, tags in ((True, plan.forward_hops, _FWD_DKV),
                                    (False, plan.backward_hops, _BWD_DKV)):  # fmt: skip
            if hops == 0:
                continue
            # The partial for the farthest block walks back towards its owner, collecting.
            travelling = partial(hops, forward)
            for h in range(hops - 1, 0, -1):
                travelling = _shift(travelling, layout, forward=not forward, tags=tags)
                for mine, add in zip(travelling, partial(h, forward)):
                    mine.add_(add)
            travelling = _shift(travelling, layout, forward=not forward, tags=tags)
            dk.add_(travelling[0])
            dv.add_(travelling[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
