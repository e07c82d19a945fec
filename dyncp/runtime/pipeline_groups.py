"""PipelineGroups: every communicator a pipelined job needs, created once, in one order.

Creating a process group is collective over the whole job (``new_group``: every process calls it
for every group, in the same order, members or not), so the pipeline runtime, like
:class:`~dyncp.runtime.GroupPool`, creates all of its groups at start-up and none while training.
In this order, on every process:

1. one :class:`~dyncp.runtime.GroupPool` per stage, stage 0 first, each over that stage's
   columns (``PipelineLayout.stage_ranks``): the CP rings of a stage are its own, and a process
   keeps the pool of its stage (it takes part in creating the others', which hold no group of
   it; GroupPool builds nothing else on a process off its axis);
2. a CPU (gloo) control group over the whole grid: the secret that seals failure reports, and
   the plan agreement on gloo jobs;
3. the *channels* of the stage-to-stage sends (``dyncp.runtime.pipeline_layout.Channel``): one
   two-process group per (direction, sending stage, column), directions F then B, stages then
   columns ascending. A channel of its own for each direction and pair keeps every channel's
   messages in one order on both ends (NCCL matches point-to-point messages in the order they
   were posted on a communicator and ignores tags) and keeps sends of one direction from
   queueing behind receives of the other on one NCCL stream. For ``stages >= 2`` the wrap-around
   channels of interleaved schedules (last stage to the first, and back) are always created,
   so one set of groups serves 1F1B and interleaved plans alike: 2 x stages x columns channels.

The failure board (:meth:`PipelineGroups.board`) spans the whole grid: a stage waiting for a
neighbour that raised finds that neighbour's report there, whichever stage it is on.
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
from dyncp.runtime.group_pool import GroupPool
from dyncp.runtime.pipeline_layout import DIRECTIONS, Channel, PipelineLayout

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["PipelineGroups"]


class PipelineGroups:
    """The stage pools, the control group and the channels of one pipeline grid.

    Every process of the job constructs it with the same arguments (group creation is
    collective). Pool arguments (``group_sizes``, ``ranks_per_node``, ``head_sizes``,
    ``warmup``) are the same for every stage, as every stage runs the plan's groups.

    Args:
        layout: which global rank is (stage, column).
        group_sizes, ranks_per_node, head_sizes, warmup: as :class:`GroupPool`'s, per stage.
        timeout: seconds after which any collective or send of these groups fails (default:
            the job's timeout).
        store: where failing processes leave their error (default: the job's Store).

    Attributes:
        layout: the grid; ``stage``, ``column``: this process's place (None off the grid).
        pool: this process's stage's GroupPool (None off the grid).
        position: this process's index in ``layout.ranks`` (the failure board's position).
        control_group: gloo group over the grid.
        agreement_group, agreement_device: where plans are compared (and losses summed): a
            device group over the grid on NCCL, the control group on gloo.
        timeout: the groups' timeout in seconds.
        calls: ``execute_pipeline`` calls so far on this process; ``last_call``: (call,
            slots) of the last one, for naming a failure found at the reduction after it.
        orders_checked: the (virtual stages, slots) whose operation orders passed
            ``pipeline_layout.check_orders`` here (each is checked once).
        creation_seconds: wall time of creating everything.

    Raises:
        ValueError: the grid does not fit the job, or a pool argument is wrong.
    """

    def __init__(
        self,
        layout: PipelineLayout,
        *,
        group_sizes: Sequence[int] | None = None,
        ranks_per_node: int | None = None,
        head_sizes: Sequence[int] = (1,),
        warmup: bool = True,
        timeout: float | None = None,
        store: Store | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineGroups needs torch.distributed to be initialised first")
        if not isinstance(layout, PipelineLayout):
            raise ValueError(f"layout must be a PipelineLayout, got {type(layout).__name__}")
        job = dist.get_world_size()
        outside = [r for r in layout.ranks if r >= job]
        if outside:
            raise ValueError(
                f"the pipeline grid names ranks {outside} but the job has {job} processes"
            )
        self.layout = layout
        self.timeout = job_timeout() if timeout is None else timeout
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"PipelineGroups timeout must be > 0 seconds, got {timeout!r}")
        me = dist.get_rank()
        start = time.perf_counter()
        self.stage: int | None = None
        self.column: int | None = None
        self.position: int | None = None
        if me in layout.ranks:
            self.stage, self.column = layout.place(me)
            self.position = layout.ranks.index(me)
        self.pool: GroupPool | None = None
        for s in range(layout.stages):  # 1. the stage pools, stage 0 first, on every process
            pool = GroupPool(
                ranks=layout.stage_ranks(s),
                group_sizes=group_sizes,
                ranks_per_node=ranks_per_node,
                head_sizes=head_sizes,
                warmup=warmup,
                timeout=self.timeout,
                store=store,
            )
            if s == self.stage:
                self.pool = pool
        kwargs = {"timeout": datetime.timedelta(seconds=self.timeout)}
        grid = list(layout.ranks)
        self.control_group = dist.new_group(ranks=grid, backend="gloo", **kwargs)  # 2.
        self.backend = dist.get_backend()
        if self.backend == "nccl":
            whole = len(grid) == job
            self.agreement_group = dist.group.WORLD if whole else dist.new_group(grid, **kwargs)
            self.agreement_device = torch.device("cuda")
        else:
            self.agreement_group = self.control_group
            self.agreement_device = torch.device("cpu")
        self._channels: dict[Channel, dist.ProcessGroup] = {}
        self.channels_created = 0
        if layout.stages > 1:  # 3. the channels
            for kind in DIRECTIONS:
                for s in range(layout.stages):
                    step = 1 if kind == "F" else -1
                    peer = (s + step) % layout.stages
                    for w in range(layout.columns):
                        pair = [layout.rank(s, w), layout.rank(peer, w)]
                        group = dist.new_group(ranks=sorted(pair), **kwargs)
                        self.channels_created += 1
                        if me in pair:
                            self._channels[Channel(kind, s, w)] = group
        base = dist.distributed_c10d._get_default_store() if store is None else store
        self._base_store = base  # kept alive: a PrefixStore holds it on the C++ side only
        self.store: Store | None = None
        self._secret = b""
        if self.position is not None:
            self.store = dist.PrefixStore(f"dyncp/pipeline/{self.control_group.group_name}/", base)
            self._secret = shared_secret(self.control_group)
        self.calls = 0
        self.last_call = (-1, 0)
        self.orders_checked: set[tuple[int, int]] = set()
        self.creation_seconds = time.perf_counter() - start

    def channel(self, channel: Channel) -> dist.ProcessGroup:
        """The two-process group of ``channel``.

        Raises:
            ValueError: this process is neither the channel's sender nor its receiver.
        """
        try:
            return self._channels[channel]
        except KeyError:
            raise ValueError(
                f"this process (stage {self.stage}, column {self.column}) is not on channel "
                f"{channel}"
            ) from None

    def board(self, scope: str) -> FailureBoard:
        """The failure board of one call over the whole grid (positions: ``layout.ranks``).

        Raises:
            ValueError: this process is not on the grid.
        """
        if self.store is None:
            raise ValueError("this process is not on the pipeline grid: it has no board")
        return FailureBoard(
            self.store,
            scope=scope,
            world=self.layout.size,
            names=self.layout.ranks,
            secret=self._secret,
            timeout=self.timeout,
        )

    def __repr__(self) -> str:
        return (
            f"PipelineGroups(stages={self.layout.stages}, columns={self.layout.columns}, "
            f"stage={self.stage}, column={self.column}, channels={self.channels_created}, "
            f"creation_seconds={self.creation_seconds:.3f})"
        )
