"""Choosing a block kernel: by name, by instance, or automatically for the inputs at hand.

``auto`` takes the fastest kernel that supports the inputs (CUDA: flash-attn, then torch SDPA,
then math; CPU: torch SDPA, then math). Whenever ``auto`` has to pass over a faster kernel it says
so with a :class:`KernelFallbackWarning` (Python shows each distinct warning once per process),
so a missing flash-attn never silently halves the throughput. A kernel asked for by name that
cannot run the inputs is an error, never a fallback.
"""

from __future__ import annotations

import warnings

import torch

from dyncp.ring_attention.block import BlockKernel
from dyncp.ring_attention.flash_kernel import FlashAttnKernel
from dyncp.ring_attention.math_kernel import MathKernel
from dyncp.ring_attention.sdpa_kernel import SdpaKernel

__all__ = ["KERNEL_NAMES", "KernelFallbackWarning", "make_kernel", "select_kernel"]

KERNEL_NAMES = ("auto", "flash", "sdpa", "math")

_PREFERENCE = {"cuda": ("flash", "sdpa", "math"), "cpu": ("sdpa", "math")}


class KernelFallbackWarning(UserWarning):
    """``kernel='auto'`` used a slower block kernel than the best one for the device."""


def make_kernel(name: str) -> BlockKernel:
    """A fresh kernel by name (``flash``, ``sdpa`` or ``math``).

    Raises:
        ValueError: for any other name.
    """
    if name == "flash":
        return FlashAttnKernel()
    if name == "sdpa":
        return SdpaKernel()
    if name == "math":
        return MathKernel()
    raise ValueError(f"unknown block kernel {name!r}; allowed: {', '.join(KERNEL_NAMES[1:])}")


def select_kernel(
    kernel: str | BlockKernel = "auto",
    *,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    v_head_dim: int,
) -> BlockKernel:
    """The block kernel to run inputs of this device, dtype and head dims.

    Args:
        kernel: ``"auto"``, a kernel name, or a :class:`BlockKernel` instance.
        device, dtype, head_dim, v_head_dim: what the kernel will be given.

    Raises:
        ValueError: an unknown name, or a named/given kernel that cannot run these inputs.
    """
    where = dict(device=device, dtype=dtype, head_dim=head_dim, v_head_dim=v_head_dim)
    if not isinstance(kernel, str):
        if not isinstance(kernel, BlockKernel):
            raise ValueError(
                f"kernel must be one of {KERNEL_NAMES} or a BlockKernel, got {type(kernel)}"
            )
        reason = kernel.unsupported(**where)
        if reason:
            raise ValueError(f"kernel {kernel!r} cannot run these inputs: {reason}")
        return kernel
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown block kernel {kernel!r}; allowed: {', '.join(KERNEL_NAMES)}")
    if kernel != "auto":
        chosen = make_kernel(kernel)
        reason = chosen.unsupported(**where)
        if reason:
            raise ValueError(
                f"kernel={kernel!r} cannot run these inputs: {reason}; use kernel='auto' to take "
                f"the best available one"
            )
        return chosen
    skipped = []
    for name in _PREFERENCE.get(device.type, ("math",)):
        candidate = make_kernel(name)
        reason = candidate.unsupported(**where)
        if reason is None:
            if skipped:
                warnings.warn(
                    f"ring_attention kernel='auto' on {device.type} with {dtype}: using "
                    f"{name!r} because {'; '.join(skipped)}",
                    KernelFallbackWarning,
                    stacklevel=3,
                )
            return candidate
        skipped.append(f"{name!r} is unavailable ({reason})")
    raise AssertionError("the math kernel supports every floating dtype")  # pragma: no cover
