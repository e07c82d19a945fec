"""GroupPool: every communicator a plan can need, created once, in one order, on every rank.

Creating a process group is a collective over the whole job and costs milliseconds to seconds on
NCCL, so switching layouts must never create one. The pool builds, at start-up, one group for
every aligned block ``[k*c, (k+1)*c)`` of every allowed CP size c > 1 (size 1 needs no ring), on
the DP x CP axis -- either the whole world or a sub-world of a larger job with TP/PP, given as
the list of its global ranks in DP x CP order. All ranks of the job must construct the pool (a
``new_group`` call is collective) with the same arguments; groups are created in the same order
everywhere: sizes ascending, blocks ascending.

Hybrid groups (``head_sizes``): a group of c ranks split u x r (u ranks exchanging heads, r in a
ring) needs its head sub-groups, the aligned u-blocks (the existing block groups when u is an
allowed CP size; for r == 1 the head group is the block group itself), and its ring sub-groups,
ranks ``{start + i*u + j : i < r}`` for each head index j (stride u). After the block groups the
pool creates the head blocks of every u that is not a CP size (u ascending, blocks ascending),
then the ring sub-groups of every allowed c and u with 1 < u < c (c ascending, u ascending,
blocks ascending, j ascending).

On NCCL ``torch.distributed.split_group`` is used when this torch has it (one communicator split
instead of one bootstrap per group); gloo and older torch use ``new_group``. Each group this rank
belongs to is warmed up with a tiny all_reduce, so the first training step does not pay for lazy
communicator initialisation.

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

from dyncp.runtime.failures import FailureBoard, shared_secret

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["GroupPool", "job_timeout"]

#: torch's default for gloo process groups, used when the job's own timeout cannot be read.
_TORCH_DEFAULT_TIMEOUT = 1800.0


def job_timeout() -> float:
    """Seconds of the default process group's timeout (the one ``init_process_group`` got)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            return backend.options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return _TORCH_DEFAULT_TIMEOUT


class GroupPool:
    """Pre-built process groups for every aligned block of every allowed CP size.

    Args:
        ranks: global ranks of the DP x CP axis in order (default: the whole world).
        group_sizes: allowed CP sizes (default: every power of two dividing ``len(ranks)``).
        head_sizes: allowed head-parallel degrees u (powers of two, 1 always included, each at
            most the largest CP size); see the module docstring for the groups they add.
        warmup: run one all_reduce on each own group right away.
        timeout: seconds after which a collective on the pool's groups fails (default: the
            job's timeout, see :func:`job_timeout`).
        store: where failing ranks leave their error (default: the job's Store).

    Attributes:
        world: size of the DP x CP axis; ``position``: this rank's index on it (None if absent).
        created: number of groups created; ``creation_seconds``: wall time of creating them.
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
        if group_sizes is None:
            group_sizes = [
                1 << k for k in range(self.world.bit_length()) if self.world % (1 << k) == 0
            ]
        sizes = sorted(set(int(c) for c in group_sizes))
        wrong = [c for c in sizes if c < 1 or c & (c - 1) or self.world % c]
        if wrong:
            raise ValueError(
                f"group sizes {wrong} not allowed: each must be a power of two dividing the "
                f"DP x CP axis of {self.world} ranks"
            )
        self.group_sizes = tuple(sizes)
        heads = sorted({1, *(int(u) for u in head_sizes)})
        wrong = [u for u in heads if u < 1 or u & (u - 1) or u > self.group_sizes[-1]]
        if wrong:
            raise ValueError(
                f"head sizes {wrong} not allowed: each must be a power of two no larger than the "
                f"largest group size {self.group_sizes[-1]} (group sizes {list(self.group_sizes)})"
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
        self.store = dist.PrefixStore(f"dyncp/pool/{self.control_group.group_name}/", base)
        self._board_secret = shared_secret(self.control_group)
        self.calls = 0
        self.last_call = (-1, 0)  # (call number, waves) of the last execute on this rank
        # The per-step plan agreement: one all_reduce, on the device group where there is one
        # (NCCL: tree latency, logarithmic in the ranks), else on the gloo control group.
        if self.backend == "nccl":
            self.agreement_group = self.axis_group or dist.group.WORLD
            self.agreement_device: torch.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.agreement_group = self.control_group
            self.agreement_device = torch.device("cpu")
        self.created = 0
        for size in self.group_sizes:
            if size == 1:
                continue
            for first in range(0, self.world, size):
                members = list(self.ranks[first : first + size])
                group = self._new_group(members, kwargs)
                self.created += 1
                if self.position is not None and first <= self.position < first + size:
                    self._groups[(first, size)] = group
        self._build_hybrid(kwargs)
        if warmup:
            for group in (*self._groups.values(), *self._head_blocks.values(),
                          *self._rings.values()):  # fmt: skip
                dist.all_reduce(torch.zeros(1), group=group)
        self.creation_seconds = time.perf_counter() - start

    def _build_hybrid(self, kwargs: dict) -> None:
        """Head blocks of head sizes that are not CP sizes, then every ring sub-group."""
        mine = self.position
        for u in self.head_sizes:
            if u == 1 or u in self.group_sizes:
                continue
            for first in range(0, self.world, u):
                group = self._new_group(list(self.ranks[first : first + u]), kwargs)
                self.created += 1
                if mine is not None and first <= mine < first + u:
                    self._head_blocks[(first, u)] = group
        for c in self.group_sizes:
            for u in self.head_sizes:
                if not 1 < u < c:
                    continue
                for start in range(0, self.world, c):
                    for j in range(u):
                        positions = range(start + j, start + c, u)
                        group = self._new_group([self.ranks[p] for p in positions], kwargs)
                        self.created += 1
                        if mine in positions:
                            self._rings[(start, c, u)] = group

    def _new_group(self, members: list[int], kwargs: dict) -> dist.ProcessGroup:
        split = getattr(dist, "split_group", None)
        if self.backend == "nccl" and split is not None:
            return split(split_ranks=[members], **kwargs)
        return dist.new_group(ranks=members, **kwargs)

    def group(self, start: int, size: int) -> dist.ProcessGroup | None:
        """The group of the aligned block ``[start, start + size)`` (None for size 1).

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
                f"rank {dist.get_rank()}; the pool holds sizes {list(self.group_sizes)} on aligned "
                f"blocks of the axis {list(self.ranks)}"
            )
        return self._groups[key]

    def has_block(self, start: int, size: int, heads: int = 1) -> bool:
        """Whether a plan group on ``[start, start + size)`` split ``heads`` x ``size // heads``
        can run (its groups built, or size 1)."""
        aligned = size >= 1 and start % size == 0 and 0 <= start <= self.world - size
        split = heads == 1 or (heads in self.head_sizes and size % heads == 0)
        return aligned and size in self.group_sizes and split

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
                f"{list(self.group_sizes)} and head sizes {list(self.head_sizes)} on aligned "
                f"blocks of the axis {list(self.ranks)}"
            )
        if me is None or not start <= me < start + size:
            where = "not on the axis" if me is None else f"rank {self.ranks[me]}"
            raise ValueError(f"this rank ({where}) is not in the group of ranks {members}")
        first = start + (me - start) // heads * heads
        key = (first, heads)
        head = self._groups[key] if heads in self.group_sizes else self._head_blocks[key]
        ring = None if heads == size else self._rings[(start, size, heads)]
        return head, ring

    def board(self, scope: str) -> FailureBoard:
        """The failure board of one call (``scope``: the same key prefix on every rank), its
        reports sealed with the pool's secret (drawn at start-up, never in the Store)."""
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
            f"created={self.created}, creation_seconds={self.creation_seconds:.3f})"
        )
