"""Zigzag sharding of packed THD tensors: pad, split, gather back, and positions for RoPE.

All functions work from ``seqlens``, ``cp`` and the rank index alone (no process group), so the
runtime, the tests and offline tools shard identically. One index map does all the work::

    zigzag_token_index(seqlens=[5], cp=2, rank=0)   padded length 8, chunks of 2
        sequence positions  0 1 | 2 3 | 4 5 | 6 7        (5, 6, 7 are padding)
        rank 0 holds chunks 0 and 3 -> positions [0, 1, 6, 7] -> index [0, 1, -1, -1]
        rank 1 holds chunks 1 and 2 -> positions [2, 3, 4, 5] -> index [2, 3, 4, -1]

``-1`` marks a padding token. Sharding gathers real rows and fills padding with zeros; unsharding
scatters every rank's real rows back into the unpadded packed tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dyncp.plan import padded_length

__all__ = [
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_token_index",
    "zigzag_unshard",
]


def _check(seqlens: Sequence[int], cp: int, rank: int) -> tuple[int, ...]:
    seqlens = tuple(int(s) for s in seqlens)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be an integer >= 1, got {cp!r}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be an index in [0, cp={cp}), got {rank}")
    if not seqlens or min(seqlens) < 1:
        raise ValueError(f"seqlens must be a non-empty list of lengths >= 1, got {seqlens}")
    return seqlens


def zigzag_positions(*, seqlens: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Position within its sequence of every local token (int64, padding continues the count).

    This is what RoPE needs on each rank; padding tokens get positions ``>= length``.
    """
    seqlens = _check(seqlens, cp, rank)
    padded = torch.tensor([padded_length(s, cp) for s in seqlens], dtype=torch.int64)
    local = padded // cp
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqlens)), local)
    starts = torch.cumsum(local, 0) - local
    offset = torch.arange(int(local.sum())) - starts[seq_of_token]
    if cp == 1:
        return offset
    chunk = (padded // (2 * cp))[seq_of_token]
    first = offset < chunk
    return torch.where(first, rank * chunk + offset, (2 * cp - 1 - rank) * chunk + offset - chunk)


def zigzag_token_index(*, seqlens: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """For every local token, its row in the unpadded packed tensor, or -1 for padding (int64)."""
    seqlens = _check(seqlens, cp, rank)
    positions = zigzag_positions(seqlens=seqlens, cp=cp, rank=rank)
    lengths = torch.tensor(seqlens, dtype=torch.int64)
    local = torch.tensor([padded_length(s, cp) // cp for s in seqlens], dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqlens)), local)
    starts = torch.cumsum(lengths, 0) - lengths
    real = positions < lengths[seq_of_token]
    return torch.where(real, starts[seq_of_token] + positions, torch.full_like(positions, -1))


def zigzag_shard(
    x: torch.Tensor, *, seqlens: Sequence[int], cp: int, rank: int, pad_value: float = 0.0
) -> torch.Tensor:
    """This rank's zigzag shard of a packed, unpadded tensor ``x`` (tokens first).

    Args:
        x: ``(sum(seqlens), ...)``, the sequences concatenated in order.
        seqlens: length of each sequence.
        cp: CP size.
        rank: index of this rank in the ring.
        pad_value: value of padding rows (their outputs are ignored; zeros keep them finite).

    Raises:
        ValueError: if ``x`` does not have ``sum(seqlens)`` rows, or a bad cp/rank/seqlens.
    """
    seqlens = _check(seqlens, cp, rank)
    if x.dim() < 1 or x.shape[0] != sum(seqlens):
        raise ValueError(
            f"x must have sum(seqlens)={sum(seqlens)} rows (tokens first), got shape "
            f"{tuple(x.shape)}"
        )
    index = zigzag_token_index(seqlens=seqlens, cp=cp, rank=rank).to(x.device)
    real = index >= 0
    out = x.new_full((index.numel(), *x.shape[1:]), pad_value)
    out[real] = x[index[real]]
    return out


def zigzag_unshard(shards: Sequence[torch.Tensor], *, seqlens: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard`: the packed, unpadded tensor from every rank's shard.

    Args:
        shards: the local tensors of ranks ``0 .. cp-1`` of one ring, in rank order.
        seqlens: length of each sequence.

    Raises:
        ValueError: if a shard does not have the local token count the layout implies, or the
            shards differ in dtype, device or trailing shape.
    """
    cp = len(shards)
    if cp == 0:
        raise ValueError("shards must hold one tensor per rank of the ring, got none")
    seqlens = _check(seqlens, cp, 0)
    first = shards[0]
    out = first.new_empty((sum(seqlens), *first.shape[1:]))
    for rank, shard in enumerate(shards):
        index = zigzag_token_index(seqlens=seqlens, cp=cp, rank=rank).to(first.device)
        if shard.shape[0] != index.numel() or shard.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"shard of rank {rank} has shape {tuple(shard.shape)}; expected "
                f"({index.numel()}, {', '.join(map(str, first.shape[1:]))}) for seqlens at cp={cp}"
            )
        if shard.dtype != first.dtype or shard.device != first.device:
            raise ValueError(
                f"shard of rank {rank} is {shard.dtype} on {shard.device}; shard 0 is "
                f"{first.dtype} on {first.device}: all shards must match"
            )
        real = index >= 0
        out[index[real]] = shard[real]
    return out
