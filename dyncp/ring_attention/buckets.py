"""Dense padded batches for varlen kernels that only take ``(batch, heads, len, dim)`` tensors.

The math and SDPA kernels turn a varlen :class:`BlockSpec` into a few dense batches. Sequences
are grouped by the power-of-two class of their query and key lengths, so padding wastes at most
half of each dimension and one long sequence never forces a thousand short ones to its length;
a batch is further split so that its score matrix stays under a size budget. A batch of one
sequence is a view of the rows (no copy, no padding), which is the common case for long ones.
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
    flagged False in ``q_valid`` / ``k_valid``. ``uniform`` says that there are no padding slots
    (every sequence has ``Mq`` queries and ``Mk`` keys); ``q_span`` / ``k_span`` are the row
    slices of a single-sequence batch, gathered as views.
    """

    q_index: torch.Tensor
    q_valid: torch.Tensor
    k_index: torch.Tensor
    k_valid: torch.Tensor
    q_lens: torch.Tensor
    k_lens: torch.Tensor
    uniform: bool
    q_span: slice | None
    k_span: slice | None

    @property
    def max_q(self) -> int:
        return self.q_index.shape[1]

    @property
    def max_k(self) -> int:
        return self.k_index.shape[1]

    def gather_q(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, H, D)`` rows -> ``(n, H, Mq, D)``."""
        rows = x[self.q_span].unsqueeze(0) if self.q_span is not None else x[self.q_index]
        return rows.permute(0, 2, 1, 3)

    def gather_k(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, H, D)`` rows -> ``(n, H, Mk, D)``."""
        rows = x[self.k_span].unsqueeze(0) if self.k_span is not None else x[self.k_index]
        return rows.permute(0, 2, 1, 3)

    def scatter_q(self, dst: torch.Tensor, y: torch.Tensor) -> None:
        """Write ``(n, H, Mq, D)`` back to the valid rows of ``dst`` ``(T, H, D)``."""
        if self.q_span is not None:
            dst[self.q_span] = y[0].permute(1, 0, 2)
        else:
            dst[self.q_index[self.q_valid]] = y.permute(0, 2, 1, 3)[self.q_valid].to(dst.dtype)

    def scatter_k(self, dst: torch.Tensor, y: torch.Tensor) -> None:
        """Write ``(n, H, Mk, D)`` back to the valid rows of ``dst`` ``(T, H, D)``."""
        if self.k_span is not None:
            dst[self.k_span] = y[0].permute(1, 0, 2)
        else:
            dst[self.k_index[self.k_valid]] = y.permute(0, 2, 1, 3)[self.k_valid].to(dst.dtype)

    def scatter_lse(self, dst: torch.Tensor, lse: torch.Tensor) -> None:
        """Write ``(n, H, Mq)`` back to the valid columns of ``dst`` ``(H, T)``."""
        if self.q_span is not None:
            dst[:, self.q_span] = lse[0]
        else:
            valid = lse.permute(0, 2, 1)[self.q_valid]
            dst[:, self.q_index[self.q_valid]] = valid.t().to(dst.dtype)

    def gather_lse(self, lse: torch.Tensor, fill: float) -> torch.Tensor:
        """``(H, T)`` -> ``(n, H, Mq)``, padding slots set to ``fill``."""
        if self.q_span is not None:
            return lse[:, self.q_span].unsqueeze(0)
        out = lse[:, self.q_index].permute(1, 0, 2)
        return out.masked_fill(~self.q_valid[:, None, :], fill)

    def mask(self, *, causal: bool) -> torch.Tensor:
        """``(n, 1, Mq, Mk)`` bool: True where a real query may attend a real key."""
        allowed = self.q_valid[:, :, None] & self.k_valid[:, None, :]
        if causal:
            i = torch.arange(self.max_q, device=allowed.device)
            j = torch.arange(self.max_k, device=allowed.device)
            shift = (self.k_lens - self.q_lens)[:, None, None]
            allowed = allowed & (j[None, None, :] <= i[None, :, None] + shift)
        return allowed[:, None]


def padded_batches(
    spec: BlockSpec,
    *,
    device: torch.device,
    max_score_elements: int = 1 << 24,
    solo_score_elements: int = 1 << 14,
) -> list[PaddedBatch]:
    """Group the non-empty sequences of ``spec`` into padded batches (see the module docstring).

    Sequences with no query or no key rows are left out: their rows keep output 0, lse -inf.
    ``max_score_elements`` bounds ``n * Mq * Mk`` of one batch (one sequence is always allowed).
    A sequence with at least ``solo_score_elements`` scores runs alone, unpadded and unmasked:
    its compute dwarfs one more kernel call, while padding and a mask would slow it down (a
    400 + 300 + 450-token pack ran 1.4x slower batched than alone on CPU).
    """
    lens_q, lens_k = spec.seqlens_q, spec.seqlens_k
    classes: dict[tuple[int, int], list[int]] = defaultdict(list)
    batches = []
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq > 0 and lk > 0:
            if lq * lk >= solo_score_elements:
                batches.append(_batch(spec, [i], device))
            else:
                classes[((lq - 1).bit_length(), (lk - 1).bit_length())].append(i)
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
    def rows(cu: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        starts_list = [cu[i] for i in seqs]
        lens_list = [cu[i + 1] - cu[i] for i in seqs]
        starts = torch.tensor(starts_list, dtype=torch.int64, device=device)
        lens = torch.tensor(lens_list, dtype=torch.int64, device=device)
        ar = torch.arange(max(lens_list), device=device)
        valid = ar[None, :] < lens[:, None]
        index = torch.where(valid, starts[:, None] + ar[None, :], starts[:, None])
        return index, valid, lens, lens_list

    q_index, q_valid, q_lens, lq = rows(spec.cu_seqlens_q)
    k_index, k_valid, k_lens, lk = rows(spec.cu_seqlens_k)
    single = len(seqs) == 1
    i = seqs[0]
    return PaddedBatch(
        q_index=q_index,
        q_valid=q_valid,
        k_index=k_index,
        k_valid=k_valid,
        q_lens=q_lens,
        k_lens=k_lens,
        uniform=len(set(lq)) == 1 and len(set(lk)) == 1,
        q_span=slice(spec.cu_seqlens_q[i], spec.cu_seqlens_q[i + 1]) if single else None,
        k_span=slice(spec.cu_seqlens_k[i], spec.cu_seqlens_k[i + 1]) if single else None,
    )
