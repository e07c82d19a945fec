"""Dense padded batches for varlen kernels that only take ``(batch, heads, len, dim)`` tensors.

The math and SDPA kernels turn a varlen :class:`BlockSpec` into a few dense batches. Sequences
are grouped by the power-of-two class of their query and key lengths, so padding wastes at most
half of each dimension and one long sequence never forces a thousand short ones to its length;
a batch is further split so that its score matrix stays under a size budget.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from dyncp.ring_attention.block import BlockSpec

__all__ = ["PaddedBatch", "padded_batches"]


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """``n`` sequences of a spec padded to ``(n, Mq)`` query rows and ``(n, Mk)`` key rows.

    Padding slots point at a real row of the same sequence (so gathers stay in bounds) and are
    flagged False in ``q_valid`` / ``k_valid``.
    """

    q_index: torch.Tensor
    q_valid: torch.Tensor
    k_index: torch.Tensor
    k_valid: torch.Tensor
    q_lens: torch.Tensor
    k_lens: torch.Tensor

    def gather_q(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, H, D)`` rows -> ``(n, H, Mq, D)``."""
        return x[self.q_index].permute(0, 2, 1, 3)

    def gather_k(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, H, D)`` rows -> ``(n, H, Mk, D)``."""
        return x[self.k_index].permute(0, 2, 1, 3)

    def scatter_q(self, dst: torch.Tensor, y: torch.Tensor) -> None:
        """Write ``(n, H, Mq, D)`` back to the valid rows of ``dst`` ``(T, H, D)``."""
        dst[self.q_index[self.q_valid]] = y.permute(0, 2, 1, 3)[self.q_valid].to(dst.dtype)

    def scatter_k(self, dst: torch.Tensor, y: torch.Tensor) -> None:
        """Write ``(n, H, Mk, D)`` back to the valid rows of ``dst`` ``(T, H, D)``."""
        dst[self.k_index[self.k_valid]] = y.permute(0, 2, 1, 3)[self.k_valid].to(dst.dtype)

    def scatter_lse(self, dst: torch.Tensor, lse: torch.Tensor) -> None:
        """Write ``(n, H, Mq)`` back to the valid columns of ``dst`` ``(H, T)``."""
        dst[:, self.q_index[self.q_valid]] = lse.permute(0, 2, 1)[self.q_valid].t().to(dst.dtype)

    def gather_lse(self, lse: torch.Tensor, fill: float) -> torch.Tensor:
        """``(H, T)`` -> ``(n, H, Mq)``, padding slots set to ``fill``."""
        out = lse[:, self.q_index].permute(1, 0, 2)
        return out.masked_fill(~self.q_valid[:, None, :], fill)

    def mask(self, *, causal: bool) -> torch.Tensor:
        """``(n, 1, Mq, Mk)`` bool: True where a real query may attend a real key."""
        allowed = self.q_valid[:, :, None] & self.k_valid[:, None, :]
        if causal:
            i = torch.arange(self.q_index.shape[1], device=allowed.device)
            j = torch.arange(self.k_index.shape[1], device=allowed.device)
            shift = (self.k_lens - self.q_lens)[:, None, None]
            allowed = allowed & (j[None, None, :] <= i[None, :, None] + shift)
        return allowed[:, None]


def padded_batches(
    spec: BlockSpec, *, device: torch.device, max_score_elements: int = 1 << 24
) -> list[PaddedBatch]:
    """Group the non-empty sequences of ``spec`` into padded batches (see the module docstring).

    Sequences with no query or no key rows are left out: their rows keep output 0, lse -inf.
    ``max_score_elements`` bounds ``n * Mq * Mk`` of one batch (one sequence is always allowed).
    """
    lens_q, lens_k = spec.seqlens_q, spec.seqlens_k
    classes: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq > 0 and lk > 0:
            classes[((lq - 1).bit_length(), (lk - 1).bit_length())].append(i)
    batches = []
    for seqs in classes.values():
        chunk: list[int] = []
        mq = mk = 0
        for i in seqs:
            nq, nk = max(mq, lens_q[i]), max(mk, lens_k[i])
            if chunk and (len(chunk) + 1) * nq * nk > max_score_elements:
                batches.append(_batch(spec, chunk, device))
                chunk, nq, nk = [], lens_q[i], lens_k[i]
            chunk.append(i)
            mq, mk = nq, nk
        batches.append(_batch(spec, chunk, device))
    return batches


def _batch(spec: BlockSpec, seqs: list[int], device: torch.device) -> PaddedBatch:
    def rows(cu: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        starts = torch.tensor([cu[i] for i in seqs], dtype=torch.int64, device=device)
        lens = torch.tensor([cu[i + 1] - cu[i] for i in seqs], dtype=torch.int64, device=device)
        ar = torch.arange(int(lens.max()), device=device)
        valid = ar[None, :] < lens[:, None]
        index = torch.where(valid, starts[:, None] + ar[None, :], starts[:, None])
        return index, valid, lens

    q_index, q_valid, q_lens = rows(spec.cu_seqlens_q)
    k_index, k_valid, k_lens = rows(spec.cu_seqlens_k)
    return PaddedBatch(q_index, q_valid, k_index, k_valid, q_lens, k_lens)
