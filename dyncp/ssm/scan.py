"""A diagonal linear recurrence under context parallelism: chunk states passed by one all-gather.

Per channel, within each packed sequence::

    h_t = a_t * h_{t-1} + x_t,     h_{-1} = 0,     y_t = h_t

the recurrence at the heart of Mamba-2-style SSM layers (there ``a_t = exp(-dt_t * A)`` and ``x_t``
is ``dt_t * B_t x_t``; the channel structure does not change how CP splits the sequence).

In the zigzag layout rank ``r`` holds chunks ``r`` and ``2c-1-r`` of every sequence. A chunk
scanned from a zero state gives ``e_j`` (its last state) and ``A_j`` (the product of its ``a``),
and the true state entering chunk ``j + 1`` is ``H_{j+1} = A_j H_j + e_j``. So each rank scans its
chunks locally, one all-gather exchanges ``(A_j, e_j)`` of every chunk (``2 * chunks * channels``
numbers per sequence, independent of the sequence length), every rank composes the chunk states
in sequence order and rescans its chunks from their true entering states. The backward pass is the
same in reverse: the adjoint ``l_t = dy_t + a_{t+1} l_{t+1}`` enters chunk ``j`` from the right as
``mu_j``, and ``mu_{j-1} = m_j + A_j mu_j`` with ``m_j = a_first * l'_first`` of a zero-state
reverse scan. This is state passing with the latency of one collective instead of ``2c`` ring hops;
the alternative, an all-to-all to channel parallelism, moves every activation (``T * D``) twice.

The composition only reassociates products of ``a`` (``A_j H_j`` instead of one factor at a
time), so float64 results agree with one process running the whole sequence to rounding. The
time loop runs over the longest local chunk, vectorised over chunks and channels: a reference
implementation of the mechanism, not a fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dyncp.plan import padded_length
from dyncp.ring_attention.layout import RingLayout

__all__ = ["diagonal_scan"]


def diagonal_scan(a: torch.Tensor, x: torch.Tensor, layout: RingLayout) -> torch.Tensor:
    """``h_t = a_t * h_{t-1} + x_t`` within each sequence of this rank's zigzag shards.

    Args:
        a: ``(T, D)`` decay per token and channel, ``T = layout.local_tokens``.
        x: ``(T, D)`` input, same dtype and device.
        layout: the micro-batch's ring layout (``make_ring_layout``); the scan is a collective
            over ``layout.group`` when ``cp > 1``.

    Returns:
        ``(T, D)`` states; padding rows are 0 and get zero gradient.

    Raises:
        ValueError: shapes that are not ``(layout.local_tokens, D)``, mismatched dtypes/devices.
    """
    for name, t in (("a", a), ("x", x)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != layout.local_tokens:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be (layout.local_tokens={layout.local_tokens}, channels), got {shape}"
            )
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if a.shape != x.shape or a.dtype != x.dtype or a.device != x.device:
        raise ValueError(
            f"a and x must share shape, dtype and device: a {tuple(a.shape)} {a.dtype} "
            f"{a.device}, x {tuple(x.shape)} {x.dtype} {x.device}"
        )
    return _Scan.apply(a, x, layout)


@dataclass(frozen=True, slots=True)
class _Chunks:
    """This rank's chunks as a padded ``(n, M)`` row index (-1 past a chunk's real tokens).

    Chunk ``i`` is chunk number ``order[i]`` (``0 .. 2c-1``) of sequence ``seq[i]``.
    """

    rows: torch.Tensor
    seq: tuple[int, ...]
    order: tuple[int, ...]


def _chunks(layout: RingLayout, device: torch.device) -> _Chunks:
    c, r = layout.cp, layout.rank
    runs, seq, order = [], [], []
    for i, length in enumerate(layout.seqlens):
        off = layout.cu_seqlens_local[i]
        if c == 1:
            runs.append(range(off, off + length))
            seq.append(i)
            order.append(0)
            continue
        m = padded_length(length, c) // (2 * c)
        for slot, j in enumerate((r, 2 * c - 1 - r)):
            real = min(max(length - j * m, 0), m)
            runs.append(range(off + slot * m, off + slot * m + real))
            seq.append(i)
            order.append(j)
    width = max(len(run) for run in runs)
    rows = torch.full((len(runs), max(width, 1)), -1, dtype=torch.int64)
    for i, run in enumerate(runs):
        rows[i, : len(run)] = torch.tensor(list(run), dtype=torch.int64)
    return _Chunks(rows.to(device), tuple(seq), tuple(order))


def _gather(t: torch.Tensor, rows: torch.Tensor, fill: float) -> torch.Tensor:
    """``t[rows]`` as ``(n, M, D)`` with ``fill`` where ``rows`` is -1."""
    out = t[rows.clamp(min=0)]
    return out.masked_fill((rows < 0)[..., None], fill)


def _scan(a: torch.Tensor, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """States ``(n, M, D)`` of ``h_t = a_t h_{t-1} + x_t`` from ``h0`` ``(n, D)``."""
    out = torch.empty_like(x)
    h = h0
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        out[:, t] = h
    return out


def _reverse_scan(a: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Adjoints ``l_t = dy_t + a_{t+1} l_{t+1}`` ``(n, M, D)``, nothing entering from the right."""
    out = torch.empty_like(dy)
    carried = torch.zeros_like(dy[:, 0])
    for t in range(dy.shape[1] - 1, -1, -1):
        out[:, t] = dy[:, t] + carried
        carried = a[:, t] * out[:, t]
    return out


def _all_chunks(local: torch.Tensor, layout: RingLayout) -> list[torch.Tensor]:
    """Every rank's ``(n, 2, D)`` chunk summaries, in rank order."""
    if layout.cp == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(layout.cp)]
    dist.all_gather(parts, local.contiguous(), group=layout.group)
    return parts


def _by_chunk(parts: list[torch.Tensor], chunks: _Chunks, cp: int, seq: int) -> list[torch.Tensor]:
    """Summaries ``(2, D)`` of sequence ``seq``'s chunks in sequence order ``0 .. 2c-1``.

    Every rank lists its chunks in the same order (per sequence: chunk ``r``, chunk ``2c-1-r``),
    so chunk ``j`` is at the same index on rank ``j`` (slot 0) or ``2c-1-j`` (slot 1).
    """
    first = chunks.seq.index(seq)
    if cp == 1:
        return [parts[0][first]]
    return [parts[j][first] if j < cp else parts[2 * cp - 1 - j][first + 1]
            for j in range(2 * cp)]  # fmt: skip


class _Scan(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        a: torch.Tensor,
        x: torch.Tensor,
        layout: RingLayout,
    ) -> torch.Tensor:
        chunks = _chunks(layout, a.device)
        ac, xc = _gather(a, chunks.rows, 1.0), _gather(x, chunks.rows, 0.0)
        n, _, d = xc.shape
        local = _scan(ac, xc, torch.zeros((n, d), dtype=x.dtype, device=x.device))
        # (A_j, e_j): product of the chunk's a and its last state from zero (empty: 1 and 0).
        summary = torch.stack([ac.prod(dim=1), local[:, -1]], dim=1)
        parts = _all_chunks(summary, layout)
        h0 = torch.zeros((n, d), dtype=x.dtype, device=x.device)
        for s in range(layout.num_seqs):
            entering, state = {}, torch.zeros(d, dtype=x.dtype, device=x.device)
            for j, part in enumerate(_by_chunk(parts, chunks, layout.cp, s)):
                entering[j] = state
                state = part[0] * state + part[1]
            for i in (i for i, q in enumerate(chunks.seq) if q == s):
                h0[i] = entering[chunks.order[i]]
        states = _scan(ac, xc, h0)
        y = torch.zeros_like(x)
        valid = chunks.rows >= 0
        y[chunks.rows[valid]] = states[valid]
        ctx.save_for_backward(a, y, h0)
        ctx.scan = (layout, chunks)
        return y

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        a, y, h0 = ctx.saved_tensors
        layout, chunks = ctx.scan
        rows, valid = chunks.rows, chunks.rows >= 0
        ac, dyc = _gather(a, rows, 1.0), _gather(dy, rows, 0.0)
        n, _, d = dyc.shape
        # Rows past a chunk's real tokens have dy = 0, so nothing flows back from them.
        local = _reverse_scan(ac, dyc)
        # (A_j, m_j = a_first * l'_first): what chunk j hands to chunk j - 1 is m_j + A_j mu_j.
        summary = torch.stack([ac.prod(dim=1), ac[:, 0] * local[:, 0]], dim=1)
        parts = _all_chunks(summary, layout)
        mu = torch.zeros((n, d), dtype=dy.dtype, device=dy.device)
        for s in range(layout.num_seqs):
            entering, carried = {}, torch.zeros(d, dtype=dy.dtype, device=dy.device)
            for j, part in reversed(list(enumerate(_by_chunk(parts, chunks, layout.cp, s)))):
                entering[j] = carried
                carried = part[1] + part[0] * carried
            for i in (i for i, q in enumerate(chunks.seq) if q == s):
                mu[i] = entering[chunks.order[i]]
        # mu enters at the last *real* row of each chunk: shift it there with a masked scan.
        last = valid.sum(dim=1) - 1
        dyc = dyc.clone()
        has = last >= 0
        dyc[has, last[has]] += mu[has]
        lam = _reverse_scan(ac, dyc)
        # dL/da_t = l_t * h_{t-1}: the previous state inside the chunk, h0 at its first row.
        hc = _gather(y, rows, 0.0)
        h_prev = torch.cat([h0[:, None], hc[:, :-1]], dim=1)
        da, dx = torch.zeros_like(a), torch.zeros_like(a)
        da[rows[valid]] = (lam * h_prev)[valid]
        dx[rows[valid]] = lam[valid]
        return da, dx, None
