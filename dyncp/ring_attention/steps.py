"""Which local queries attend which keys at each ring step: the zigzag causal schedule.

Rank r holds query chunks (r, 2c-1-r) of every sequence; at each step it holds the K/V chunks
(s, 2c-1-s) of one source rank s. With causal attention::

    s == r   diagonal: the local block attends to itself, causally
    s <  r   every local query attends to the first K/V chunk (chunk s) only, in full
    s >  r   only the second query chunk (2c-1-r) attends, to both K/V chunks, in full

    chunk order of one sequence (c = 2):   0  1  2  3       rank 0: q chunks 0, 3
    rank 0, s = 1 (s > r): q chunk 3 sees k chunks 1, 2      rank 1: q chunks 1, 2
    rank 1, s = 0 (s < r): q chunks 1, 2 see k chunk 0

Off the diagonal every step is two chunks by one (or one by two): the same work on every rank at
every step. Without causality every step is the whole local block against the whole K/V block.

Padding (the tail of each padded sequence) is cut out here rather than masked in the kernels:
in both local chunks the real tokens form a prefix of the concatenation (if chunk 2c-1-s has a
real token, chunk s is all real), so each sequence's real queries and real keys are one
contiguous run of rows. Padding rows are never queried and never keys, so they influence
nothing; sequences with no real queries or keys at a step are left out of that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dyncp.ring_attention.block import BlockSpec
from dyncp.ring_attention.layout import pad_to, padding_unit

__all__ = ["RingStep", "zigzag_steps"]


@dataclass(frozen=True, slots=True)
class RingStep:
    """This rank's work with the K/V block of ``source``.

    ``q_rows`` / ``k_rows`` select, in order, the local query rows and the K/V block rows the
    kernel sees (``None``: all rows, unchanged); ``spec`` splits the selected rows by sequence.
    """

    source: int
    q_rows: torch.Tensor | None
    k_rows: torch.Tensor | None
    spec: BlockSpec

    @property
    def empty(self) -> bool:
        return self.spec.num_seqs == 0


def _rows(
    starts: Sequence[int], counts: Sequence[int], *, total: int, device: torch.device
) -> torch.Tensor | None:
    """Concatenated ranges ``[start, start + count)`` as an index, or None if it is 0..total-1."""
    covered = sum(counts)
    if covered == total and all(a == b for a, b in zip(starts, _prefix(counts))):
        return None
    counts_t = torch.tensor(counts, dtype=torch.int64)
    shift = torch.tensor(starts, dtype=torch.int64) - (torch.cumsum(counts_t, 0) - counts_t)
    index = torch.repeat_interleave(shift, counts_t) + torch.arange(covered)
    return index.to(device)


def _prefix(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def zigzag_steps(
    *,
    seqlens: Sequence[int],
    cp: int,
    rank: int,
    causal: bool,
    device: torch.device,
    pad_multiple: int | None = None,
) -> list[RingStep]:
    """The ring step for every source rank (indexed by source), for rank ``rank`` of the ring.

    Only lengths, cp, the padding unit (``RingLayout.pad_multiple``; default 2 * cp) and the
    rank index matter (as for sharding), so the schedule can be built and checked without a
    process group. A coarser unit only makes the chunks longer; with cp == 1 each sequence's
    real tokens are still the prefix of its padded rows.
    """
    c, r = cp, rank
    unit = padding_unit(c, pad_multiple)
    padded = [pad_to(length, unit) for length in seqlens]
    local_offsets = _prefix([p // c for p in padded])
    local_tokens = sum(padded) // c
    steps = []
    for s in range(c):
        q_starts, q_counts, k_starts, k_counts = [], [], [], []
        for length, pad, off in zip(seqlens, padded, local_offsets):
            if c == 1:
                q0, nq, k0, nk = off, length, off, length
            else:
                m = pad // (2 * c)
                q0, nq = off, _real(r, length, m) + _real(2 * c - 1 - r, length, m)
                k0, nk = off, _real(s, length, m) + _real(2 * c - 1 - s, length, m)
                if causal and s < r:
                    nk = _real(s, length, m)
                elif causal and s > r:
                    q0, nq = off + m, _real(2 * c - 1 - r, length, m)
            if nq > 0 and nk > 0:
                q_starts.append(q0)
                q_counts.append(nq)
                k_starts.append(k0)
                k_counts.append(nk)
        spec = BlockSpec(
            cu_seqlens_q=tuple(_cumulative(q_counts)),
            cu_seqlens_k=tuple(_cumulative(k_counts)),
            causal=causal and s == r,
        )
        steps.append(
            RingStep(
                source=s,
                q_rows=_rows(q_starts, q_counts, total=local_tokens, device=device),
                k_rows=_rows(k_starts, k_counts, total=local_tokens, device=device),
                spec=spec.on(device) if device.type != "cpu" else spec,
            )
        )
    return steps


def _real(chunk: int, length: int, m: int) -> int:
    """Real (non-padding) tokens in chunk ``chunk`` of ``m`` tokens of a sequence of ``length``."""
    return min(max(length - chunk * m, 0), m)


def _cumulative(counts: Sequence[int]) -> list[int]:
    return [*_prefix(counts), sum(counts)]
