"""Block kernel on torch's fused SDPA operators that return the log-sum-exp.

The public ``scaled_dot_product_attention`` hides the log-sum-exp that ring merging needs, so this
kernel calls the underlying aten operators directly, on the dense padded batches of
``buckets.py`` with an additive mask for padding and causality:

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): float64, float32,
  bfloat16, float16.
* CUDA: ``_scaled_dot_product_efficient_attention`` (+ ``_backward``): float32, bfloat16,
  float16. Written against the operator schemas of torch 2.13 and checked only by the GPU tests
  (``tests/test_ring_attention.py``, skipped without CUDA).

K/V heads are repeated to the query heads for grouped-query attention (the operators' own GQA
support differs between versions) and the key gradients are summed back.
"""

from __future__ import annotations

import math

import torch

from dyncp.ring_attention.block import BlockSpec, acc_dtype
from dyncp.ring_attention.buckets import PaddedBatch, padded_batches

__all__ = ["SdpaKernel"]

_CPU_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _align(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SdpaKernel:
    """Varlen block kernel on torch's fused SDPA aten operators (CPU flash, CUDA efficient).

    Args:
        max_score_elements: bound on ``n * Mq * Mk`` of one padded batch (the mask's size).
    """

    name = "sdpa"

    def __init__(self, *, max_score_elements: int = 1 << 26) -> None:
        self.max_score_elements = int(max_score_elements)

    def __repr__(self) -> str:
        return f"SdpaKernel(max_score_elements={self.max_score_elements})"

    def unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int
    ) -> str | None:
        if head_dim != v_head_dim:
            return f"the sdpa kernel needs equal q/k and v head dims, got {head_dim}, {v_head_dim}"
        if device.type == "cpu":
            allowed = _CPU_DTYPES
        elif device.type == "cuda":
            allowed = _CUDA_DTYPES
        else:
            return f"the sdpa kernel runs on cpu or cuda, got {device.type}"
        if dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            return f"the sdpa kernel on {device.type} supports {names}; got {dtype}"
        return None

    # ------------------------------------------------------------------------------- helpers
    def _batches(self, spec: BlockSpec, device: torch.device) -> list[PaddedBatch]:
        return padded_batches(spec, device=device, max_score_elements=self.max_score_elements)

    @staticmethod
    def _bias(b: PaddedBatch, *, causal: bool, dtype: torch.dtype, heads: int) -> torch.Tensor:
        """Additive mask ``(n, heads, Mq, Mk)``; rows with no visible key are left open.

        Fully masked rows would give NaN in some operators; their results are replaced afterwards
        (output 0, lse -inf), so opening them is harmless.
        """
        allowed = b.mask(causal=causal)
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        n, _, mq, mk = allowed.shape
        # The CUDA operator wants the bias rows 16-aligned in memory; a slice of an aligned
        # buffer satisfies it on every device.
        buf = torch.zeros((n, 1, mq, _align(mk, 16)), dtype=dtype, device=allowed.device)
        bias = buf[..., :mk]
        bias.masked_fill_(~allowed, -math.inf)
        return bias.expand(n, heads, mq, mk)

    @staticmethod
    def _empty_rows(b: PaddedBatch, *, causal: bool) -> torch.Tensor:
        """``(n, 1, Mq)`` True where a query row sees no key (padding slots included)."""
        return ~b.mask(causal=causal).any(dim=-1)

    # ------------------------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        spec: BlockSpec,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tq, h, _ = q.shape
        g = h // k.shape[1]
        out = torch.zeros((tq, h, v.shape[2]), dtype=q.dtype, device=q.device)
        lse = torch.full((h, tq), -math.inf, dtype=acc_dtype(q.dtype), device=q.device)
        for b in self._batches(spec, q.device):
            qb = b.gather_q(q)
            kb = b.gather_k(k).repeat_interleave(g, dim=1)
            vb = b.gather_k(v).repeat_interleave(g, dim=1)
            bias = self._bias(b, causal=spec.causal, dtype=q.dtype, heads=h)
            o, lse_b = self._fwd_op(qb, kb, vb, bias, softmax_scale)
            empty = self._empty_rows(b, causal=spec.causal)
            o = o.masked_fill(empty[..., None], 0.0)
            lse_b = lse_b[..., : qb.shape[2]].masked_fill(empty, -math.inf)
            b.scatter_q(out, o)
            b.scatter_lse(lse, lse_b)
        return out, lse

    @staticmethod
    def _fwd_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=bias, scale=scale
            )
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=scale
        )
        return o, lse

    # ------------------------------------------------------------------------------ backward
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
        h, hkv = q.shape[1], k.shape[1]
        g = h // hkv
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for b in self._batches(spec, q.device):
            empty = self._empty_rows(b, causal=spec.causal)
            qb = b.gather_q(q)
            kb = b.gather_k(k).repeat_interleave(g, dim=1)
            vb = b.gather_k(v).repeat_interleave(g, dim=1)
            # Rows without keys (and padding slots) get zero dout and lse +inf: probability 0.
            dob = b.gather_q(dout.to(q.dtype)).masked_fill(empty[..., None], 0.0)
            ob = b.gather_q(out.to(q.dtype))
            lse_b = b.gather_lse(lse, fill=math.inf).masked_fill(empty, math.inf)
            bias = self._bias(b, causal=spec.causal, dtype=q.dtype, heads=h)
            dqb, dkb, dvb = self._bwd_op(dob, qb, kb, vb, ob, lse_b, bias, softmax_scale)
            n, _, mk, _ = dkb.shape
            b.scatter_q(dq, dqb)
            b.scatter_k(dk, dkb.reshape(n, hkv, g, mk, -1).sum(dim=2))
            b.scatter_k(dv, dvb.reshape(n, hkv, g, mk, -1).sum(dim=2))
        return dq, dk, dv

    @staticmethod
    def _bwd_op(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        bias: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if q.device.type == "cpu":
            lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.contiguous(), 0.0, False, attn_mask=bias, scale=scale
            )
        n, h, mq = lse.shape
        lse_padded = torch.full(
            (n, h, _align(mq, 32)), math.inf, dtype=torch.float32, device=q.device
        )
        lse_padded[..., :mq] = lse
        seed = torch.empty((), dtype=torch.int64)
        offset = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse_padded, seed, offset, 0.0,
            [True, True, True, False], False, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
