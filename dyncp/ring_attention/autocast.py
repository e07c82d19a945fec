"""How ring attention meets torch autocast: inputs cast to the autocast dtype, math with it off.

Ring attention is an attention operator, so under ``torch.autocast`` it behaves like torch's
``scaled_dot_product_attention``, which autocast lists among its lower-precision ops: q, k and v
are cast to the region's dtype for their device (``torch.get_autocast_dtype``) and the output
comes back in it. Casting is what a mixed-precision model needs, not a convenience: Hugging Face
models apply RoPE in float32 (their rotary embedding leaves autocast), so under ``bf16=True``
queries and keys arrive in float32 and values in bfloat16. As autocast does, only float16,
bfloat16 and float32 tensors are cast (float64 is left alone); outside an autocast region
nothing is cast, and mismatched dtypes stay an error.

Inside, the ring then runs with autocast off for that device: its kernels accumulate scores,
softmax statistics and the log-sum-exp merge in float32 on purpose (``block.acc_dtype``), and an
enabled autocast would silently round their matmuls back to the low dtype. The backward is run
the same way, since a backward called inside an autocast region would otherwise see it too.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_inputs", "autocast_off"]

#: The dtypes autocast casts (it leaves float64 and non-float tensors alone).
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def _enabled(device: torch.device) -> bool:
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` cast to the autocast dtype of their device when autocast is enabled there
    (differentiable casts; float64 and non-float tensors unchanged), else unchanged."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE and _enabled(t.device):
            t = t.to(torch.get_autocast_dtype(t.device.type))
        out.append(t)
    return tuple(out)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which autocast is disabled for ``device``'s type (a no-op where torch has
    no autocast for it)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
