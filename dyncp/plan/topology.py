"""Topology: the ranks a plan schedules, the group sizes and head splits they allow, what fits.

The memory rules of the contract (``memory_tokens``, ``fits``, ``min_cp``) are methods here
because they need only the machine and the padding rule (``dyncp.plan.padding``), not a plan: the
planners ask them long before a plan exists. Placement (``dyncp.plan.menu``): a group of size c
lies inside one NVLink domain of ``ranks_per_node`` ranks, on an aligned block counted from the
domain's first rank, or spans whole domains on a block aligned to c. With a power-of-two domain
and world this is the aligned block ``[k*c, (k+1)*c)`` of earlier versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dyncp.plan.menu import (
    check_sizes,
    domain_size,
    is_placement,
    menu_sizes,
    placements,
    split_allowed,
)
from dyncp.plan.padding import padded_length, padding_multiple

__all__ = ["PLACEMENT", "Topology"]

#: The placement rule of version 3 plans (the only one; see ``dyncp.plan.menu``).
PLACEMENT = "domain"


@dataclass(frozen=True, slots=True)
class Topology:
    """The ranks a plan schedules and what each can hold.

    Args:
        world: number of ranks on the DP x CP axis.
        ranks_per_node: ranks sharing one NVLink domain (a node, or a whole NVL72 rack);
            ``world`` is a multiple of it (whole domains) or at most it (one domain, partly
            used).
        capacity: tokens per rank one micro-batch may hold (after zigzag padding).
        group_sizes: the menu of allowed CP sizes: any sizes the placement rules of
            ``dyncp.plan.menu`` allow (inside one domain, or whole domains), e.g.
            ``menu_sizes("divisors", world=576, ranks_per_node=72)``. Default: every power of
            two dividing ``world`` that the rules allow (the sizes dyncp always used).
        head_sizes: allowed head-parallel degrees u of a group (u ranks exchange heads by
            all-to-all, ``size // u`` form the ring); 1 always included. A group of c may use u
            when u divides c and its head blocks stay inside a domain (``split_allowed``).
            Default ``(1,)``: rings only.
        query_heads, kv_heads: the model's attention heads; required (> 0) when a head size
            above 1 is allowed, since u must divide the query heads, and the KV heads must be
            divisible by u or divide it (KV heads fewer than u are replicated: rank j of a
            head group holds KV head ``j // (u // kv_heads)``). 0: not given.
        placement: the placement rule's name; ``"domain"``, the only one (``dyncp.plan.menu``).
    """

    world: int
    ranks_per_node: int
    capacity: int
    group_sizes: tuple[int, ...] = ()
    head_sizes: tuple[int, ...] = (1,)
    query_heads: int = 0
    kv_heads: int = 0
    placement: str = PLACEMENT

    def __post_init__(self) -> None:
        if self.placement != PLACEMENT:
            raise ValueError(
                f"Topology.placement {self.placement!r} unknown; the placement rule is "
                f"{PLACEMENT!r} (see dyncp.plan.menu)"
            )
        for name in ("world", "ranks_per_node", "capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive integer, got {value!r}")
        if self.world > self.ranks_per_node and self.world % self.ranks_per_node:
            raise ValueError(
                f"Topology.world={self.world} is not a whole number of nodes of "
                f"ranks_per_node={self.ranks_per_node}: give a multiple of {self.ranks_per_node} "
                "(or a single node's ranks, world <= ranks_per_node)"
            )
        if not self.group_sizes:
            sizes = menu_sizes(
                "powers-of-two", world=self.world, ranks_per_node=self.ranks_per_node
            )
        else:
            try:
                sizes = check_sizes(
                    self.group_sizes, world=self.world, ranks_per_node=self.ranks_per_node
                )
            except ValueError as exc:
                raise ValueError(f"Topology.group_sizes: {exc}") from None
        object.__setattr__(self, "group_sizes", sizes)
        self._check_heads()

    def _check_heads(self) -> None:
        for name in ("query_heads", "kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Topology.{name} must be an integer >= 0, got {value!r}")
        heads = tuple(sorted({1, *(int(u) for u in self.head_sizes)}))
        bad = [u for u in heads if u < 1 or u > self.max_group_size]
        if bad:
            raise ValueError(
                f"Topology.head_sizes {bad} not allowed: each must be in [1, largest group size "
                f"{self.max_group_size}]"
            )
        object.__setattr__(self, "head_sizes", heads)
        unused = [u for u in heads if not any(u in self.splits(c) for c in self.group_sizes)]
        if unused:
            raise ValueError(
                f"Topology.head_sizes {unused} split no allowed group: a group of c ranks may "
                "split u ways when u divides c and each head block of u ranks stays inside one "
                f"domain of {self.domain} ranks or spans whole domains (group sizes "
                f"{list(self.group_sizes)})"
            )
        if heads == (1,):
            return
        q, kv = self.query_heads, self.kv_heads
        if q < 1 or kv < 1:
            raise ValueError(
                f"Topology.head_sizes {list(heads)} split heads, so query_heads and kv_heads "
                f"must be given (> 0); got query_heads={q}, kv_heads={kv}"
            )
        if q % kv:
            raise ValueError(f"Topology.kv_heads={kv} must divide query_heads={q}")
        wrong = [u for u in heads if q % u or (kv % u and u % kv)]
        if wrong:
            raise ValueError(
                f"Topology.head_sizes {wrong} do not fit the heads: each u must divide "
                f"query_heads={q}, and kv_heads={kv} must be divisible by u or divide it"
            )

    @property
    def max_group_size(self) -> int:
        return self.group_sizes[-1]

    @property
    def domain(self) -> int:
        """Ranks of one NVLink domain on this axis (``min(ranks_per_node, world)``)."""
        return domain_size(self.world, self.ranks_per_node)

    def placements(self, size: int) -> tuple[int, ...]:
        """First ranks of the blocks a group of ``size`` may occupy (``dyncp.plan.menu``)."""
        return placements(size, world=self.world, ranks_per_node=self.ranks_per_node)

    def is_placement(self, start: int, size: int) -> bool:
        """Whether ``[start, start + size)`` is a block the rules allow for an allowed size."""
        return size in self.group_sizes and is_placement(
            start, size, world=self.world, ranks_per_node=self.ranks_per_node
        )

    def memory_tokens(self, lengths: Sequence[int], cp: int) -> int:
        """Tokens per rank of a micro-batch of ``lengths`` at CP size ``cp`` (padding included)."""
        unit = padding_multiple(cp)  # (``padded_length`` summed, without a call per sequence)
        ints = map(int, lengths)
        total = sum(ints) if unit == 1 else unit * sum(-(-s // unit) for s in ints)
        return -(-total // cp)

    def fits(self, lengths: Sequence[int], cp: int) -> bool:
        return self.memory_tokens(lengths, cp) <= self.capacity

    def min_cp(self, length: int) -> int | None:
        """Smallest allowed CP size that can hold ``length`` alone, or None if none can."""
        for cp in self.group_sizes:
            if padded_length(length, cp) <= cp * self.capacity:
                return cp
        return None

    def max_length(self) -> int:
        """Longest sequence any allowed group can hold (0 if none holds even one token)."""
        units = ((cp, padding_multiple(cp)) for cp in self.group_sizes)
        return max(cp * self.capacity // unit * unit for cp, unit in units)

    def splits(self, size: int) -> tuple[int, ...]:
        """Head-parallel degrees u a group of ``size`` ranks may use (u divides size)."""
        return tuple(
            u
            for u in self.head_sizes
            if split_allowed(size, u, world=self.world, ranks_per_node=self.ranks_per_node)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "ranks_per_node": self.ranks_per_node,
            "capacity": self.capacity,
            "group_sizes": list(self.group_sizes),
            "head_sizes": list(self.head_sizes),
            "query_heads": self.query_heads,
            "kv_heads": self.kv_heads,
            "placement": self.placement,
        }
