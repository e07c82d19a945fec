"""The reference block kernel: plain torch math, any device, any float dtype.

It materialises the score matrix of each padded batch (``buckets.py``) in the accumulation dtype
(float64 for float64 inputs, else float32), so it is exact to that precision and is what every
other kernel is tested against. Memory grows with the square of the block length: it is meant for
CPUs, tests and short blocks, not for 128K-token sequences.
"""

from __future__ import annotations

import math

import torch

from dyncp.ring_attention.block import BlockSpec, acc_dtype
from dyncp.ring_attention.buckets import PaddedBatch, padded_batches

__all__ = ["MathKernel"]


class MathKernel:
    """Pure-torch varlen attention block kernel (the reference).

    Args:
        max_score_elements: bound on the score-matrix elements of one padded batch, over all
            heads; larger batches are split.
    """

    name = "math"

    def __init__(self, *, max_score_elements: int = 1 << 25) -> None:
        self.max_score_elements = int(max_score_elements)

    def __repr__(self) -> str:
        return f"MathKernel(max_score_elements={self.max_score_elements})"

    def unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int
    ) -> str | None:
        if not dtype.is_floating_point:
            return f"the math kernel needs floating-point inputs, got {dtype}"
        return None

    def _batches(self, spec: BlockSpec, device: torch.device, heads: int) -> list[PaddedBatch]:
        return padded_batches(
            spec, device=device, max_score_elements=max(1, self.max_score_elements // heads)
        )

    @staticmethod
    def _scores(
        b: PaddedBatch, q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float, hkv: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grouped q ``(n, Hkv, g, Mq, D)``, k ``(n, Hkv, Mk, D)``, masked scores and the mask."""
        acc = acc_dtype(q.dtype)
        qb = b.gather_q(q).to(acc)
        n, h, mq, d = qb.shape
        qg = qb.reshape(n, hkv, h // hkv, mq, d)
        kb = b.gather_k(k).to(acc)
        mask = b.mask(causal=causal)[:, :, None]
        s = torch.einsum("nkgqd,nkjd->nkgqj", qg, kb) * scale
        return qg, kb, s.masked_fill(~mask, -math.inf), mask

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        spec: BlockSpec,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = acc_dtype(q.dtype)
        tq, h, _ = q.shape
        hkv, dv = v.shape[1], v.shape[2]
        out = torch.zeros((tq, h, dv), dtype=acc, device=q.device)
        lse = torch.full((h, tq), -math.inf, dtype=acc, device=q.device)
        for b in self._batches(spec, q.device, h):
            _, _, s, _ = self._scores(b, q, k, causal=spec.causal, scale=softmax_scale, hkv=hkv)
            lse_b = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse_b.masked_fill(torch.isinf(lse_b), 0.0)[..., None])
            o = torch.einsum("nkgqj,nkjd->nkgqd", p, b.gather_k(v).to(acc))
            n, mq = o.shape[0], o.shape[3]
            b.scatter_q(out, o.reshape(n, h, mq, dv))
            b.scatter_lse(lse, lse_b.reshape(n, h, mq))
        return out, lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        spec: BlockSpec,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = acc_dtype(q.dtype)
        h, hkv = q.shape[1], k.shape[1]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for b in self._batches(spec, q.device, h):
            qg, kb, s, mask = self._scores(
                b, q, k, causal=spec.causal, scale=softmax_scale, hkv=hkv
            )
            n, _, g, mq, _ = qg.shape
            lse_b = b.gather_lse(lse.to(acc), fill=math.inf).reshape(n, hkv, g, mq)
            p = torch.exp(s - lse_b[..., None]).masked_fill(~mask, 0.0)
            vb = b.gather_k(v).to(acc)
            do = b.gather_q(dout).to(acc).reshape(n, hkv, g, mq, -1)
            o = b.gather_q(out).to(acc).reshape(n, hkv, g, mq, -1)
            dp = torch.einsum("nkgqd,nkjd->nkgqj", do, vb)
            ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
            b.scatter_k(dv, torch.einsum("nkgqj,nkgqd->nkjd", p, do))
            b.scatter_k(dk, torch.einsum("nkgqj,nkgqd->nkjd", ds, qg) * softmax_scale)
            dq_b = torch.einsum("nkgqj,nkjd->nkgqd", ds, kb) * softmax_scale
            b.scatter_q(dq, dq_b.reshape(n, h, mq, -1))
        return dq, dk, dv
