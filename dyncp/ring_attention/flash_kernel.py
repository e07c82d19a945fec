"""Block kernel on flash-attn's varlen kernels (CUDA, float16/bfloat16), when flash-attn imports.

flash-attn takes THD tensors and cu_seqlens directly, so no padding or gathering is needed, and
it supports grouped-query attention natively. Its forward is the public ``flash_attn_varlen_func``
(with ``return_attn_probs=True`` for the log-sum-exp); its backward has no public entry point, so
``_flash_attn_varlen_backward`` is called with keyword arguments matched against its signature,
which changed between 2.5 (``window_size``), 2.6 (``softcap``) and 2.7 (``window_size_left`` /
``window_size_right``). Untested here (no GPU in CI); the GPU tests compare it with the math
kernel when CUDA and flash-attn are present.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from dyncp.ring_attention.block import BlockSpec

__all__ = ["FlashAttnKernel", "flash_attn_import_error"]

_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_import_error() -> str | None:
    """Why ``flash_attn`` cannot be imported, or None when it can."""
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as exc:  # ImportError, or a broken CUDA extension
        return f"flash-attn is not importable ({type(exc).__name__}: {exc})"
    return None


class FlashAttnKernel:
    """Varlen block kernel on flash-attn 2 (CUDA, float16/bfloat16, head dim <= 256)."""

    name = "flash"

    def __repr__(self) -> str:
        return "FlashAttnKernel()"

    def unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int
    ) -> str | None:
        if device.type != "cuda":
            return f"the flash kernel runs on cuda only, got {device.type}"
        if dtype not in _DTYPES:
            return f"the flash kernel supports float16 and bfloat16, got {dtype}"
        if head_dim != v_head_dim or head_dim > 256:
            return f"the flash kernel needs equal head dims <= 256, got {head_dim}, {v_head_dim}"
        return flash_attn_import_error()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        spec: BlockSpec,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from flash_attn import flash_attn_varlen_func

        cu_q, cu_k = spec.cu_tensors(q.device)
        out, lse, _ = flash_attn_varlen_func(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cu_q,
            cu_k,
            spec.max_seqlen_q,
            spec.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=softmax_scale,
            causal=spec.causal,
            return_attn_probs=True,
        )
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(
                f"flash-attn returned lse of shape {tuple(lse.shape)}; dyncp needs the unpadded "
                f"(heads, tokens) layout of flash-attn >= 2.4"
            )
        # Rows outside every sequence are left unwritten by flash-attn; the ring never reads them.
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
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        cu_q, cu_k = spec.cu_tensors(q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values: dict[str, Any] = {
            "dout": dout.to(q.dtype).contiguous(),
            "q": q.contiguous(),
            "k": k.contiguous(),
            "v": v.contiguous(),
            "out": out.to(q.dtype).contiguous(),
            "softmax_lse": lse.float().contiguous(),
            "dq": dq,
            "dk": dk,
            "dv": dv,
            "cu_seqlens_q": cu_q,
            "cu_seqlens_k": cu_k,
            "max_seqlen_q": spec.max_seqlen_q,
            "max_seqlen_k": spec.max_seqlen_k,
            "dropout_p": 0.0,
            "softmax_scale": softmax_scale,
            "causal": spec.causal,
            "window_size": (-1, -1),
            "window_size_left": -1,
            "window_size_right": -1,
            "softcap": 0.0,
            "alibi_slopes": None,
            "deterministic": False,
            "rng_state": None,
        }
        params = inspect.signature(_flash_attn_varlen_backward).parameters
        missing = [
            n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in values
        ]
        if missing:
            raise RuntimeError(f"unsupported flash-attn version: backward needs {missing}")
        _flash_attn_varlen_backward(**{n: values[n] for n in params if n in values})
        # Rows after the last sequence are never written by flash-attn: zero them.
        dq[spec.cu_seqlens_q[-1] :].zero_()
        dk[spec.cu_seqlens_k[-1] :].zero_()
        dv[spec.cu_seqlens_k[-1] :].zero_()
        return dq, dk, dv
