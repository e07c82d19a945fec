"""Block kernel on torch's fused SDPA operators that return the log-sum-exp.

The public ``scaled_dot_product_attention`` hides the log-sum-exp that ring merging needs, so this
kernel calls the underlying aten operators directly, on the dense padded batches of
``buckets.py``:

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): float64, float32,
  bfloat16, float16.
* CUDA: ``_scaled_dot_product_efficient_attention`` (+ ``_backward``): float32, bfloat16,
  float16. Written against the operator schemas of torch 2.13 and checked only by the GPU tests
  (``tests/multirank/test_ring_attention.py``, skipped without CUDA).

A batch without padding slots (always the case for a batch of one sequence, hence for long
sequences) runs without a mask, causal through the operator's own flag (top-left aligned, which
equals bottom-right when ``Mq == Mk``). Other batches get an additive mask for padding and
causality. K/V heads are repeated to the query heads for grouped-query attention (the operators'
own GQA support differs between versions) and the key gradients are summed back.
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


class _Masking:
    """How one padded batch is masked: ``bias`` (or None and ``causal``) and its keyless rows."""

    def __init__(self, b: PaddedBatch, *, causal: bool, dtype: torch.dtype, heads: int) -> None:
        if b.uniform and (not causal or b.max_q == b.max_k):
            self.bias, self.causal, self.empty = None, causal, None
            return
        allowed = b.mask(causal=causal)
        self.empty = ~allowed.any(dim=-1)  # (n, 1, Mq): rows that see no key, padding slots too
        # Keyless rows would give NaN in some operators: open them, and overwrite their results
        # afterwards (output 0, lse -inf). The CUDA operator wants 16-aligned bias rows; a slice
        # of an aligned buffer satisfies it on every device.
        allowed = allowed | self.empty[..., None]
        n, _, mq, mk = allowed.shape
        buf = torch.zeros((n, 1, mq, _align(mk, 16)), dtype=dtype, device=allowed.device)
        bias = buf[..., :mk]
        bias.masked_fill_(~allowed, -math.inf)
        self.bias, self.causal = bias.expand(n, heads, mq, mk), False


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

    def _batches(self, spec: BlockSpec, device: torch.device) -> list[PaddedBatch]:
        return padded_batches(spec, device=device, max_score_elements=self.max_score_elements)

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
            m = _Masking(b, causal=spec.causal, dtype=q.dtype, heads=h)
            o, lse_b = _fwd_op(qb, kb, vb, m, softmax_scale)
            lse_b = lse_b[..., : b.max_q]
            if m.empty is not None:
                o = o.masked_fill(m.empty[..., None], 0.0)
                lse_b = lse_b.masked_fill(m.empty, -math.inf)
            b.scatter_q(out, o)
            b.scatter_lse(lse, lse_b)
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
        h, hkv = q.shape[1], k.shape[1]
        g = h // hkv
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for b in self._batches(spec, q.device):
            m = _Masking(b, causal=spec.causal, dtype=q.dtype, heads=h)
            qb = b.gather_q(q)
            kb = b.gather_k(k).repeat_interleave(g, dim=1)
            vb = b.gather_k(v).repeat_interleave(g, dim=1)
            dob = b.gather_q(dout.to(q.dtype))
            ob = b.gather_q(out.to(q.dtype))
            lse_b = b.gather_lse(lse, fill=math.inf)
            if m.empty is not None:
                # Keyless rows and padding slots: zero dout and lse +inf give probability 0.
                dob = dob.masked_fill(m.empty[..., None], 0.0)
                lse_b = lse_b.masked_fill(m.empty, math.inf)
            dqb, dkb, dvb = _bwd_op(dob, qb, kb, vb, ob, lse_b, m, softmax_scale)
            n, _, mk, _ = dkb.shape
            b.scatter_q(dq, dqb)
            b.scatter_k(dk, dkb.reshape(n, hkv, g, mk, -1).sum(dim=2))
            b.scatter_k(dv, dvb.reshape(n, hkv, g, mk, -1).sum(dim=2))
        return dq, dk, dv


def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: _Masking, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, m.causal, attn_mask=m.bias, scale=scale
        )
    o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, m.bias, True, 0.0, m.causal, scale=scale
    )
    return o, lse


def _bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    m: _Masking,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        lse = lse.to(acc_dtype(q.dtype)).contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, m.causal, attn_mask=m.bias, scale=scale
        )
    n, h, mq = lse.shape
    lse_padded = torch.full((n, h, _align(mq, 32)), math.inf, dtype=torch.float32, device=q.device)
    lse_padded[..., :mq] = lse
    seed = torch.empty((), dtype=torch.int64)  # dropout is 0: the operator never reads them
    offset = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, m.bias, out, lse_padded, seed, offset, 0.0,
        [True, True, True, False], m.causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv
