"""The block-kernel interface: one varlen attention call between a query block and a K/V block.

Every ring step is one such call: a set of sequences, each attending a run of query rows to a run
of key rows, plain or causal. Kernels return the block's output and its log-sum-exp so that ring
steps can be merged (see ``merge.py``), and compute gradients from the *final* output and
log-sum-exp, which is what makes the ring backward exact.

Conventions shared by all kernels:

* q ``(Tq, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)``, ``H % Hkv == 0`` (grouped-query).
* lse ``(H, Tq)``, float32 (float64 for float64 inputs), natural log of the softmax denominator.
* ``causal`` is aligned bottom-right (query i of a sequence with lq queries and lk keys sees keys
  ``j <= i + lk - lq``), as in flash-attn; ring attention only uses it with ``lq == lk``.
* A query row with no visible key gets output 0 and lse ``-inf``. Rows outside every sequence of
  the spec are never read or written by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

__all__ = ["BlockKernel", "BlockSpec", "acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """The sequences of one block call.

    Sequence ``i`` attends q rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` to k/v rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``. ``device_cu`` optionally holds the same offsets as int32
    tensors on the compute device, built once by :meth:`on` so that GPU kernels do not copy them
    on every call.
    """

    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...]
    causal: bool
    device_cu: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.cu_seqlens_q) != len(self.cu_seqlens_k) or len(self.cu_seqlens_q) < 1:
            raise ValueError(
                f"cu_seqlens_q ({len(self.cu_seqlens_q)} entries) and cu_seqlens_k "
                f"({len(self.cu_seqlens_k)}) must have the same length >= 1"
            )
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            cu = getattr(self, name)
            if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"{name} must start at 0 and never decrease, got {cu}")

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def seqlens_q(self) -> list[int]:
        cu = self.cu_seqlens_q
        return [b - a for a, b in zip(cu, cu[1:])]

    @property
    def seqlens_k(self) -> list[int]:
        cu = self.cu_seqlens_k
        return [b - a for a, b in zip(cu, cu[1:])]

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k, default=0)

    def on(self, device: torch.device) -> BlockSpec:
        """The same spec with its offsets also as int32 tensors on ``device``."""
        cu_q = torch.tensor(self.cu_seqlens_q, dtype=torch.int32, device=device)
        cu_k = torch.tensor(self.cu_seqlens_k, dtype=torch.int32, device=device)
        return replace(self, device_cu=(cu_q, cu_k))

    def cu_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 offsets on ``device`` (the cached ones when they are already there)."""
        if self.device_cu is not None and self.device_cu[0].device == device:
            return self.device_cu
        return self.on(device).device_cu  # type: ignore[return-value]


@runtime_checkable
class BlockKernel(Protocol):
    """A varlen attention block kernel (see the module docstring for shapes and conventions)."""

    name: str

    def unsupported(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int
    ) -> str | None:
        """Why this kernel cannot run these inputs, or None when it can."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        spec: BlockSpec,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block output ``(Tq, H, Dv)`` (any float dtype) and lse ``(H, Tq)``."""
        ...

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
        """dq, dk, dv of this block, given the *final* output and lse of the query rows.

        Gradients come back in the accumulation dtype of the inputs (``acc_dtype``) or in the
        input dtype; the ring adds them into accumulators of the accumulation dtype.
        """
        ...
