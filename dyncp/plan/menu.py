"""Group-size menus shaped by the machine, and where each size may be placed.

A job's DP x CP axis of ``world`` ranks is cut into NVLink **domains** of ``ranks_per_node``
ranks (a node of 4 or 8 GPUs, or a whole GB200 NVL72 rack of 72): ``domain = min(ranks_per_node,
world)``, and the domains are ``[d*domain, (d+1)*domain)``. A CP group is one of three kinds:

* **inside a domain** (``c <= domain``): the blocks ``[d*domain + k*c, d*domain + (k+1)*c)`` with
  ``(k+1)*c <= domain``, i.e. aligned blocks counted from each domain's first rank. When c
  divides the domain these are exactly the aligned blocks ``[k*c, (k+1)*c)`` of the world (the
  rule dyncp always had). When it does not (3 in a domain of 8, 64 in a domain of 72) each domain
  holds ``domain // c`` groups of c and its last ``domain % c`` ranks serve smaller sizes only.
  We define these placements rather than refuse the size because they are what the hardware
  allows: a 64-rank ring on an NVL72 keeps all its traffic on NVLink, and refusing it would leave
  the 72-rank world without any power-of-two ring above 8.
* **whole domains** (``c > domain``): c must be a multiple of the domain; the blocks are aligned
  to c, ``[k*c, (k+1)*c)`` with ``(k+1)*c <= world``, so each spans ``c // domain`` whole domains.
* anything else (c > domain and not a multiple of it, or c > world) is refused: such a group
  would straddle a domain boundary without owning the domains it touches.

These rules keep every group's ranks either on one NVLink domain or on whole domains, keep the
number of blocks of each size at most ``world // c`` (each rank is in at most one block per size,
so a pool needs at most one communicator per size per rank), and reduce to the old aligned
power-of-two blocks whenever the domain and the world are powers of two.

Menus (:func:`menu_sizes`): ``"powers-of-two"`` (the default: every power of two dividing the
world that the rules allow -- the sizes dyncp used before menus), ``"divisors"`` (every divisor of
the domain, plus whole-domain multiples ``m * domain`` for each m dividing ``world // domain``),
``"divisors-and-powers-of-two"`` (those and every power of two up to the domain: a superset of
the powers of two the domain holds, e.g. 16, 32, 64 on an NVL72), or an explicit list checked by
:func:`check_sizes`.

Torch-free: the planner, the simulator and the pool's communicator count all use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "MENU_KINDS",
    "NCCL_BUFFSIZE_BYTES",
    "PoolCount",
    "check_sizes",
    "domain_size",
    "is_placement",
    "menu_sizes",
    "placements",
    "pool_blocks",
    "split_allowed",
    "pool_count",
]

MENU_KINDS = ("powers-of-two", "divisors", "divisors-and-powers-of-two")

#: NCCL's default ``NCCL_BUFFSIZE``: 4194304 bytes (4 MiB), "the size of the buffer used by NCCL
#: when communicating data between pairs of GPUs" (NCCL user guide, Environment Variables,
#: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize).
NCCL_BUFFSIZE_BYTES = 4 * 1024 * 1024


def domain_size(world: int, ranks_per_node: int) -> int:
    """Ranks of one NVLink domain on this axis (a partly used single node is one domain)."""
    return min(int(ranks_per_node), int(world))


def _size_error(world: int, domain: int, c: int) -> str | None:
    if c < 1 or c > world:
        return f"{c} is not in [1, world={world}]"
    if c > domain and c % domain:
        return (
            f"{c} is larger than the domain of {domain} ranks but not a multiple of it "
            "(a group never straddles a domain unless it spans whole domains)"
        )
    return None


def check_sizes(sizes: Iterable[int], *, world: int, ranks_per_node: int) -> tuple[int, ...]:
    """The sizes, sorted and deduplicated, after checking each against the placement rules.

    Raises:
        ValueError: a size is not an integer, or no placement rule allows it; the message names
            every such size and the rule.
    """
    raw = list(sizes)
    wrong_type = [s for s in raw if not isinstance(s, int) or isinstance(s, bool)]
    if wrong_type:
        raise ValueError(f"group sizes must be integers, got {wrong_type}")
    domain = domain_size(world, ranks_per_node)
    out = tuple(sorted(set(raw)))
    bad = {c: msg for c in out if (msg := _size_error(world, domain, c))}
    if bad:
        raise ValueError(
            f"group sizes {list(bad)} not allowed for world={world}, "
            f"ranks_per_node={ranks_per_node}: " + "; ".join(bad.values())
        )
    return out


def menu_sizes(kind: str, *, world: int, ranks_per_node: int) -> tuple[int, ...]:
    """The menu of ``kind`` (see the module docstring) for this machine, 1 included.

    Raises:
        ValueError: an unknown kind (the message lists :data:`MENU_KINDS`).
    """
    domain = domain_size(world, ranks_per_node)
    if kind == "powers-of-two":
        cands: Iterable[int] = (1 << k for k in range(world.bit_length()) if world % (1 << k) == 0)
    elif kind in ("divisors", "divisors-and-powers-of-two"):
        inside = [c for c in range(1, domain + 1) if domain % c == 0]
        if kind == "divisors-and-powers-of-two":
            inside += [1 << k for k in range(domain.bit_length())]
        domains = world // domain
        cands = inside + [m * domain for m in range(2, domains + 1) if domains % m == 0]
    else:
        raise ValueError(f"menu kind {kind!r} unknown; choose one of {list(MENU_KINDS)}")
    return tuple(c for c in sorted(set(cands)) if _size_error(world, domain, c) is None)


def placements(size: int, *, world: int, ranks_per_node: int) -> tuple[int, ...]:
    """First ranks of every block a group of ``size`` may occupy, ascending (rules above).

    Raises:
        ValueError: no rule allows ``size``.
    """
    domain = domain_size(world, ranks_per_node)
    msg = _size_error(world, domain, size)
    if msg:
        raise ValueError(f"group size {msg}")
    if size > domain:
        return tuple(range(0, world - size + 1, size))
    per = domain // size
    return tuple(d + k * size for d in range(0, world, domain) for k in range(per))


def split_allowed(size: int, heads: int, *, world: int, ranks_per_node: int) -> bool:
    """Whether a group of ``size`` may split ``heads`` x ``size // heads``: u divides the size and
    each head block (u contiguous ranks) stays inside one domain or spans whole domains."""
    domain = domain_size(world, ranks_per_node)
    if heads < 1 or size % heads:
        return False
    return size <= domain or domain % heads == 0 or heads % domain == 0


def is_placement(start: int, size: int, *, world: int, ranks_per_node: int) -> bool:
    """Whether ``[start, start + size)`` is one of :func:`placements` (size assumed allowed)."""
    domain = domain_size(world, ranks_per_node)
    if size < 1 or not 0 <= start <= world - size:
        return False
    if size > domain:
        return start % size == 0
    offset = start % domain
    return offset % size == 0 and offset + size <= domain


def pool_blocks(
    sizes: Sequence[int], heads: Sequence[int], *, world: int, ranks_per_node: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int, int, int]]]:
    """Every communicator a pool needs, in creation order.

    Returns ``(blocks, head_blocks, rings)``: ``blocks`` the ``(start, size)`` of every placement
    of every size > 1 (sizes ascending, starts ascending); ``head_blocks`` the ``(first, u)`` head
    groups of hybrid splits that are not already a block (u ascending, first ascending); ``rings``
    the ``(start, size, u, j)`` ring sub-groups (ranks ``start + j + i*u``) of every split
    ``1 < u < size`` with u dividing the size (size, u, start, j ascending).
    """
    blocks = [
        (s, c)
        for c in sizes
        if c > 1
        for s in placements(c, world=world, ranks_per_node=ranks_per_node)
    ]
    have = set(blocks)
    wanted: set[tuple[int, int]] = set()
    rings: list[tuple[int, int, int, int]] = []
    for c in sizes:
        for u in heads:
            if u < 2 or not split_allowed(c, u, world=world, ranks_per_node=ranks_per_node):
                continue
            for s in placements(c, world=world, ranks_per_node=ranks_per_node):
                wanted.update((s + i * u, u) for i in range(c // u))
                if u < c:
                    rings += [(s, c, u, j) for j in range(u)]
    head_blocks = sorted(wanted - have, key=lambda b: (b[1], b[0]))
    return blocks, head_blocks, rings


@dataclass(frozen=True, slots=True)
class PoolCount:
    """How many communicators a pool builds and what their buffers may hold.

    Attributes:
        total: communicators created over the whole axis (each is one NCCL communicator on each
            of its members).
        per_rank_max: the most communicators any one rank belongs to.
        per_rank: communicators each rank belongs to.
        buffer_bytes_per_rank: ``per_rank_max * peers * channels * NCCL_BUFFSIZE``: an upper
            estimate of the NCCL staging buffers on the busiest rank if every communicator
            connects ``peers`` peers on ``channels`` channels at NCCL's default buffer size. An
            estimate from NCCL's documented default, not a measurement; NCCL connects peers on
            first use, so communicators a job never uses cost less.
    """

    total: int
    per_rank_max: int
    per_rank: tuple[int, ...]
    buffer_bytes_per_rank: int


def pool_count(
    sizes: Sequence[int],
    heads: Sequence[int] = (1,),
    *,
    world: int,
    ranks_per_node: int,
    peers: int = 2,
    channels: int = 1,
    buffsize: int = NCCL_BUFFSIZE_BYTES,
) -> PoolCount:
    """Count a pool's communicators without creating any (what :class:`GroupPool` builds).

    ``peers`` = 2 because a ring rank sends to one neighbour and receives from the other;
    ``channels`` is how many NCCL channels each peer connection uses (an assumption the caller
    states; NCCL picks it per topology).
    """
    blocks, head_blocks, rings = pool_blocks(
        sizes, heads, world=world, ranks_per_node=ranks_per_node
    )
    per = [0] * world
    for s, c in (*blocks, *head_blocks):
        for r in range(s, s + c):
            per[r] += 1
    for s, c, u, j in rings:
        for r in range(s + j, s + c, u):
            per[r] += 1
    top = max(per, default=0)
    return PoolCount(
        total=len(blocks) + len(head_blocks) + len(rings),
        per_rank_max=top,
        per_rank=tuple(per),
        buffer_bytes_per_rank=top * peers * channels * buffsize,
    )
