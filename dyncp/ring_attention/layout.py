"""The ring layout: everything ring attention needs to know about one micro-batch on one rank.

A layout is built once per micro-batch (the runtime calls :func:`make_ring_layout`) and passed to
``ring_attention`` explicitly; there is no "current layout" anywhere. It carries the process group
and this rank's place in it (for the send/recv peers), and the cumulative sequence lengths of the
padded global sequences and of this rank's local shards, so that the attention never has to look
at the tensors to work out which token belongs to which sequence.

Zigzag layout of the plan contract (c = ``cp``)::

    sequence (padded to a multiple of 2c):  | 0 | 1 | ... | c-1 | c | ... | 2c-1 |
    rank r holds chunks r and 2c-1-r, in that order:   local = [chunk r, chunk 2c-1-r]
    a packed micro-batch's local tensor: [seq0 local | seq1 local | ...]

With c = 1 nothing is padded and the only rank holds every sequence whole.

``pad_multiple`` pads to a coarser unit (a multiple of 2c): the ring of a hybrid group
(``hybrid.py``) has r ranks but its sequences are padded to a multiple of 2 * (u * r), so that
every rank of the group holds whole chunks of the zigzag at u * r.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from dyncp.plan import padding_multiple

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RingLayout", "make_ring_layout", "pad_to", "padding_unit"]


def padding_unit(cp: int, pad_multiple: int | None) -> int:
    """The multiple sequences are padded to: ``pad_multiple``, or 2 * cp (1 when cp == 1).

    Raises:
        ValueError: ``pad_multiple`` is not a positive multiple of 2 * cp (any positive integer
            when cp == 1).
    """
    need = padding_multiple(cp)
    if pad_multiple is None:
        return need
    whole = isinstance(pad_multiple, int) and not isinstance(pad_multiple, bool)
    if not whole or pad_multiple < 1 or pad_multiple % need:
        raise ValueError(
            f"pad_multiple must be a positive multiple of {need} (2 * cp, or 1 when cp == 1) "
            f"at cp={cp}, got {pad_multiple!r}"
        )
    return pad_multiple


def pad_to(length: int, unit: int) -> int:
    """``length`` rounded up to a multiple of ``unit``."""
    return -(-int(length) // unit) * unit


def _cumsum(values: Sequence[int]) -> tuple[int, ...]:
    return (0, *accumulate(int(v) for v in values))


@dataclass(frozen=True, slots=True)
class RingLayout:
    """One micro-batch's ring on one rank (see the module docstring for the zigzag layout).

    Prefer :func:`make_ring_layout`, which derives every field from the sequence lengths and checks
    the group; the fields are public so tests and tools can read (or deliberately break) them.

    Attributes:
        group: the process group of the ring; ``None`` when ``cp == 1`` (no communication).
        cp: CP size, the number of ranks in the ring.
        rank: this rank's index within the group, ``0 .. cp-1``.
        group_ranks: global ranks of the group in group order (the send/recv peers).
        seqlens: original (unpadded) length of each sequence, in packing order.
        cu_seqlens_padded: cumulative padded global lengths, ``len(seqlens) + 1`` entries.
        cu_seqlens_local: cumulative local lengths on this rank (``padded / cp`` per sequence).
        max_seqlen_padded: longest padded global sequence.
        max_seqlen_local: longest local shard of one sequence.
        pad_multiple: sequences are padded to a multiple of this; ``None`` (the default): the
            plan's 2 * cp (no padding when cp == 1). See :func:`padding_unit`.

    Raises:
        ValueError: if the fields are inconsistent with each other (names the field).
    """

    group: ProcessGroup | None
    cp: int
    rank: int
    group_ranks: tuple[int, ...]
    seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]
    cu_seqlens_local: tuple[int, ...]
    max_seqlen_padded: int
    max_seqlen_local: int
    pad_multiple: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"RingLayout.cp must be an integer >= 1, got {self.cp!r}")
        if not 0 <= self.rank < self.cp:
            raise ValueError(f"RingLayout.rank must be in [0, cp={self.cp}), got {self.rank}")
        if len(self.group_ranks) != self.cp or len(set(self.group_ranks)) != self.cp:
            raise ValueError(
                f"RingLayout.group_ranks must list cp={self.cp} distinct global ranks, "
                f"got {self.group_ranks}"
            )
        if (self.group is None) != (self.cp == 1):
            raise ValueError(
                f"RingLayout.group must be None exactly when cp == 1 (cp={self.cp}, "
                f"group={'None' if self.group is None else 'given'})"
            )
        if not self.seqlens or any(int(s) < 1 for s in self.seqlens):
            raise ValueError(
                f"RingLayout.seqlens must be a non-empty list of lengths >= 1, got {self.seqlens}"
            )
        unit = padding_unit(self.cp, self.pad_multiple)
        padded = [pad_to(s, unit) for s in self.seqlens]
        expected = {
            "cu_seqlens_padded": _cumsum(padded),
            "cu_seqlens_local": _cumsum(p // self.cp for p in padded),
            "max_seqlen_padded": max(padded),
            "max_seqlen_local": max(padded) // self.cp,
        }
        for name, value in expected.items():
            got = getattr(self, name)
            got = tuple(got) if name.startswith("cu") else got
            if got != value:
                raise ValueError(
                    f"RingLayout.{name}={got} does not match seqlens={self.seqlens} at "
                    f"cp={self.cp}: expected {value}"
                )

    @property
    def unit(self) -> int:
        """The multiple every sequence is padded to (see :func:`padding_unit`)."""
        return padding_unit(self.cp, self.pad_multiple)

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def local_tokens(self) -> int:
        """Rows of the local q/k/v tensors (padding included); equal on every rank of the ring."""
        return self.cu_seqlens_local[-1]

    @property
    def next_rank(self) -> int:
        """Global rank this rank sends K/V to (the next one in the ring)."""
        return self.group_ranks[(self.rank + 1) % self.cp]

    @property
    def prev_rank(self) -> int:
        """Global rank this rank receives K/V from (the previous one in the ring)."""
        return self.group_ranks[(self.rank - 1) % self.cp]


def make_ring_layout(
    *,
    seqlens: Sequence[int],
    cp: int,
    group: ProcessGroup | None = None,
    rank: int | None = None,
    pad_multiple: int | None = None,
) -> RingLayout:
    """Build the layout of one micro-batch for this rank.

    Args:
        seqlens: original length of each packed sequence, in packing order (each >= 1).
        cp: CP size of the micro-batch.
        group: the ring's process group (size ``cp``); must be ``None`` when ``cp == 1``.
        rank: this process's *global* rank; defaults to ``torch.distributed.get_rank()`` (or 0
            when ``cp == 1``). Its index within ``group`` becomes ``RingLayout.rank``.
        pad_multiple: pad sequences to a multiple of this instead of 2 * cp (a multiple of it).

    Returns:
        The frozen :class:`RingLayout`.

    Raises:
        ValueError: bad lengths or cp, a missing or superfluous group, a group whose size is not
            ``cp``, or a group that does not contain this rank.
    """
    seqlens = tuple(int(s) for s in seqlens)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be an integer >= 1, got {cp!r}")
    if not seqlens or min(seqlens) < 1:
        raise ValueError(f"seqlens must be a non-empty list of lengths >= 1, got {seqlens}")
    unit = padding_unit(cp, pad_multiple)
    if cp == 1:
        if group is not None:
            raise ValueError("cp == 1 runs without communication: pass group=None")
        group_ranks: tuple[int, ...] = (0 if rank is None else int(rank),)
        index = 0
    else:
        group_ranks, index = _locate(group=group, cp=cp, rank=rank)
    padded = [pad_to(s, unit) for s in seqlens]
    return RingLayout(
        group=group,
        cp=cp,
        rank=index,
        group_ranks=group_ranks,
        seqlens=seqlens,
        cu_seqlens_padded=_cumsum(padded),
        cu_seqlens_local=_cumsum(p // cp for p in padded),
        max_seqlen_padded=max(padded),
        max_seqlen_local=max(padded) // cp,
        pad_multiple=pad_multiple,
    )


def _locate(
    *, group: ProcessGroup | None, cp: int, rank: int | None
) -> tuple[tuple[int, ...], int]:
    """The group's global ranks and this rank's index in it, or a ValueError saying why not."""
    import torch.distributed as dist

    if group is None:
        raise ValueError(f"cp={cp} > 1 needs the ring's process group, got group=None")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"cp={cp} > 1 needs an initialised torch.distributed process group")
    if rank is None:
        rank = dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"the group passed for cp={cp} does not contain this rank ({rank})")
    group_ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    if len(group_ranks) != cp:
        raise ValueError(f"group has {len(group_ranks)} ranks {group_ranks} but cp={cp}")
    if rank not in group_ranks:
        raise ValueError(f"group {group_ranks} does not contain this rank ({rank})")
    return group_ranks, group_ranks.index(rank)
