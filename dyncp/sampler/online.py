"""Online batches: steps whose sequence lengths exist only at run time (RL rollouts).

    span = datetime.timedelta(seconds=dyncp.runtime.job_timeout())  # not torch's 30 minutes
    online = OnlinePlanner(planner, rank=rank, group=dist.new_group(backend="gloo", timeout=span))
    pending = online.submit(ids, lengths)    # returns at once; planning runs in the background
    ...                                      # the previous step trains meanwhile
    step = pending.result()                  # OnlineStep: the plan and this rank's micro-batches
    execute(step.plan, pool, step_fn)        # ctx.sample_ids are the submitted ids

A dataset-driven step can be planned steps ahead (the plan service's lookahead) because its batch
is a function of (lengths, seed, epoch). A rollout batch does not exist until the policy has
generated it, so what hides planning here is **planning in a background thread while the previous
step trains**: each ``submit`` hands its batch to one planning thread and returns; ``result``
waits only for what is left. This pays off whenever the next batch exists before the current step
finishes training: one-step off-policy pipelines (rollouts of step k+1 are generated while step k
trains, as in asynchronous RL trainers), or on-policy GRPO where the batch is planned while its
reference and old-policy log-probabilities are computed, before the update that needs the plan.

Every rank submits the same batch: each rank needs the tokens of its micro-batches anyway, so the
rollouts (and their ids and lengths) already reach every trainer rank. Two ways to one plan:

* ``group`` given: every rank compares a digest of its batch with the others' (one small
  all_reduce: a rank that received another batch makes *every* rank raise
  ``PlanMismatchError`` in that step), then the ``root`` rank plans and broadcasts the plan's
  JSON, and every rank checks it is a valid plan of exactly its own batch. The planner may be
  non-deterministic (an anytime, deadline-bound planner: ``Planner(time_limit=0.1)``), which
  matters because the deterministic planner tries every candidate and can take seconds on a long
  rollout batch. Nothing is pickled: the plan travels as JSON and is decoded with validation.
* no ``group``: every rank plans alone; the planner must then be deterministic
  (``Planner(deterministic=True)``) when there are several ranks. No communication at all.

Exactly-once: a submitted id appears in exactly one micro-batch of one group of the plan (checked
with ``StepPlan.validate`` and against the submission before the plan is returned).
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from dyncp.control.agreement import agree
from dyncp.plan import StepPlan, plan_digest
from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.planner.planner import Planner
from dyncp.sampler.microbatches import MicroBatchIndices, rank_microbatches
from dyncp.service import check_plan, plan_batch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed import ProcessGroup

__all__ = ["OnlinePlanner", "OnlinePlanningError", "OnlineStep", "PendingStep", "RolloutBatch"]


class OnlinePlanningError(RuntimeError):
    """The root rank could not plan a step (every rank raises it, with the root's message)."""


@dataclass(frozen=True, slots=True)
class RolloutBatch:
    """One step's sequences: unique integer ids and their token lengths (validated)."""

    ids: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(
        cls, ids: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray, max_length: int
    ) -> RolloutBatch:
        """Validate a submission.

        Raises:
            ValueError: empty batch, not 1-D integers, ids and lengths of different sizes,
                duplicate ids, lengths below 1, or lengths above ``max_length`` (each error
                names the offending ids and what is allowed).
        """
        a, s = np.asarray(ids), np.asarray(lengths)
        for name, x in (("ids", a), ("lengths", s)):
            if x.ndim != 1 or (x.size and x.dtype.kind not in "iu"):
                raise ValueError(
                    f"{name} must be a 1-D sequence of integers, got {x.dtype} with shape {x.shape}"
                )
        if a.size == 0:
            raise ValueError("an online batch needs at least one sequence, got none")
        if a.size != s.size:
            raise ValueError(f"{a.size} ids but {s.size} lengths; give one length per id")
        a, s = a.astype(np.int64), s.astype(np.int64)
        uniq, counts = np.unique(a, return_counts=True)
        if (counts > 1).any():
            dup = uniq[counts > 1]
            raise ValueError(
                f"{dup.size} ids are submitted more than once ({_show(dup)}); every sequence of "
                "a step needs its own id (each is trained exactly once)"
            )
        for bad, rule in ((s < 1, "at least 1 token"), (s > max_length, f"at most {max_length}")):
            if bad.any():
                shown = _show([f"{i} ({n} tokens)" for i, n in zip(a[bad], s[bad])])
                hint = (
                    "; cap the generation length (prompt + response) or plan with a larger "
                    "capacity or world"
                    if rule.startswith("at most")
                    else ""
                )
                raise ValueError(
                    f"{int(bad.sum())} sequences have lengths outside what the topology admits "
                    f"({rule}, the largest group's capacity): {shown}{hint}"
                )
        return cls(a, s)

    def digest(self) -> int:
        """A signed 64-bit digest of (ids, lengths): what the ranks compare."""
        h = hashlib.blake2b(self.ids.tobytes() + self.lengths.tobytes(), digest_size=8)
        return int.from_bytes(h.digest(), "little", signed=True)


def _show(values: Sequence[object] | np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(str(v) for v in list(values)[:limit])
    return shown + (", ..." if len(values) > limit else "")


@dataclass(frozen=True, slots=True)
class OnlineStep:
    """A planned online step: the plan (``sample_ids`` = submitted ids) and this rank's share.

    ``plan_seconds`` is the planning wall time on the rank that planned (``plan.stats``);
    ``wait_seconds`` is how long ``result`` blocked (planning not hidden by the overlap);
    ``ready`` says the plan was there when asked.
    """

    step: int
    plan: StepPlan
    microbatches: list[MicroBatchIndices]
    digest: int
    plan_seconds: float
    wait_seconds: float
    ready: bool


class PendingStep:
    """A submitted step whose plan is being made in the background."""

    def __init__(self, step: int, future: Future[tuple[StepPlan, int]], rank: int) -> None:
        self.step, self._future, self._rank = step, future, rank

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> OnlineStep:
        """Wait for the plan (at most ``timeout`` seconds) and return the step.

        Raises:
            PlanMismatchError: some rank submitted another batch for this step (every rank).
            OnlinePlanningError: the root rank's planner raised (every rank).
            TimeoutError: no plan within ``timeout``.
        """
        start = time.perf_counter()
        ready = self._future.done()
        plan, digest = self._future.result(timeout)
        wait = time.perf_counter() - start
        batches = rank_microbatches(plan, rank=self._rank, epoch=0, step=self.step, digest=digest)
        seconds = float(plan.stats.get("timings", {}).get("plan_seconds", 0.0))
        return OnlineStep(self.step, plan, batches, digest, seconds, wait, ready)


class OnlinePlanner:
    """Plans online batches in one background thread; identical plans on every rank.

    Args:
        planner: plans each batch (deterministic unless ``group`` is given and world > 1).
        rank: this process's position on the DP x CP axis.
        group: a CPU (gloo) group over all ranks used by nothing else, e.g.
            ``dist.new_group(backend="gloo", timeout=...)`` with the job's timeout (torch's default
            for a new group is 30 minutes): its collectives run in the planning thread. With
            it, ``root`` plans and broadcasts; without it every rank plans alone.
        root: the rank of ``group`` that plans.
        budget: how long each step is planned: ``share`` x its predicted seconds within
            ``[floor, cap]`` (``dyncp.planner.budget``; default 0.25 within [0.1 s, 2 s]: step
            k+1 is planned while step k trains, so a quarter of a step leaves the plan ready
            well before it is needed). A deterministic planner counts it in deterministic units
            (every rank planning alone still gets the same plan). ``None``: the planner's own
            ``time_limit`` or budget.

    Raises:
        ValueError: rank out of range, a group of another size, or several ranks planning alone
            with a non-deterministic planner.
    """

    def __init__(
        self,
        planner: Planner,
        *,
        rank: int,
        group: ProcessGroup | None = None,
        root: int = 0,
        budget: StepBudget | None = DEFAULT_STEP_BUDGET,
    ) -> None:
        if budget is not None and not isinstance(budget, StepBudget):
            raise ValueError(f"budget must be a StepBudget or None, got {budget!r}")
        self.budget = budget
        world = planner.topology.world
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if group is None and world > 1 and not planner.deterministic:
            raise ValueError(
                "without group= every rank plans alone, so the planner must be deterministic "
                "(Planner(..., deterministic=True)); or pass a gloo group so that one rank plans"
            )
        if group is not None:
            size = dist.get_world_size(group)
            if size != world:
                raise ValueError(f"group has {size} ranks, the planner's topology {world}")
            if not 0 <= root < size:
                raise ValueError(f"root must be in [0, {size}), got {root}")
        self.planner, self.rank, self.group, self.root = planner, rank, group, root
        self.max_length = planner.topology.max_length()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dyncp-online")
        self._lock = threading.Lock()
        self._next = 0

    def submit(
        self, ids: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray
    ) -> PendingStep:
        """Validate a batch now (raising here, on the caller's thread) and plan it behind.

        Every rank must submit the same batches in the same order; steps are numbered from 0
        in submission order.

        Raises:
            ValueError: see ``RolloutBatch.of``.
        """
        batch = RolloutBatch.of(ids, lengths, self.max_length)
        with self._lock:
            step, self._next = self._next, self._next + 1
            future = self._pool.submit(self._plan, step, batch)
        return PendingStep(step, future, self.rank)

    def _plan(self, step: int, batch: RolloutBatch) -> tuple[StepPlan, int]:
        if self.group is None:
            plan = plan_batch(self.planner, batch.ids, batch.lengths, budget=self.budget)
        else:
            agree(self.group, where=(step,), digest=batch.digest(), label=f"online step {step}")
            plan = self._broadcast(step, batch)
        topology = self.planner.topology
        check_plan(plan, topology=topology, sample_ids=batch.ids, lengths=batch.lengths)
        return plan, plan_digest(plan)

    def _broadcast(self, step: int, batch: RolloutBatch) -> StepPlan:
        """The root's plan as JSON bytes (or its error), sent to every rank of the group."""
        payload = b""
        if dist.get_rank(self.group) == self.root:
            try:
                plan = plan_batch(self.planner, batch.ids, batch.lengths, budget=self.budget)
                payload = b"P" + plan.to_json().encode()
            except Exception as exc:  # every rank must hear of it, not wait for a plan
                payload = b"E" + f"{type(exc).__name__}: {exc}".encode()
        src = dist.get_global_rank(self.group, self.root)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if payload:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(data, src=src, group=self.group)
        raw = data.numpy().tobytes()
        if raw[:1] != b"P":
            raise OnlinePlanningError(
                f"online step {step}: the root rank {self.root} could not plan: {raw[1:].decode()}"
            )
        return StepPlan.from_json(raw[1:])

    def close(self) -> None:
        """Stop the planning thread (steps not started are cancelled)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> OnlinePlanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
