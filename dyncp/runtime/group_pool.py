"""GroupPool: every communicator a plan can need, created once, in one order, on every rank.

Creating a process group is a collective over the whole job and costs milliseconds to seconds on
NCCL, so switching layouts must never create one. The pool builds, at start-up, one group for
every block the placement rules allow (``dyncp.plan.menu``: inside one NVLink domain of
``ranks_per_node`` ranks, or on whole domains) of every allowed CP size c > 1 (size 1 needs no
ring), on the DP x CP axis -- either the whole world or a sub-world of a larger job with TP/PP,
given as the list of its global ranks in DP x CP order. All ranks of the job must construct the
pool (group creation is collective) with the same arguments; groups are created in the same order
everywhere: sizes ascending, blocks ascending. Without ``ranks_per_node`` the axis is one domain
and the blocks are the aligned ``[k*c, (k+1)*c)``.

Hybrid groups (``head_sizes``): a group of c ranks split u x r (u ranks exchanging heads, r in a
ring) needs its head sub-groups, the u-blocks ``start + i*u`` of each of its blocks (the block
groups of size u when those are blocks of an allowed size; for r == 1 the head group is the block
group itself), and its ring sub-groups, ranks ``{start + i*u + j : i < r}`` for each head index j
(stride u). After the block groups the pool creates the head blocks not already built (u
ascending, blocks ascending), then the ring sub-groups of every allowed c and u with 1 < u < c
(c ascending, u ascending, blocks ascending, j ascending). u need not be a power of two (a group
of 6 may run 2 x 3 or 3 x 2, one of 12 4 x 3).

How many, and what they cost: :func:`dyncp.plan.menu.pool_count` counts the communicators without
creating any (the pool builds exactly those, ``count``). Each rank is in at most one block per
size, so a menu of m sizes costs at most m - 1 ring communicators per rank (plus head and ring
sub-groups). NCCL stages point-to-point traffic in buffers of ``NCCL_BUFFSIZE`` bytes, 4 MiB by
default ("the size of the buffer used by NCCL when communicating data between pairs of GPUs",
NCCL user guide, Environment Variables), per connected peer and channel; a ring rank connects 2
peers, so the busiest rank holds at most ``count.buffer_bytes_per_rank`` (14 communicators x 2
peers x 4 MiB = 112 MiB per channel at 576 ranks with the divisors-of-72 menu, against 48 MiB for
powers of two). NCCL connects peers on first use, so communicators a job never runs cost less.

Creation stays cheap on NCCL with ``torch.distributed.split_group``: the blocks of one size are
disjoint, so all of them come from ONE split of the job's communicator (``ncclCommSplit``: the
children reuse the parent's bootstrap, no new rendezvous), one call per family -- the blocks of a
size, the head blocks of a u, the ring sub-groups of a (c, u) -- instead of one bootstrap per
group (``creation_calls`` counts them: 14 for the 991 groups of 576 ranks above). gloo and older
torch use ``new_group`` per group. Each group this rank belongs to is warmed up with a tiny
all_reduce, so the first training step does not pay for lazy communicator initialisation.

Failures are bounded by one timeout: every group the pool creates (rings, and a CPU ``gloo``
control group over the axis for plan agreement and status exchange) uses ``timeout`` seconds,
by default the job's own (the default process group's), never torch's 30-minute default. The
pool also holds a namespace in the job's Store where a failing rank leaves its signed error
report (:meth:`GroupPool.board`), so that every rank can name it even when collectives with it
time out or break.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dyncp.control.failures import FailureBoard, shared_secret
from dyncp.control.job import job_timeout
from dyncp.plan.menu import (
    PoolCount,
    check_sizes,
    is_placement,
    menu_sizes,
    pool_blocks,
    pool_count,
    split_allowed,
)

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["GroupPool"]


class GroupPool:
    """Pre-built process groups for every allowed block of every allowed CP size.

    Args:
        ranks: global ranks of the DP x CP axis in order (default: the whole world).
        group_sizes: the menu of CP sizes (default: every power of two dividing ``len(ranks)``
            that the placement rules allow); the plan's ``topology.group_sizes``.
        ranks_per_node: ranks of one NVLink domain on the axis, the plan's
            ``topology.ranks_per_node`` (default: the whole axis is one domain).
        head_sizes: allowed head-parallel degrees u (1 always included, each splitting some
            allowed size, ``dyncp.plan.menu.split_allowed``); see the module docstring.
        warmup: run one all_reduce on each own group right away.
        timeout: seconds after which a collective on the pool's groups fails (default: the
            job's timeout, see :func:`job_timeout`).
        store: where failing ranks leave their error (default: the job's Store).

    Attributes:
        world: size of the DP x CP axis; ``position``: this rank's index on it (None if absent).
        created: number of groups created; ``creation_seconds``: wall time of creating them.
        count: what was created, counted by ``dyncp.plan.menu.pool_count`` (total, per rank, the
            NCCL buffer estimate); ``creation_calls``: collective creation calls made (one per
            family of disjoint groups with ``split_group`` on NCCL, one per group otherwise).
        axis_group: a group over the whole axis (None when the axis is the whole job).
        control_group: a gloo group over the axis (the board's secret; the plan agreement on
            gloo jobs).
        agreement_group, agreement_device: where ``execute`` compares plan digests (the device
            group on NCCL, the control group on gloo).
        timeout: the groups' timeout in seconds.
        store: a Store namespace of this pool (shared by its ranks).
        calls: ``execute`` calls so far on this rank (every rank counts the same).
        last_call: (call number, number of waves) of the last ``execute`` on this rank, for
            naming a failure found at the gradient reduction after it.

    Raises:
        ValueError: bad ranks, group sizes, head sizes or timeout.
    """

    def __init__(
        self,
        *,
        ranks: Sequence[int] | None = None,
        group_sizes: Sequence[int] | None = None,
        ranks_per_node: int | None = None,
        head_sizes: Sequence[int] = (1,),
        warmup: bool = True,
        timeout: float | None = None,
        store: Store | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupPool needs torch.distributed to be initialised first")
        job = dist.get_world_size()
        self.ranks = tuple(range(job)) if ranks is None else tuple(int(r) for r in ranks)
        bad = [r for r in self.ranks if not 0 <= r < job]
        if bad or len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(
                f"GroupPool ranks must be distinct global ranks in [0, {job}), got {list(ranks)}"
            )
        self.world = len(self.ranks)
        rpn = self.world if ranks_per_node is None else int(ranks_per_node)
        if rpn < 1 or (self.world > rpn and self.world % rpn):
            raise ValueError(
                f"GroupPool ranks_per_node={ranks_per_node} must be >= 1 and divide the DP x CP "
                f"axis of {self.world} ranks (or be at least it)"
            )
        self.ranks_per_node = rpn
        if group_sizes is None:
            group_sizes = menu_sizes("powers-of-two", world=self.world, ranks_per_node=rpn)
        self.group_sizes = check_sizes(
            [int(c) for c in group_sizes], world=self.world, ranks_per_node=rpn
        )
        heads = sorted({1, *(int(u) for u in head_sizes)})
        wrong = [
            u
            for u in heads
            if not any(
                split_allowed(c, u, world=self.world, ranks_per_node=rpn) for c in self.group_sizes
            )
        ]
        if wrong:
            raise ValueError(
                f"head sizes {wrong} not allowed: each must split some group size (divide it, "
                f"head blocks inside one domain of {min(rpn, self.world)} ranks or on whole "
                f"domains; group sizes {list(self.group_sizes)})"
            )
        self.head_sizes = tuple(heads)
        me = dist.get_rank()
        self.position = self.ranks.index(me) if me in self.ranks else None
        self.backend = dist.get_backend()
        self.timeout = job_timeout() if timeout is None else timeout
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"GroupPool timeout must be > 0 seconds, got {timeout!r}")
        kwargs = {"timeout": datetime.timedelta(seconds=self.timeout)}
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        self._head_blocks: dict[tuple[int, int], dist.ProcessGroup] = {}
        self._rings: dict[tuple[int, int, int], dist.ProcessGroup] = {}
        start = time.perf_counter()
        self.axis_group = self._new_group(list(self.ranks), kwargs) if self.world < job else None
        self.control_group = dist.new_group(ranks=list(self.ranks), backend="gloo", **kwargs)
        base = dist.distributed_c10d._get_default_store() if store is None else store
        # Keep the given Store itself alive: the PrefixStore holds it only on the C++ side, so a
        # Python subclass would be collected and its overrides then fail ("pure virtual").
        self._base_store = base
        self.store: Store | None = None
        self._board_secret = b""
        if self.position is not None:  # a rank off the axis builds the groups and nothing else
            self.store = dist.PrefixStore(f"dyncp/pool/{self.control_group.group_name}/", base)
            self._board_secret = shared_secret(self.control_group)
        self.calls = 0
        self.last_call = (-1, 0)  # (call number, waves) of the last execute on this rank
        # The per-step plan agreement: one all_reduce, on the device group where there is one
        # (NCCL: tree latency, logarithmic in the ranks), else on the gloo control group.
        if self.backend == "nccl":
            self.agreement_group = self.axis_group or dist.group.WORLD
            self.agreement_device: torch.device = torch.device("cuda")  # the current device
        else:
            self.agreement_group = self.control_group
            self.agreement_device = torch.device("cpu")
        self.created = 0
        self.creation_calls = 0
        self._build(kwargs)
        self.count: PoolCount = pool_count(
            self.group_sizes, self.head_sizes, world=self.world, ranks_per_node=rpn
        )
        assert self.count.total == self.created
        if warmup:
            for group in (*self._groups.values(), *self._head_blocks.values(),
                          *self._rings.values()):  # fmt: skip
                dist.all_reduce(torch.zeros(1), group=group)
        self.creation_seconds = time.perf_counter() - start

    def _build(self, kwargs: dict) -> None:
        """Blocks, then head blocks, then ring sub-groups (``dyncp.plan.menu.pool_blocks`` order),
        one creation call per family of disjoint groups."""
        blocks, head_blocks, rings = pool_blocks(
            self.group_sizes, self.head_sizes, world=self.world, ranks_per_node=self.ranks_per_node
        )
        for c in sorted({c for _, c in blocks}):
            fam = [(s, c) for s, c2 in blocks if c2 == c]
            self._family(fam, [range(s, s + c) for s, _ in fam], self._groups, kwargs)
        for u in sorted({u for _, u in head_blocks}):
            fam = [(s, u) for s, u2 in head_blocks if u2 == u]
            self._family(fam, [range(s, s + u) for s, _ in fam], self._head_blocks, kwargs)
        for c, u in sorted({(c, u) for _, c, u, _ in rings}):
            fam = [(s, j) for s, c2, u2, j in rings if (c2, u2) == (c, u)]
            positions = [range(s + j, s + c, u) for s, j in fam]
            self._family([(s, c, u) for s, _ in fam], positions, self._rings, kwargs)

    def _new_group(self, members: list[int], kwargs: dict) -> dist.ProcessGroup:
        split = getattr(dist, "split_group", None)
        if self.backend == "nccl" and split is not None:
            return split(split_ranks=[members], **kwargs)
        return dist.new_group(ranks=members, **kwargs)

    def _family(self, keys: list, positions: list[range], into: dict, kwargs: dict) -> None:
        """Create disjoint groups (axis positions) together; keep this rank's under its key."""
        mine = self.position
        members = [[self.ranks[p] for p in pos] for pos in positions]
        split = getattr(dist, "split_group", None)
        self.created += len(keys)
        if self.backend == "nccl" and split is not None:
            self.creation_calls += 1
            group = split(split_ranks=members, **kwargs)
            for key, pos in zip(keys, positions):
                if mine in pos:
                    into[key] = group
            return
        self.creation_calls += len(keys)
        for key, pos, ranks in zip(keys, positions, members):
            group = dist.new_group(ranks=ranks, **kwargs)
            if mine in pos:
                into[key] = group

    def group(self, start: int, size: int) -> dist.ProcessGroup | None:
        """The group of the block ``[start, start + size)`` (None for size 1).

        Raises:
            ValueError: the block is not one the pool built, or this rank is not in it; the
                message names the ranks.
        """
        if size == 1:
            return None
        key = (int(start), int(size))
        if key not in self._groups:
            members = list(self.ranks[start : start + size])
            raise ValueError(
                f"no pre-built group for ranks {members} (block start {start}, size {size}) on "
                f"rank {dist.get_rank()}; the pool holds sizes {list(self.group_sizes)} on the "
                f"allowed blocks (domains of {self.ranks_per_node}) of the axis {list(self.ranks)}"
            )
        return self._groups[key]

    def has_block(self, start: int, size: int, heads: int = 1) -> bool:
        """Whether a plan group on ``[start, start + size)`` split ``heads`` x ``size // heads``
        can run (its groups built, or size 1)."""
        if size == 1:
            return 0 <= start < self.world and heads == 1
        built = (
            (start, size) in self._groups
            or self.position is None
            or not (start <= self.position < start + size)
        )
        placed = size in self.group_sizes and is_placement(
            start, size, world=self.world, ranks_per_node=self.ranks_per_node
        )
        split = heads == 1 or (
            heads in self.head_sizes
            and split_allowed(size, heads, world=self.world, ranks_per_node=self.ranks_per_node)
        )
        return placed and built and split

    def hybrid_groups(
        self, start: int, size: int, heads: int
    ) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """This rank's head sub-group and ring sub-group (None when ``heads == size``) in the
        group ``[start, start + size)`` split ``heads`` x ``size // heads`` (``heads`` >= 2).

        Raises:
            ValueError: the split is not one the pool built, or this rank is not in the group;
                the message names the ranks.
        """
        start, size, heads = int(start), int(size), int(heads)
        members = list(self.ranks[start : start + size])
        me = self.position
        if not (heads >= 2 and self.has_block(start, size, heads)):
            raise ValueError(
                f"no pre-built hybrid split heads={heads} x ring={size // max(heads, 1)} for "
                f"ranks {members} (block start {start}, size {size}); the pool holds sizes "
                f"{list(self.group_sizes)} and head sizes {list(self.head_sizes)} on the allowed "
                f"blocks (domains of {self.ranks_per_node}) of the axis {list(self.ranks)}"
            )
        if me is None or not start <= me < start + size:
            where = "not on the axis" if me is None else f"rank {self.ranks[me]}"
            raise ValueError(f"this rank ({where}) is not in the group of ranks {members}")
        first = start + (me - start) // heads * heads
        key = (first, heads)
        head = self._groups[key] if key in self._groups else self._head_blocks[key]
        ring = None if heads == size else self._rings[(start, size, heads)]
        return head, ring

    def board(self, scope: str) -> FailureBoard:
        """The failure board of one call (``scope``: the same key prefix on every rank), its
        reports sealed with the pool's secret (drawn at start-up, never in the Store).

        Raises:
            ValueError: this rank is not on the pool's axis.
        """
        if self.store is None:
            raise ValueError("this rank is not on the pool's DP x CP axis: it has no board")
        return FailureBoard(
            self.store,
            scope=scope,
            world=self.world,
            names=self.ranks,
            secret=self._board_secret,
            timeout=self.timeout,
        )

    def barrier(self) -> None:
        """Synchronise the whole DP x CP axis (where group membership changes)."""
        if self.axis_group is None:
            dist.barrier()
        else:
            dist.barrier(group=self.axis_group)

    def __repr__(self) -> str:
        return (
            f"GroupPool(world={self.world}, sizes={list(self.group_sizes)}, "
            f"head_sizes={list(self.head_sizes)}, "
            f"ranks_per_node={self.ranks_per_node}, created={self.created}, "
            f"per_rank_max={self.count.per_rank_max}, "
            f"creation_seconds={self.creation_seconds:.3f})"
        )
