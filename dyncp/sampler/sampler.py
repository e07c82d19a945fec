"""DynamicCPSampler: dyncp's step plans as a torch DataLoader batch sampler.

    sampler = DynamicCPSampler(lengths, world_size=W, rank=r, capacity=8192, planner=planner,
                               global_batch_tokens=2 * W * 8192, seed=0, store=store)
    loader = DataLoader(sampler.wrap(dataset), batch_sampler=sampler,
                        collate_fn=sampler.collate, num_workers=2)
    for mb in loader:                  # PackedMicroBatch: this rank's zigzag shard, in THD
        ...
        if mb.meta.last_in_step:
            optimizer.step()

How a sample reaches a rank:

1. ``BatchSchedule``: the epoch's global batches, a deterministic function of (lengths, seed,
   epoch): a seeded permutation cut by tokens or by count. Every rank computes the same cut.
2. The step's ``StepPlan`` (its ``sample_ids`` are dataset indices): read from the plan service
   through the Store (``store=``; see ``dyncp.service``), or planned by this process with
   ``lookahead`` steps planned ahead in a thread (no store; the planner must then be
   deterministic when there are several ranks).
3. This rank's micro-batches in plan order (wave, then the group's micro-batches): each a
   ``MicroBatchIndices``, a list of dataset indices carrying a ``MicroBatchMeta``. A rank with no
   work in a step gets one empty micro-batch, so every rank sees ``last_in_step`` every step.
4. ``PlannedDataset`` (``sampler.wrap``) fetches the items and hands the meta to
   ``ZigzagCollate`` (``sampler.collate``), which packs them into THD tensors and keeps this
   rank's zigzag shard (helpers from ``dyncp.ring_attention.sharding``).

The sampler runs in the DataLoader's main process; with ``num_workers > 0`` the workers receive the
index lists (meta included) and run only the dataset and the collate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dyncp.agreement import PendingAgreement
from dyncp.calibration import OnlineCalibrator
from dyncp.model_channel import ModelChannel, ServiceCalibration
from dyncp.plan import StepPlan, padded_length
from dyncp.plan_auth import PlanSigner
from dyncp.planner.planner import Planner
from dyncp.ring_attention.sharding import zigzag_positions, zigzag_shard
from dyncp.service import (
    Fetched,
    PlanClient,
    PlanService,
    check_plan,
    lookahead_targets,
    plan_batch,
    plan_digest,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

__all__ = [
    "OVERLONG",
    "BatchSchedule",
    "DynamicCPSampler",
    "MicroBatchIndices",
    "MicroBatchMeta",
    "PackedMicroBatch",
    "PlannedDataset",
    "PlannedItems",
    "SamplerCounters",
    "StepInfo",
    "ZigzagCollate",
    "rank_microbatches",
]

OVERLONG = ("error", "truncate", "skip")
RECENT_PLANS = 32  # plans kept for state_dict(consumed=...) behind the sampler's position

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- schedule


class BatchSchedule:
    """The global batches of every epoch: a pure function of (lengths, seed, epoch).

    Args:
        lengths: tokens of each dataset sample (index = dataset index).
        max_length: longest sequence the largest group holds (``Topology.max_length()``).
        overlong: what to do with longer samples: ``"error"`` (default, names them),
            ``"truncate"`` (to ``max_length``) or ``"skip"``.
        seed, shuffle: the permutation is ``default_rng([seed, epoch])``; no shuffle: index order.
        global_batch_tokens: a batch takes samples until it holds at least this many tokens.
        global_batch_size: a batch takes this many samples (give exactly one of the two).
        drop_last: drop the last, partial batch of each epoch (see ``dropped``).

    Raises:
        ValueError: bad lengths or options; overlong samples with ``overlong="error"``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        max_length: int,
        overlong: str = "error",
        seed: int = 0,
        shuffle: bool = True,
        global_batch_tokens: int | None = None,
        global_batch_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        raw = np.asarray(lengths)
        if raw.ndim != 1 or raw.dtype.kind not in "iu" or (raw < 1).any():
            raise ValueError("lengths must be a 1-D sequence of positive integers")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong={overlong!r}; choose one of {', '.join(OVERLONG)}")
        if (global_batch_tokens is None) == (global_batch_size is None):
            raise ValueError("give exactly one of global_batch_tokens and global_batch_size")
        limit = global_batch_tokens if global_batch_size is None else global_batch_size
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"global batch tokens/size must be a positive integer, got {limit!r}")
        raw = raw.astype(np.int64)
        over = np.flatnonzero(raw > max_length)
        if over.size and overlong == "error":
            shown = ", ".join(f"{i} ({raw[i]} tokens)" for i in over[:10])
            raise ValueError(
                f"{over.size} samples are longer than {max_length} tokens, the most the largest "
                f"group holds: {shown}{', ...' if over.size > 10 else ''}; pass "
                "overlong='truncate' or overlong='skip' to admit the rest"
            )
        self.max_length = max_length
        self.overlong = overlong
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.global_batch_tokens, self.global_batch_size = global_batch_tokens, global_batch_size
        self.truncated = over if overlong == "truncate" else over[:0]
        self.skipped = over if overlong == "skip" else over[:0]
        self.is_truncated = np.zeros(len(raw), dtype=bool)
        self.is_truncated[self.truncated] = True
        self.lengths = np.minimum(raw, max_length) if overlong == "truncate" else raw
        self.eligible = (
            np.flatnonzero(raw <= max_length) if overlong == "skip" else np.arange(len(raw))
        )
        self.lengths_digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
        self._lock = threading.Lock()
        self._cuts: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, batch bounds into order, dropped indices) of one epoch.

        The last two epochs are cached: planning ahead reads the next epoch near the end of one.
        """
        with self._lock:
            if epoch not in self._cuts:
                self._cuts[epoch] = self._cut_epoch(epoch)
                if len(self._cuts) > 2:
                    self._cuts.popitem(last=False)
            return self._cuts[epoch]

    def _cut_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = self.eligible
        if self.shuffle:
            order = order[np.random.default_rng([self.seed, epoch]).permutation(len(order))]
        n = len(order)
        if n == 0:
            return order, np.zeros(1, dtype=np.int64), order
        if self.global_batch_size is not None:
            bounds = list(range(0, n, self.global_batch_size)) + [n]
            partial = n % self.global_batch_size != 0
        else:
            cs = np.cumsum(self.lengths[order])
            bounds, base = [0], 0
            while bounds[-1] < n:
                end = min(int(np.searchsorted(cs, base + self.global_batch_tokens)) + 1, n)
                bounds.append(end)
                base = int(cs[end - 1])
            last_tokens = cs[-1] - (cs[bounds[-2] - 1] if bounds[-2] else 0)
            partial = last_tokens < self.global_batch_tokens
        dropped = order[:0]
        if self.drop_last and partial:
            dropped = order[bounds[-2] :]
            bounds = bounds[:-1]
        return order, np.asarray(bounds, dtype=np.int64), dropped

    def num_steps(self, epoch: int) -> int:
        return len(self._epoch(epoch)[1]) - 1

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset indices, admitted lengths) of one global batch."""
        order, bounds, _ = self._epoch(epoch)
        if not 0 <= step < len(bounds) - 1:
            raise IndexError(f"epoch {epoch} has {len(bounds) - 1} steps, no step {step}")
        ids = order[bounds[step] : bounds[step + 1]]
        return ids, self.lengths[ids]

    def dropped(self, epoch: int) -> np.ndarray:
        """Dataset indices dropped from ``epoch`` by ``drop_last`` (the partial last batch)."""
        return self._epoch(epoch)[2]

    def config(self) -> dict[str, Any]:
        """What the epochs depend on (saved with the sampler state and checked on load)."""
        return {
            "lengths_digest": self.lengths_digest,
            "num_samples": len(self.lengths),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_tokens": self.global_batch_tokens,
            "global_batch_size": self.global_batch_size,
            "drop_last": self.drop_last,
            "overlong": self.overlong,
            "max_length": self.max_length,
        }


# ---------------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True, slots=True)
class MicroBatchMeta:
    """One micro-batch of one rank: where it sits in the step plan and what it holds.

    ``position`` counts this rank's micro-batches within the step; ``microbatch`` is the index
    within the group's micro-batches. An empty micro-batch (``is_empty``) stands for a step in
    which this rank has no work. ``truncated`` lists positions (into ``sample_indices``) of
    samples truncated to the planned ``seqlens``.
    """

    epoch: int
    step: int
    wave: int
    position: int
    last_in_step: bool
    group_start: int
    group_size: int
    rank_in_group: int
    microbatch: int
    sample_indices: tuple[int, ...]
    seq_ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    truncated: tuple[int, ...]
    plan_digest: int

    @property
    def cp(self) -> int:
        return self.group_size

    @property
    def group_ranks(self) -> range:
        return range(self.group_start, self.group_start + self.group_size)

    @property
    def is_empty(self) -> bool:
        return not self.sample_indices


class MicroBatchIndices(list):
    """Dataset indices of one micro-batch (what the DataLoader fetches), with its ``meta``."""

    def __init__(self, indices: Sequence[int], meta: MicroBatchMeta) -> None:
        super().__init__(indices)
        self.meta = meta

    def __reduce__(self) -> tuple[Any, ...]:
        return MicroBatchIndices, (list(self), self.meta)


def rank_microbatches(
    plan: StepPlan,
    *,
    rank: int,
    epoch: int,
    step: int,
    digest: int,
    is_truncated: np.ndarray | None = None,
) -> list[MicroBatchIndices]:
    """This rank's micro-batches of a step plan, in execution order (one empty one if none)."""
    ids = plan.sample_ids if plan.sample_ids is not None else range(len(plan.lengths))
    mine = [
        (w, g, m, mb)
        for w, wave in enumerate(plan.waves)
        for g in wave.groups
        if g.start <= rank < g.start + g.size
        for m, mb in enumerate(g.microbatches)
    ]
    out = []
    for p, (w, g, m, mb) in enumerate(mine):
        samples = tuple(int(ids[i]) for i in mb.seq_ids)
        meta = MicroBatchMeta(
            epoch=epoch,
            step=step,
            wave=w,
            position=p,
            last_in_step=p == len(mine) - 1,
            group_start=g.start,
            group_size=g.size,
            rank_in_group=rank - g.start,
            microbatch=m,
            sample_indices=samples,
            seq_ids=mb.seq_ids,
            seqlens=tuple(plan.lengths[i] for i in mb.seq_ids),
            truncated=tuple(
                j for j, i in enumerate(samples) if is_truncated is not None and is_truncated[i]
            ),
            plan_digest=digest,
        )
        out.append(MicroBatchIndices(samples, meta))
    if not out:  # no work for this rank in this step
        meta = MicroBatchMeta(
            epoch=epoch,
            step=step,
            wave=-1,
            position=0,
            last_in_step=True,
            group_start=rank,
            group_size=1,
            rank_in_group=0,
            microbatch=0,
            sample_indices=(),
            seq_ids=(),
            seqlens=(),
            truncated=(),
            plan_digest=digest,
        )
        out.append(MicroBatchIndices((), meta))
    return out


# ---------------------------------------------------------------------------------- collate


@dataclass(frozen=True, slots=True)
class PlannedItems:
    """The dataset items of one micro-batch and its meta (what the collate receives)."""

    items: list[Any]
    meta: MicroBatchMeta


class PlannedDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset so that a DataLoader passes each micro-batch's meta on.

    The DataLoader calls ``__getitems__`` with the ``MicroBatchIndices`` the sampler yielded (in
    the main process or in a worker); items come from the wrapped dataset's ``__getitem__`` (or its
    own ``__getitems__``). Items are 1-D token sequences (tensor, array, list), or mappings whose
    ``ZigzagCollate.key`` holds one.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> PlannedItems:
        meta = getattr(indices, "meta", None)
        if meta is None:
            raise TypeError(
                "PlannedDataset needs the MicroBatchIndices of a DynamicCPSampler: pass the "
                "sampler as batch_sampler= of the DataLoader"
            )
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]
        return PlannedItems(list(items), meta)


@dataclass(slots=True)
class PackedMicroBatch:
    """This rank's shard of one micro-batch in THD layout (tokens first, sequences packed).

    ``input_ids``/``labels``/``position_ids`` hold, per sequence, the rank's zigzag chunks r and
    2cp-1-r of the sequence padded to a multiple of 2cp (unpadded when cp == 1). ``labels`` are
    the next tokens, ``ignore_index`` at each sequence's last token and on padding;
    ``position_ids`` are positions within the sequence (for RoPE). ``cu_seqlens_padded`` and
    ``cu_seqlens_local`` (int32) are the cumulative padded global and local sequence lengths.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    cu_seqlens_local: torch.Tensor
    max_seqlen_padded: int
    max_seqlen_local: int
    meta: MicroBatchMeta

    _TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens_padded", "cu_seqlens_local")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedMicroBatch:
        moved = {n: getattr(self, n).to(device, non_blocking=non_blocking) for n in self._TENSORS}
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> PackedMicroBatch:
        """Called by a DataLoader with ``pin_memory=True``."""
        return dataclasses.replace(
            self, **{n: getattr(self, n).pin_memory() for n in self._TENSORS}
        )


@dataclass(frozen=True, slots=True)
class ZigzagCollate:
    """Packs a micro-batch's items into this rank's zigzag shard (a DataLoader ``collate_fn``).

    Args:
        pad_id: token id of padding.
        ignore_index: label of positions without a target.
        key: take the tokens from ``item[key]`` when items are mappings.

    Raises:
        ValueError: an item is not 1-D or its token count differs from the planned length (a
            longer item is accepted only for a sample the sampler truncated).
    """

    pad_id: int = 0
    ignore_index: int = -100
    key: str | None = None

    def __call__(self, batch: PlannedItems) -> PackedMicroBatch:
        if not isinstance(batch, PlannedItems):
            raise TypeError(
                "ZigzagCollate needs PlannedItems: wrap the dataset with sampler.wrap(dataset)"
            )
        meta = batch.meta
        cp, rank = meta.cp, meta.rank_in_group
        if meta.is_empty:
            empty = torch.empty(0, dtype=torch.int64)
            zero = torch.zeros(1, dtype=torch.int32)
            return PackedMicroBatch(empty, empty, empty, zero, zero, 0, 0, meta)
        tokens, labels = [], []
        for j, (item, length) in enumerate(zip(batch.items, meta.seqlens)):
            x = torch.as_tensor(item if self.key is None else item[self.key]).long()
            if x.dim() != 1 or (
                x.numel() != length and not (j in meta.truncated and x.numel() > length)
            ):
                raise ValueError(
                    f"sample {meta.sample_indices[j]}: dataset item has shape {tuple(x.shape)}, "
                    f"expected 1-D with {length} tokens (its length in the sampler's lengths)"
                )
            x = x[:length]
            tokens.append(x)
            labels.append(torch.cat([x[1:], x.new_full((1,), self.ignore_index)]))
        seqlens = meta.seqlens
        padded = torch.tensor([padded_length(s, cp) for s in seqlens], dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32)
        return PackedMicroBatch(
            input_ids=zigzag_shard(
                torch.cat(tokens), seqlens=seqlens, cp=cp, rank=rank, pad_value=self.pad_id
            ),
            labels=zigzag_shard(
                torch.cat(labels), seqlens=seqlens, cp=cp, rank=rank, pad_value=self.ignore_index
            ),
            position_ids=zigzag_positions(seqlens=seqlens, cp=cp, rank=rank),
            cu_seqlens_padded=torch.cat([zero, padded.cumsum(0, dtype=torch.int32)]),
            cu_seqlens_local=torch.cat([zero, (padded // cp).cumsum(0, dtype=torch.int32)]),
            max_seqlen_padded=int(padded.max()),
            max_seqlen_local=int(padded.max()) // cp,
            meta=meta,
        )


# ---------------------------------------------------------------------------------- sampler


@dataclass(frozen=True, slots=True)
class StepInfo:
    """How one step's plan was obtained (passed to ``on_step`` with the plan)."""

    epoch: int
    step: int
    source: str  # "service", "local", "fallback" or "restored" (from a saved state)
    reason: str | None  # for "fallback": "late" or "rejected"
    ready: bool  # the plan was there when the sampler asked (no wait on planning)
    wait_seconds: float  # time the sampler spent obtaining the plan
    digest: int
    microbatches: int  # this rank's micro-batches in the step


@dataclass(slots=True)
class SamplerCounters:
    """Plain counters of one sampler (for logs; a metrics exporter can read or hook them)."""

    steps: int = 0
    service_plans: int = 0
    local_plans: int = 0
    restored_plans: int = 0
    fallbacks: int = 0
    late_plans: int = 0  # fallbacks because no plan was published by the deadline
    rejected_plans: int = 0  # fallbacks because the published plan did not match the batch
    waits: int = 0  # steps whose plan was not ready when asked
    wait_seconds_total: float = 0.0
    wait_seconds_max: float = 0.0
    truncated_samples: int = 0
    skipped_samples: int = 0
    dropped_samples: int = 0  # by drop_last, summed over the epochs iterated


class _LocalPlans:
    """Plans in this process, ``lookahead`` steps ahead in one background thread."""

    def __init__(self, schedule: BatchSchedule, planner: Planner, lookahead: int) -> None:
        self.schedule, self.planner, self.lookahead = schedule, planner, lookahead
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[tuple[int, int], Future[StepPlan]] = {}

    def _plan(self, epoch: int, step: int) -> StepPlan:
        return plan_batch(self.planner, *self.schedule.batch(epoch, step))

    def fetch(self, epoch: int, step: int) -> Fetched:
        if not self.lookahead:
            return Fetched(self._plan(epoch, step), "local", None, False)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dyncp-lookahead")
        targets = lookahead_targets(self.schedule, epoch, step, self.lookahead)
        for key in [k for k in self._futures if k not in targets]:
            self._futures.pop(key).cancel()
        for key in targets:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._plan, *key)
        future = self._futures.pop((epoch, step))
        ready = future.done()
        return Fetched(future.result(), "local", None, ready)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._futures.clear()


class _StorePlans:
    """Plans read from the Store; this rank's service thread starts with the first fetch."""

    def __init__(self, client: PlanClient, service: PlanService | None) -> None:
        self.client, self.service = client, service
        self._serving = False

    def fetch(self, epoch: int, step: int) -> Fetched:
        if self.service is not None and not self._serving:
            self.service.start()
            self._serving = True
        return self.client.fetch(epoch, step)

    def close(self) -> None:
        if self._serving:
            self.service.stop()
            self._serving = False


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A step whose plan is known and whose comparison is in flight."""

    fetched: Fetched
    wait: float
    digest: int
    agreement: PendingAgreement | None


@dataclass(frozen=True, slots=True)
class _Resume:
    epoch: int
    step: int
    offset: int
    plan: StepPlan | None


class DynamicCPSampler:
    """Yields this rank's micro-batches of dyncp step plans; a DataLoader ``batch_sampler``.

    Args:
        lengths: tokens of each dataset sample.
        world_size, rank: the DP x CP ranks and this process's place among them.
        capacity: tokens per rank per micro-batch (must match the planner's topology).
        planner: plans the steps (the service's planner when this rank serves).
        global_batch_tokens, global_batch_size: how each global batch is cut (give one).
        seed, shuffle, drop_last, overlong: see ``BatchSchedule``.
        lookahead: steps planned ahead of the one being consumed (local thread, or this rank's
            plan service).
        store: the job's torch.distributed Store; plans come from the plan service through it.
            None: every rank plans locally (``planner`` must be deterministic if world_size > 1).
        prefix: job namespace of the Store keys.
        serve: run the plan service in this process (default: rank 0 when a store is given);
            False on every rank when ``python -m dyncp.serve`` runs it.
        deadline, late_deadline: seconds to wait for a published plan (see ``PlanClient``).
        secret: the per-job secret plans are signed with (default: ``$DYNCP_PLAN_SECRET`` or
            the file ``$DYNCP_PLAN_SECRET_FILE``; see ``dyncp.plan_auth``).
        group: a CPU (gloo) process group over all ranks, e.g. ``dist.new_group(backend="gloo")``,
            used only for this: before the first micro-batch of each step is yielded, every rank
            compares the step's plan digest with the others' (an all_gather of 24 bytes) and,
            if any differs, every rank raises ``PlanMismatchError`` in that step.
        agree_ahead: steps ahead of the one being yielded whose plans are fetched and compared
            early (default 0: at the step boundary). The comparison of step N waits until every
            rank's sampler has reached step N - agree_ahead; a DataLoader that prefetches P
            micro-batches (``prefetch_factor * num_workers``) lets a rank's sampler run up to P
            steps ahead of its training, so give ``agree_ahead >= P + 1`` with ``num_workers >
            0``: then no comparison waits for a rank whose training waits for this one.
        on_step: called as ``on_step(plan, info)`` once per step when its plan is known.
        calibrate: online calibration of the cost model (needs ``store``): readers' fallbacks
            use the newest model version published in the Store; the rank that serves refits
            from the measurements trainers push (``dyncp.runtime.measure.StoreMeasurements``)
            with this calibrator (True: a default ``OnlineCalibrator`` of the planner's profile).
            ``sampler.calibration`` is the service side (set its ``metrics``/``save_path``).

    Raises:
        ValueError: inconsistent options (each names the option and what is allowed).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        world_size: int,
        rank: int,
        capacity: int,
        planner: Planner,
        global_batch_tokens: int | None = None,
        global_batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        lookahead: int = 2,
        overlong: str = "error",
        store: Store | None = None,
        prefix: str = "default",
        serve: bool | None = None,
        deadline: float = 1.0,
        late_deadline: float = 0.05,
        secret: bytes | str | None = None,
        group: ProcessGroup | None = None,
        agree_ahead: int = 0,
        on_step: Callable[[StepPlan, StepInfo], None] | None = None,
        calibrate: bool | OnlineCalibrator = False,
    ) -> None:
        topo = planner.topology
        if calibrate is not False and store is None:
            raise ValueError(
                "calibrate= needs store= (model versions reach the ranks through the plan "
                "service); without a store use dyncp.runtime.measure.CollectiveCalibration"
            )
        if world_size != topo.world or capacity != topo.capacity:
            raise ValueError(
                f"world_size={world_size}, capacity={capacity} differ from the planner's "
                f"world={topo.world}, capacity={topo.capacity}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be an integer >= 0, got {lookahead!r}")
        if not isinstance(agree_ahead, int) or agree_ahead < 0:
            raise ValueError(f"agree_ahead must be an integer >= 0, got {agree_ahead!r}")
        if store is None and world_size > 1 and not planner.deterministic:
            raise ValueError(
                "without a store every rank plans locally, so the planner must be deterministic "
                "(Planner(..., deterministic=True)); or pass store= to use the plan service"
            )
        self.schedule = BatchSchedule(
            lengths,
            max_length=topo.max_length(),
            overlong=overlong,
            seed=seed,
            shuffle=shuffle,
            global_batch_tokens=global_batch_tokens,
            global_batch_size=global_batch_size,
            drop_last=drop_last,
        )
        self.world_size, self.rank, self.planner = world_size, rank, planner
        self.lookahead, self.on_step = lookahead, on_step
        self.counters = SamplerCounters(
            truncated_samples=len(self.schedule.truncated),
            skipped_samples=len(self.schedule.skipped),
        )
        if len(self.schedule.truncated) or len(self.schedule.skipped):
            log.warning(
                "%d samples longer than %d tokens were %s",
                len(self.schedule.truncated) + len(self.schedule.skipped),
                topo.max_length(),
                "truncated" if overlong == "truncate" else "skipped",
            )
        self.calibration: ServiceCalibration | None = None
        self._source: _LocalPlans | _StorePlans
        if store is None:
            self._source = _LocalPlans(self.schedule, planner, lookahead)
        else:
            signer = PlanSigner.from_env(secret) if calibrate is not False else None
            client = PlanClient(
                store,
                source=self.schedule,
                planner=planner,
                prefix=prefix,
                rank=rank,
                deadline=deadline,
                late_deadline=late_deadline,
                secret=secret,
                models=None if calibrate is False else ModelChannel(store, prefix, signer=signer),
            )
            service = None
            if rank == 0 if serve is None else serve:
                if calibrate is not False:
                    calibrator = (
                        calibrate
                        if isinstance(calibrate, OnlineCalibrator)
                        else OnlineCalibrator(
                            planner.model.profile, ranks_per_node=topo.ranks_per_node
                        )
                    )
                    self.calibration = ServiceCalibration(
                        store, prefix, calibrator, signer=signer
                    )
                service = PlanService(
                    store,
                    source=self.schedule,
                    planner=planner,
                    prefix=prefix,
                    lookahead=lookahead,
                    secret=secret,
                    calibration=self.calibration,
                )
            self._source = _StorePlans(client, service)
        self.group, self.agree_ahead = group, agree_ahead
        self._recent: OrderedDict[tuple[int, int], StepPlan] = OrderedDict()
        self.epoch = 0
        self._position = (0, 0, 0)  # (epoch, step, offset) after the last micro-batch yielded
        self._resume: _Resume | None = None

    # ------------------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (a restored position in it is kept)."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume.epoch != self.epoch:
            self._resume = None
        if self._resume is None:
            self._position = (self.epoch, 0, 0)

    @property
    def num_steps(self) -> int:
        """Global batches (steps) in the current epoch."""
        return self.schedule.num_steps(self.epoch)

    def __len__(self) -> int:
        raise TypeError(
            "a DynamicCPSampler has no length: this rank's micro-batches per step depend on the "
            "plans; use sampler.num_steps for the steps of the epoch"
        )

    @property
    def dropped(self) -> np.ndarray:
        """Dataset indices ``drop_last`` drops from the current epoch."""
        return self.schedule.dropped(self.epoch)

    # ------------------------------------------------------------------------------ DataLoader
    def wrap(self, dataset: Any) -> PlannedDataset:
        """The dataset to give the DataLoader together with this sampler."""
        return PlannedDataset(dataset)

    @property
    def collate(self) -> ZigzagCollate:
        """The default collate_fn (pad id 0, ignore index -100)."""
        return ZigzagCollate()

    def __iter__(self) -> Iterator[MicroBatchIndices]:
        epoch, start, offset, restored = self.epoch, 0, 0, None
        if self._resume is not None:
            start, offset, restored = self._resume.step, self._resume.offset, self._resume.plan
            self._resume = None
        if start == 0 and offset == 0:
            dropped = self.schedule.dropped(epoch)
            if len(dropped):
                self.counters.dropped_samples += len(dropped)
                log.info("drop_last drops %d samples from epoch %d", len(dropped), epoch)
        steps = self.schedule.num_steps(epoch)
        ahead: dict[int, _Prepared] = {}
        for step in range(start, steps):
            for s in range(step, min(step + self.agree_ahead, steps - 1) + 1):
                if s not in ahead:  # in step order on every rank: the comparisons' order
                    ahead[s] = self._prepare(epoch, s, restored if s == start else None)
            batches = self._finish(epoch, step, ahead.pop(step))
            if offset > len(batches):
                raise ValueError(
                    f"restored offset {offset} but rank {self.rank} has {len(batches)} "
                    f"micro-batches in epoch {epoch} step {step}"
                )
            for mb in batches[offset:]:
                m = mb.meta
                self._position = (
                    (epoch, step + 1, 0) if m.last_in_step else (epoch, step, m.position + 1)
                )
                yield mb
            offset = 0

    def _prepare(self, epoch: int, step: int, plan: StepPlan | None) -> _Prepared:
        """Obtain a step's plan and start comparing its digest with the other ranks'."""
        start = time.perf_counter()
        if plan is not None:
            ids, lengths = self.schedule.batch(epoch, step)
            check_plan(plan, topology=self.planner.topology, sample_ids=ids, lengths=lengths)
            fetched = Fetched(plan, "restored", None, True)
        else:
            fetched = self._source.fetch(epoch, step)
        wait = time.perf_counter() - start
        digest = plan_digest(fetched.plan)
        pending = None
        if self.group is not None:
            label = f"epoch {epoch} step {step}"
            pending = PendingAgreement(self.group, where=(epoch, step), digest=digest, label=label)
        return _Prepared(fetched, wait, digest, pending)

    def _finish(self, epoch: int, step: int, prepared: _Prepared) -> list[MicroBatchIndices]:
        """Wait for the step's comparison (raises on a mismatch), then its micro-batches."""
        if prepared.agreement is not None:
            prepared.agreement.result()
        fetched, wait, digest = prepared.fetched, prepared.wait, prepared.digest
        plan = fetched.plan
        batches = rank_microbatches(
            plan,
            rank=self.rank,
            epoch=epoch,
            step=step,
            digest=digest,
            is_truncated=self.schedule.is_truncated,
        )
        self._remember(epoch, step, plan)
        info = StepInfo(
            epoch, step, fetched.source, fetched.reason, fetched.ready, wait, digest, len(batches)
        )
        self._count(info)
        if self.on_step is not None:
            self.on_step(plan, info)
        return batches

    def _count(self, info: StepInfo) -> None:
        c = self.counters
        c.steps += 1
        if info.source == "fallback":
            c.fallbacks += 1
            c.late_plans += info.reason == "late"
            c.rejected_plans += info.reason == "rejected"
        elif info.source == "service":
            c.service_plans += 1
        elif info.source == "local":
            c.local_plans += 1
        else:
            c.restored_plans += 1
        c.waits += not info.ready
        c.wait_seconds_total += info.wait_seconds
        c.wait_seconds_max = max(c.wait_seconds_max, info.wait_seconds)

    def _remember(self, epoch: int, step: int, plan: StepPlan) -> None:
        self._recent[(epoch, step)] = plan
        while len(self._recent) > RECENT_PLANS:
            self._recent.popitem(last=False)

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the lookahead thread or this rank's plan service."""
        self._source.close()

    def __enter__(self) -> DynamicCPSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ state
    def state_dict(self, consumed: MicroBatchMeta | None = None) -> dict[str, Any]:
        """The position to resume from: after the last micro-batch yielded, or after
        ``consumed`` (pass the meta of the last micro-batch trained on when a DataLoader
        prefetches, e.g. with worker processes).

        Raises:
            ValueError: ``consumed`` is older than the plans the sampler keeps (32 steps).
        """
        if consumed is None:
            epoch, step, offset = self._position
        elif consumed.last_in_step:
            epoch, step, offset = consumed.epoch, consumed.step + 1, 0
        else:
            epoch, step, offset = consumed.epoch, consumed.step, consumed.position + 1
        state: dict[str, Any] = {
            "version": 1,
            "epoch": epoch,
            "step": step,
            "offset": offset,
            "rank": self.rank,
            **self.schedule.config(),
        }
        if offset:
            if (epoch, step) in self._recent:
                plan = self._recent[(epoch, step)]
            elif self._resume is not None and self._resume.plan is not None:
                plan = self._resume.plan
            else:
                raise ValueError(
                    f"the plan of epoch {epoch} step {step} is no longer held (the sampler keeps "
                    f"the last {RECENT_PLANS} steps); save the state closer to training"
                )
            state["plan"] = plan.to_json()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position (the next iteration starts there).

        Raises:
            ValueError: the state comes from a sampler with other lengths or batching, or a
                mid-step state from another rank.
        """
        if state.get("version") != 1:
            raise ValueError(f"sampler state version {state.get('version')!r} not supported (1)")
        config = self.schedule.config()
        differ = [k for k in config if state.get(k) != config[k]]
        if differ:
            raise ValueError(
                "sampler state does not match this sampler: "
                + ", ".join(f"{k}: saved {state.get(k)!r}, now {config[k]!r}" for k in differ)
            )
        offset = int(state["offset"])
        if offset and state["rank"] != self.rank:
            raise ValueError(
                f"state saved mid-step by rank {state['rank']} cannot resume rank {self.rank}; "
                "save at a step boundary (or each rank's own state)"
            )
        plan = StepPlan.from_json(state["plan"]) if offset else None
        self.epoch = int(state["epoch"])
        self._resume = _Resume(self.epoch, int(state["step"]), offset, plan)
        self._position = (self.epoch, int(state["step"]), offset)
