"""Varlen zigzag ring attention: the autograd Function, its forward and backward rings.

Forward: K/V go once around the ring. At each step the next block is already travelling
(``comm.ring_exchange``) while this rank runs the block kernel on the current one, following the
zigzag schedule of ``steps.py``; partial outputs are merged with the log-sum-exp update of
``merge.py`` in float32 (float64 for float64 inputs).

Backward: K/V go around again, and with them the dK/dV accumulators: at each step a rank adds the
gradient of the block it holds to the accumulator that arrived with it and passes it on, so after
``cp`` hops every accumulator is back with the rank that owns the keys. dQ never leaves the rank.
Gradients come back in the dtype of their inputs; nothing is cast to a fixed dtype. Under
``torch.autocast`` the inputs are cast to the autocast dtype first, as for torch's SDPA
(``autocast.py``).

A :class:`~dyncp.ring_attention.hybrid.HybridLayout` (u > 1 heads ranks around a ring of r) runs
the same Function over the ring sub-group, between the head exchanges of ``hybrid.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dyncp.ring_attention.autocast import autocast_inputs, autocast_off
from dyncp.ring_attention.block import BlockKernel, acc_dtype
from dyncp.ring_attention.comm import PendingExchange, ring_exchange
from dyncp.ring_attention.hybrid import HybridLayout, heads_to_ring, ring_to_heads
from dyncp.ring_attention.kernels import select_kernel
from dyncp.ring_attention.layout import RingLayout
from dyncp.ring_attention.math_kernel import MathKernel
from dyncp.ring_attention.merge import merge_block
from dyncp.ring_attention.steps import RingStep, zigzag_steps
from dyncp.ring_attention.window import windowed_ring_attention

__all__ = ["ring_attention"]

_KV_TAGS = (11, 12)
_DKV_TAGS = (13, 14)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RingLayout | HybridLayout,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | BlockKernel = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Attention of this rank's zigzag shards of a packed micro-batch, over the layout's ring.

    Args:
        q: ``(T, H, D)`` local queries, ``T = layout.local_tokens`` (padding rows included).
        k: ``(T, Hkv, D)`` local keys, ``H % Hkv == 0`` (grouped-query attention).
        v: ``(T, Hkv, Dv)`` local values.
        layout: the micro-batch's :class:`RingLayout` on this rank (``make_ring_layout``), or
            its :class:`HybridLayout` (``make_hybrid_layout``): the same local tokens with all
            heads in and out, the heads exchanged over the head sub-group inside (q's heads
            divisible by u; KV heads divisible by u, or fewer and dividing u: replicated).
        causal: causal attention within each sequence; otherwise full attention.
        softmax_scale: score scale, default ``1 / sqrt(D)``.
        kernel: ``"auto"``, ``"flash"``, ``"sdpa"``, ``"math"`` or a ``BlockKernel``.
        window: causal sliding window (each query sees itself and the ``window - 1`` keys before
            it); ring steps outside the window are skipped (``window.py``). Runs the exact
            position-masked block computation, so ``kernel`` must be ``"auto"`` or ``"math"``.
            Not with a HybridLayout or a ring padded beyond 2 * cp (``pad_multiple``).

    Returns:
        ``(T, H, Dv)`` in the dtype of ``q``. Padding rows are 0; real rows never depend on
        padding rows, and padding rows receive zero gradient.

    Under ``torch.autocast`` (enabled for the inputs' device) q, k and v are first cast to the
    autocast dtype, as torch's ``scaled_dot_product_attention`` is, and the output is in that
    dtype; the ring itself runs with autocast off, accumulating in float32 (``autocast.py``).

    Raises:
        ValueError: mismatched shapes, dtypes or devices (outside autocast), tensors that do
            not match the layout's ``cu_seqlens_local``, a layout whose group does not contain
            this rank, an unusable kernel or a non-positive scale; a window below 1, without
            ``causal``, with another kernel or with a hybrid layout; head counts a hybrid layout
            cannot split.
    """
    q, k, v = autocast_inputs(q, k, v)  # as SDPA under autocast (see autocast.py)
    _check_inputs(q, k, v, layout)
    with autocast_off(q.device):
        return _attention(q, k, v, layout, causal, softmax_scale, kernel, window)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RingLayout | HybridLayout,
    causal: bool,
    softmax_scale: float | None,
    kernel: str | BlockKernel,
    window: int | None,
) -> torch.Tensor:
    """``ring_attention`` after the input checks, with autocast off."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if window is not None:
        if not causal:
            raise ValueError("window=... is a causal sliding window: pass causal=True")
        if not (kernel in ("auto", "math") or isinstance(kernel, MathKernel)):
            raise ValueError(f"window=... runs the exact windowed kernel; kernel must be 'auto' "
                             f"or 'math', got {kernel!r}")  # fmt: skip
        if isinstance(layout, HybridLayout) or layout.pad_multiple is not None:
            raise ValueError(
                "window=... runs on a plain ring (heads == 1, padding to 2 * cp); this layout "
                f"is {_describe(layout)}"
            )
        return windowed_ring_attention(
            q, k, v, layout, window=window, softmax_scale=float(softmax_scale)
        )
    block_kernel = select_kernel(
        kernel, device=q.device, dtype=q.dtype, head_dim=q.shape[-1], v_head_dim=v.shape[-1]
    )
    args = (bool(causal), float(softmax_scale), block_kernel)
    if isinstance(layout, HybridLayout):
        q_ring, k_ring, v_ring = heads_to_ring(q, k, v, layout)
        return ring_to_heads(
            _RingAttention.apply(q_ring, k_ring, v_ring, layout.ring, *args), layout
        )
    return _RingAttention.apply(q, k, v, layout, *args)


def _describe(layout: RingLayout | HybridLayout) -> str:
    if isinstance(layout, HybridLayout):
        return f"hybrid (cp={layout.cp}, heads={layout.heads}, ring={layout.ring.cp})"
    return f"a ring of cp={layout.cp} padding to multiples of {layout.unit}"


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout | HybridLayout
) -> None:
    if not isinstance(layout, (RingLayout, HybridLayout)):
        raise ValueError(
            f"layout must be a RingLayout (make_ring_layout) or a HybridLayout "
            f"(make_hybrid_layout), got {type(layout)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a (tokens, heads, head_dim) tensor, got {shape}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"q, k, v must share dtype and device: q is {q.dtype} on {q.device}, "
                f"{name} is {t.dtype} on {t.device}"
            )
        if t.shape[0] != layout.local_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens but the layout's cu_seqlens_local ends at "
                f"{layout.local_tokens} (seqlens={layout.seqlens}, cp={layout.cp})"
            )
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"k and v need the same number of heads, dividing q's: q {q.shape[1]}, "
            f"k {k.shape[1]}, v {v.shape[1]}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k need the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if isinstance(layout, HybridLayout):
        _check_hybrid(q.shape[1], k.shape[1], layout)
    elif layout.cp > 1:
        _check_group(layout)


def _check_hybrid(heads: int, kv_heads: int, layout: HybridLayout) -> None:
    u = layout.heads
    if heads % u or (kv_heads % u and u % kv_heads):
        raise ValueError(
            f"a hybrid layout with heads={u} needs query heads divisible by {u} and KV heads "
            f"divisible by {u} or dividing it (replicated); got {heads} query and {kv_heads} "
            "KV heads"
        )
    if not dist.is_initialized():
        raise ValueError(f"heads={u} needs an initialised torch.distributed")
    me = dist.get_rank()
    if layout.head_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"the layout's head group does not contain this rank ({me})")
    size = dist.get_world_size(layout.head_group)
    if size != u or layout.head_ranks[layout.head_index] != me:
        raise ValueError(
            f"the layout's head group {layout.head_ranks} ({size} ranks, heads={u}) does not "
            f"hold this process (global rank {me}) at head_index={layout.head_index}"
        )
    if layout.ring.cp > 1:
        _check_group(layout.ring)


def _check_group(layout: RingLayout) -> None:
    if not dist.is_initialized():
        raise ValueError(f"cp={layout.cp} needs an initialised torch.distributed")
    me = dist.get_rank()
    if layout.group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"the layout's group does not contain this rank ({me})")
    if dist.get_world_size(layout.group) != layout.cp:
        raise ValueError(
            f"the layout's group has {dist.get_world_size(layout.group)} ranks but cp={layout.cp}"
        )
    if layout.group_ranks[layout.rank] != me or dist.get_rank(layout.group) != layout.rank:
        raise ValueError(
            f"layout.rank={layout.rank} is global rank {layout.group_ranks[layout.rank]} of "
            f"group {layout.group_ranks}, but this process is global rank {me}"
        )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RingLayout,
        causal: bool,
        scale: float,
        kernel: BlockKernel,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        steps = zigzag_steps(
            seqlens=layout.seqlens,
            cp=layout.cp,
            rank=layout.rank,
            causal=causal,
            device=q.device,
            pad_multiple=layout.pad_multiple,
        )
        out, lse = _ring_forward(q, k, v, layout=layout, steps=steps, kernel=kernel, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (layout, steps, kernel, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        layout, steps, kernel, scale = ctx.ring
        with autocast_off(q.device):  # a backward inside an autocast region: as the forward
            dq, dk, dv = _ring_backward(
                dout.contiguous(), q, k, v, out, lse,
                layout=layout, steps=steps, kernel=kernel, scale=scale,
            )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put(dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor) -> None:
    if rows is None:
        dst.copy_(src)
    else:
        dst.index_copy_(0, rows, src.to(dst.dtype))


def _add(dst: torch.Tensor, rows: torch.Tensor | None, src: torch.Tensor) -> None:
    if rows is None:
        dst.add_(src.to(dst.dtype))
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: RingLayout,
    steps: list[RingStep],
    kernel: BlockKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(T, H, Dv)`` in q's dtype and lse ``(T, H)`` in the accumulation dtype."""
    acc = acc_dtype(q.dtype)
    tokens, heads = q.shape[0], q.shape[1]
    out = torch.zeros((tokens, heads, v.shape[2]), dtype=acc, device=q.device)
    lse = torch.full((tokens, heads), -math.inf, dtype=acc, device=q.device)
    kv = [k, v]
    for i in range(layout.cp):
        pending = ring_exchange(kv, layout=layout, tags=_KV_TAGS) if i + 1 < layout.cp else None
        step = steps[(layout.rank - i) % layout.cp]
        if not step.empty:
            block_out, block_lse = kernel.forward(
                _take(q, step.q_rows),
                _take(kv[0], step.k_rows),
                _take(kv[1], step.k_rows),
                spec=step.spec,
                softmax_scale=scale,
            )
            if i == 0:
                # Nothing merged yet: the merge would return the block exactly, so copy it.
                _put(out, step.q_rows, block_out)
                _put(lse, step.q_rows, block_lse.t())
            elif step.q_rows is None:
                out, lse = merge_block(out, lse, block_out, block_lse.t())
            else:
                rows = step.q_rows
                o, s = merge_block(out[rows], lse[rows], block_out, block_lse.t())
                out.index_copy_(0, rows, o)
                lse.index_copy_(0, rows, s)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    layout: RingLayout,
    steps: list[RingStep],
    kernel: BlockKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k, v]
    dkv_pending: PendingExchange | None = None
    dkv: list[torch.Tensor] = []
    for i in range(layout.cp):
        kv_pending = ring_exchange(kv, layout=layout, tags=_KV_TAGS) if i + 1 < layout.cp else None
        step = steps[(layout.rank - i) % layout.cp]
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device),
               torch.zeros(v.shape, dtype=acc, device=v.device)]  # fmt: skip
        if not step.empty:
            rows = step.q_rows
            dq_s, dk_s, dv_s = kernel.backward(
                _take(dout, rows),
                _take(q, rows),
                _take(kv[0], step.k_rows),
                _take(kv[1], step.k_rows),
                _take(out, rows),
                _take(lse, rows).t(),
                spec=step.spec,
                softmax_scale=scale,
            )
            _add(dq, rows, dq_s)
            _add(dkv[0], step.k_rows, dk_s)
            _add(dkv[1], step.k_rows, dv_s)
        if dkv_pending is not None:
            # The accumulator that travelled with this K/V block from its owner.
            for mine, arrived in zip(dkv, dkv_pending.wait()):
                mine.add_(arrived)
        if layout.cp > 1:
            dkv_pending = ring_exchange(dkv, layout=layout, tags=_DKV_TAGS)
        if kv_pending is not None:
            kv = kv_pending.wait()
    if dkv_pending is not None:
        dkv = dkv_pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
