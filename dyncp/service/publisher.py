"""The plan service: plan steps ahead on one rank and publish them through the job's Store.

One process plans (a thread on one training rank, or ``python -m dyncp.service`` next to the job);
every rank reads the published plan of each step. A plan that is not there by a rank's deadline is
replaced, on every rank, by the deterministic greedy plan of that step, computed locally. All of
it runs over a ``torch.distributed.Store`` (the job's TCPStore); no process group is needed.

Store protocol (keys under ``dyncp/<prefix>/``)::

    cursor              "<epoch> <step>": written by reader rank 0 (one writer) when it starts
                        needing a step, sealed like the plans
    e<epoch>/s<step>    the step's decision, written once with compare_set(key, "", value):
                        the plan JSON (by the service) or FALLBACK (by a reader whose deadline
                        passed first), sealed with the job's secret and run
                        (``dyncp.control.signing``)

Each step key is a one-shot register: the first writer wins and nothing rewrites it, so every rank
reads the same value however late the plan and however differently the ranks time out. Every
genuine decision is non-empty; an empty value (which ``compare_set(key, "", ...)`` cannot tell
from an absent key) is no decision, so a reader that finds one offers its fallback in its place
and takes whatever the register then holds. A plan that arrives after a reader wrote FALLBACK is
counted late (``ServiceCounters.late``) and unused. The service plans the steps ``cursor ..
cursor + lookahead`` (spilling into epoch + 1 at the end of an epoch), following the cursor where
rank 0 last put it, forward or back. Reader rank 0 deletes step keys ``keep_steps`` behind it, so
the Store stays bounded (what stays: the last ``keep_steps`` keys, and at most ``lookahead`` keys
of an epoch + 1 that a job never runs).

Anything can be written at these keys by any client of the Store: readers decode every value
totally (a StepPlan or a PlanError, never a crash), reject unsigned or wrongly signed records, or
records of another run, when the job has a secret, and fall back deterministically, counting why.
A cursor that is not two non-negative integers (or, with a secret, not sealed for this run) is a
counted service error, logged at most once per ``BAD_CURSOR_LOG_SECONDS``; the service keeps
serving. Without a secret a forged cursor is followed until rank 0 writes its next one (one
step). When the Store itself fails the service thread stops and says why
(``PlanService.failure``).

Readers poll ``store.check`` rather than block in ``store.wait(keys, timeout)``: a timed-out wait
logs C++ warnings on every fallback, and a blocked wait holds the client's connection.

Slices (``slices=True`` on the service and every reader; ``dyncp.plan.slice``): the step's
decision is a slice header (signed like a plan) that commits to one slice per rank, written
first at ``e<epoch>/s<step>/r<position>``; a reader reads the header and its own slice (about a
kilobyte), checks the slice against the header and deletes its key. A reader whose slice is
missing or does not verify cannot run the step: :class:`SliceUnavailable` makes its sampler
take part in the agreement with a digest no other rank has, so every rank raises in that step.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from dyncp.control.agreement import PlanMismatchError
from dyncp.control.signing import FALLBACK, PlanSigner, is_fallback
from dyncp.cost_model.calibration.online import ModelVersion
from dyncp.plan import PlanError, StepPlan, Topology, plan_digest
from dyncp.plan.slice import (
    PlanSlice,
    SliceHeader,
    SliceUnavailable,
    check_slice_header,
    open_slice,
    own_slice,
    slice_plan,
)
from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.planner.planner import HYBRID_POLICY, Planner
from dyncp.planner.versioned import VersionedPlanner

if TYPE_CHECKING:
    from torch.distributed import Store

    from dyncp.control.model_channel import ModelChannel, ServiceCalibration

__all__ = [
    "FALLBACK",
    "BatchSource",
    "Fetched",
    "PlanClient",
    "PlanMismatchError",
    "PlanService",
    "ServiceCounters",
    "SliceUnavailable",
    "check_plan",
    "check_slice_header",
    "fallback_planner",
    "lookahead_targets",
    "plan_batch",
    "plan_digest",
    "step_key",
]

#: Bad cursors are logged at most once in this many seconds (with the count since the last line).
BAD_CURSOR_LOG_SECONDS = 10.0

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    """The global batches of each epoch (``dyncp.sampler.BatchSchedule`` implements it)."""

    def num_steps(self, epoch: int) -> int: ...

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset indices, admitted lengths) of one global batch."""
        ...


def _check_prefix(prefix: str) -> str:
    if not prefix or not isinstance(prefix, str) or "/" in prefix:
        raise ValueError(f"prefix must be a non-empty string without '/', got {prefix!r}")
    return prefix


def step_key(prefix: str, epoch: int, step: int) -> str:
    """Store key holding the decision for one step."""
    return f"dyncp/{prefix}/e{epoch}/s{step}"


def slice_key(key: str, position: int) -> str:
    """Store key of one rank's slice of the plan decided at step key ``key``."""
    return f"{key}/r{position}"


def _set_many(store: Store, keys: list[str], values: list[bytes]) -> None:
    """Write many keys in one request where the Store can (``multi_set``), else one by one."""
    multi = getattr(store, "multi_set", None)
    if multi is not None:
        try:
            multi(keys, values)
            return
        except (NotImplementedError, RuntimeError, TypeError):
            pass
    for k, v in zip(keys, values):
        store.set(k, v)


def _cursor_key(prefix: str) -> str:
    return f"dyncp/{prefix}/cursor"


def fallback_planner(planner: Planner) -> Planner:
    """The deterministic greedy planner on ``planner``'s topology and cost model.

    A pure function of the batch (no CP-SAT, no wall clock), so every rank computes the same plan.
    It chooses head splits when ``planner`` does (policy ``dyncp-hybrid``) and optimises the
    same timing (``planner.timing``). Of ``planner``'s other options it keeps those that cannot
    change a deterministic plan without CP-SAT; those that could (a user improver, the baselines,
    ``max_length``) and the bound it reports (the tight one, computed with the plan) are the
    defaults, whatever ``planner`` was given.
    """
    config = dataclasses.replace(
        planner.config,
        policy=HYBRID_POLICY if planner.policy == HYBRID_POLICY else "dyncp",
        deterministic=True,
        cpsat=None,
        improver=None,
        max_length=None,
        baselines=True,
        bound="tight",
        defer_bound="auto",
        time_limit=None,
        budget=None,
    )
    return Planner(planner.model, config)


def plan_batch(
    planner: Planner,
    sample_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    budget: StepBudget | None = None,
) -> StepPlan:
    """A validated plan of one global batch, its ``sample_ids`` set to the dataset indices;
    with ``budget``, planned with that share of its predicted step (``Planner.plan``)."""
    plan = planner.plan(lengths) if budget is None else planner.plan(lengths, budget=budget)
    plan.sample_ids = tuple(int(i) for i in sample_ids)
    return plan


def check_plan(
    plan: StepPlan, *, topology: Topology, sample_ids: np.ndarray, lengths: np.ndarray
) -> None:
    """Raise ValueError unless ``plan`` is a valid plan of exactly this batch on ``topology``."""
    if plan.topology != topology:
        raise ValueError(f"plan is for topology {plan.topology}, this job has {topology}")
    if plan.lengths != tuple(int(s) for s in lengths):
        raise ValueError("plan lengths differ from this step's batch")
    if plan.sample_ids != tuple(int(i) for i in sample_ids):
        raise ValueError("plan sample_ids differ from this step's batch")
    plan.validate()


def lookahead_targets(
    source: BatchSource, epoch: int, step: int, lookahead: int
) -> list[tuple[int, int]]:
    """Steps ``step .. step + lookahead`` of ``epoch``, continuing into ``epoch + 1``."""
    out: list[tuple[int, int]] = []
    e, s = epoch, step
    for _ in range(lookahead + 1):
        while s >= source.num_steps(e):
            if e > epoch:  # a second empty epoch: nothing more to plan
                return out
            e, s = e + 1, s - source.num_steps(e)
        out.append((e, s))
        s += 1
    return out


# ---------------------------------------------------------------------------------- service


@dataclass(slots=True)
class ServiceCounters:
    """What the service did; plain numbers for logs and metrics."""

    published: int = 0  # plans that won their step's register
    late: int = 0  # plans that arrived after a reader had decided to fall back
    errors: int = 0  # steps whose planning raised (FALLBACK published instead), bad cursors
    bad_cursors: int = 0  # cursor values that were not "<epoch> <step>" (ignored)
    plan_seconds_total: float = 0.0
    plan_seconds_max: float = 0.0
    last_error: str = ""


class PlanService:
    """Plans the steps readers are about to need and publishes them in the Store.

    Args:
        store: the job's Store (the service uses its own connection, ``store.clone()``).
        source: the global batches (the same schedule every reader uses).
        planner: any Planner (CP-SAT and a long ``time_limit`` allowed: readers never wait for
            it past their deadline).
        budget: how long each step is planned: ``share`` x the step's predicted seconds, within
            ``[floor, cap]`` (``dyncp.planner.budget``; default 0.25, [0.1 s, 2 s]: the service
            plans ``lookahead`` steps ahead on one thread, so it keeps up while a step's plan
            takes less than the step, and a quarter leaves the training rank's core, whose
            Python the thread shares, three quarters). ``None``: the planner's own
            ``time_limit`` or budget.
        prefix: job namespace of the keys.
        lookahead: steps planned beyond the one readers currently need.
        poll_seconds: how often the cursor is read when there is nothing to plan.
        secret: the per-job secret that signs each record (default: from the environment,
            see :class:`dyncp.control.signing.PlanSigner`); without one a warning says the channel
            is unauthenticated.
        run_id: the run the records are bound to (the readers' ``run_id``).
        slices: publish a slice header and one slice per rank instead of the whole plan
            (the readers' ``slices``).

    Attributes:
        failure: why the service thread stopped on its own (the Store failed), else None.

    Raises:
        ValueError: bad ``prefix``, ``lookahead`` or secret.
    """

    def __init__(
        self,
        store: Store,
        *,
        source: BatchSource,
        planner: Planner,
        prefix: str,
        lookahead: int = 2,
        poll_seconds: float = 0.002,
        secret: bytes | str | None = None,
        calibration: ServiceCalibration | None = None,
        run_id: str = "",
        slices: bool = False,
        budget: StepBudget | None = DEFAULT_STEP_BUDGET,
    ) -> None:
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be an integer >= 0, got {lookahead!r}")
        if budget is not None and not isinstance(budget, StepBudget):
            raise ValueError(f"budget must be a StepBudget or None, got {budget!r}")
        self.budget = budget
        self.calibration = calibration
        self.slices = slices
        self.prefix = _check_prefix(prefix)
        self.store = store
        self.source = source
        self.planner = planner
        self.lookahead = lookahead
        self.poll_seconds = poll_seconds
        self.counters = ServiceCounters()
        self.signer = PlanSigner.from_env(secret, run=run_id)
        self.failure: BaseException | None = None
        self._bad_logged = (-BAD_CURSOR_LOG_SECONDS, 0)  # (when, bad_cursors then)
        self._cursor: tuple[int, int] | None = None
        self._done: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PlanService:
        """Run the service in a daemon thread on a cloned Store connection."""
        if self._thread is not None:
            raise RuntimeError("PlanService already started")
        self.store = _clone(self.store)
        if self.calibration is not None:
            self.calibration.bind(self.store)
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="dyncp-plan-service", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the step being planned (if any) is published."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        """Whether the service thread is running (False after ``stop()`` or a Store failure)."""
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> None:
        """The service loop (blocks until ``stop()``, or until the Store fails: see ``failure``)."""
        try:
            while not self._stop.is_set():
                if self.calibration is not None:  # measurements in, maybe a new model version
                    self.planner = self.calibration.poll(self.planner)
                todo = self._next_target()
                if todo is None:
                    self._stop.wait(self.poll_seconds)
                else:
                    self.publish(*todo)
        except Exception as exc:  # the Store (or its connection) failed: nothing left to serve
            self.failure = exc
            log.error("plan service stopped: %s", exc)

    def _next_target(self) -> tuple[int, int] | None:
        cursor = self._read_cursor()
        if cursor is None:
            return None
        targets = lookahead_targets(self.source, *cursor, self.lookahead)
        self._done = {t for t in self._done if t >= cursor}
        return next((t for t in targets if t not in self._done), None)

    def _read_cursor(self) -> tuple[int, int] | None:
        key = _cursor_key(self.prefix)
        if not self.store.check([key]):
            return self._cursor
        raw = self.store.get(key)
        try:
            seen = _parse_cursor(self.signer.open(key, raw))
            why = "expected '<epoch> <step>' (integers >= 0)"
        except PlanError as exc:
            seen, why = None, str(exc)
        if seen is None:
            self._bad_cursor(raw, why)
            return self._cursor
        self._cursor = seen  # one writer (reader rank 0): its latest position, forward or back
        return self._cursor

    def _bad_cursor(self, raw: bytes, why: str) -> None:
        """Count a bad cursor; log it at most once per BAD_CURSOR_LOG_SECONDS."""
        self.counters.errors += 1
        self.counters.bad_cursors += 1
        self.counters.last_error = f"bad cursor {raw[:40]!r}: {why}"
        now = time.monotonic()
        when, before = self._bad_logged
        if now - when >= BAD_CURSOR_LOG_SECONDS:
            log.warning(
                "ignoring cursor %r: %s (%d bad cursors so far, %d since the last line)",
                raw[:40],
                why,
                self.counters.bad_cursors,
                self.counters.bad_cursors - before,
            )
            self._bad_logged = (now, self.counters.bad_cursors)

    def publish(self, epoch: int, step: int) -> bool:
        """Plan one step and offer it; True when it became the step's decision."""
        self._done.add((epoch, step))
        ids, lengths = self.source.batch(epoch, step)
        start = time.perf_counter()
        key = step_key(self.prefix, epoch, step)
        records: list[bytes] = []
        try:
            plan = plan_batch(self.planner, ids, lengths, budget=self.budget)
            if self.slices:  # the slices first: a reader that sees the header finds its slice
                header, records = slice_plan(plan)
                _set_many(self.store, self._slice_keys(key), records)
                value: bytes | None = header.to_json()
            else:
                value = plan.to_json().encode()
        except (PlanError, ValueError, RuntimeError) as exc:
            log.warning(
                "planning epoch %d step %d failed, publishing FALLBACK: %s", epoch, step, exc
            )
            self.counters.errors += 1
            self.counters.last_error = repr(exc)
            value = None
        seconds = time.perf_counter() - start
        self.counters.plan_seconds_total += seconds
        self.counters.plan_seconds_max = max(self.counters.plan_seconds_max, seconds)
        offer = self.signer.seal(key, FALLBACK if value is None else value)
        won = self.store.compare_set(key, "", offer) == offer
        if value is None:
            return False
        if won:
            self.counters.published += 1
        else:
            self.counters.late += 1
            for k in self._slice_keys(key) if records else ():  # nobody will read them
                self.store.delete_key(k)
        return won

    def _slice_keys(self, key: str) -> list[str]:
        return [slice_key(key, p) for p in range(self.planner.topology.world)]

    def __enter__(self) -> PlanService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _parse_cursor(raw: bytes) -> tuple[int, int] | None:
    """(epoch, step) from a cursor value, or None unless it is two integers >= 0."""
    parts = raw.split()
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 18 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _clone(store: Store) -> Store:
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


# ---------------------------------------------------------------------------------- reader


class Fetched(NamedTuple):
    """One step's plan as a reader got it."""

    plan: StepPlan
    source: str  # "service", "fallback" (or "local" from a sampler's own lookahead)
    reason: str | None  # why it fell back: "late" or "rejected"
    ready: bool  # whether the decision was there when asked (False: the reader waited)


class PlanClient:
    """Reads published plans; falls back to the deterministic greedy plan past the deadline.

    Args:
        store: the job's Store.
        source: the global batches (to check a plan against, and to plan a fallback).
        planner: the job's planner; its topology is required and its deterministic greedy
            (:func:`fallback_planner`) is the fallback.
        prefix: job namespace of the keys.
        rank: this reader's rank; rank 0 also deletes old step keys.
        deadline: seconds to wait for a step's plan.
        late_deadline: the shorter wait used after a step fell back, until a plan arrives in time
            again (so a stopped service costs this much per step, not ``deadline``).
        keep_steps: rank 0 deletes the key of the step this many steps behind it.
        secret: the per-job secret records must be signed with (default: from the environment);
            with one, unsigned or wrongly signed records are rejected (fallback, counted).
        run_id: the run records must be bound to (the service's ``run_id``).
        slices: read the step's slice header and this rank's slice (a
            :class:`~dyncp.plan.slice.PlanSlice` in ``Fetched.plan``), not the whole plan.
    """

    def __init__(
        self,
        store: Store,
        *,
        source: BatchSource,
        planner: Planner,
        prefix: str,
        rank: int,
        deadline: float = 1.0,
        late_deadline: float = 0.05,
        keep_steps: int = 64,
        secret: bytes | str | None = None,
        models: ModelChannel | None = None,
        run_id: str = "",
        slices: bool = False,
    ) -> None:
        if not deadline >= 0 or not late_deadline >= 0:
            raise ValueError(
                f"deadline and late_deadline must be >= 0 seconds, got {deadline}, {late_deadline}"
            )
        self.prefix = _check_prefix(prefix)
        self.slices = slices
        self.store = store
        self.source = source
        self.topology = planner.topology
        self.fallback = fallback_planner(planner)
        self.models = models
        self._fallbacks: dict[int, VersionedPlanner] = {}
        self.rank = rank
        self.deadline = deadline
        self.late_deadline = late_deadline
        self.keep_steps = keep_steps
        self.signer = PlanSigner.from_env(secret, run=run_id)
        self._missed = False
        self._consumed: deque[str] = deque()

    def fetch(self, epoch: int, step: int) -> Fetched:
        """The plan of one step: the published one, or the same fallback on every rank."""
        key = step_key(self.prefix, epoch, step)
        ids, lengths = self.source.batch(epoch, step)
        if self.rank == 0:  # one writer: the service follows rank 0
            cursor = _cursor_key(self.prefix)
            self.store.set(cursor, self.signer.seal(cursor, f"{epoch} {step}".encode()))
        ready = self.store.check([key])
        if ready:
            value: bytes | None = self.store.get(key)
        else:
            value = self._poll(key, self.late_deadline if self._missed else self.deadline)
        if not value:  # none by the deadline, or an empty value: no decision (module docstring)
            value = self.store.compare_set(key, "", self.signer.seal(key, self._fallback_body()))
        self._forget_old(key)
        try:
            body = self.signer.open(key, value)
            self._missed = is_fallback(body)
            if self._missed:
                plan = plan_batch(self._fallback_for(body), ids, lengths)
                return Fetched(self._mine(plan), "fallback", "late", False)
            if self.slices:
                header = SliceHeader.from_json(body)
                check_slice_header(header, topology=self.topology, lengths=lengths)
                return Fetched(self._own_slice(key, header, ids, lengths), "service", None, ready)
            plan = StepPlan.from_json(body)
            check_plan(plan, topology=self.topology, sample_ids=ids, lengths=lengths)
        except SliceUnavailable:
            raise
        except ValueError as exc:  # PlanError (decoding, signature) or another batch's plan
            log.warning("published plan of epoch %d step %d rejected: %s", epoch, step, exc)
            plan = plan_batch(self.fallback, ids, lengths)
            return Fetched(self._mine(plan), "fallback", "rejected", ready)
        return Fetched(plan, "service", None, ready)

    def _mine(self, plan: StepPlan) -> StepPlan | PlanSlice:
        """A plan this rank computed itself, as the reader returns plans (whole, or its slice)."""
        return own_slice(plan, self.rank) if self.slices else plan

    def _own_slice(
        self, key: str, header: SliceHeader, ids: np.ndarray, lengths: np.ndarray
    ) -> PlanSlice:
        """This rank's slice of a verified header, checked against the batch; its key deleted.

        Raises:
            SliceUnavailable: missing, not the header's, or not this batch's.
        """
        own = slice_key(key, self.rank)
        try:
            if not self.store.check([own]):
                raise PlanError("slice", f"no slice at {own}")
            mine = open_slice(header, self.store.get(own), self.rank)
            for i, length in mine.lengths.items():
                if length != int(lengths[i]) or mine.sample_ids[i] != int(ids[i]):
                    raise PlanError("slice", f"sequence {i} of the slice is not this batch's")
        except PlanError as exc:
            raise SliceUnavailable(f"rank {self.rank}: {exc}", header.digest) from None
        self.store.delete_key(own)
        return mine

    def _fallback_body(self) -> bytes:
        """What this reader offers as the step's decision: ``FALLBACK``, naming the newest model
        version published in the Store when the job calibrates (every reader can fetch it)."""
        latest = self.models.latest() if self.models is not None else None
        return FALLBACK if not latest else FALLBACK + b" v%d" % latest

    def _fallback_for(self, body: bytes) -> Planner | VersionedPlanner:
        """The deterministic planner a fallback decision names (same on every rank).

        A version that cannot be fetched (deleted, or refused as malformed or unsigned) leaves
        the starting model; if that made ranks differ, the per-step digest agreement says so.
        """
        suffix = body[len(FALLBACK) + 1 :]
        if self.models is None:
            return self.fallback
        if not suffix.startswith(b"v") or not suffix[1:].isdigit():
            return self._starting_fallback()
        version = int(suffix[1:])
        if version not in self._fallbacks:
            found = self.models.get(version)
            if found is None:
                log.warning("fallback names model v%d, which this reader cannot fetch", version)
                return self._starting_fallback()
            self._fallbacks = {version: VersionedPlanner.rebuild(self.fallback, found)}
        return self._fallbacks[version]

    def _starting_fallback(self) -> VersionedPlanner:
        """The fallback on the model every rank started with (version 0)."""
        return VersionedPlanner(self.fallback, ModelVersion(0, self.fallback.model.profile))

    def _poll(self, key: str, seconds: float) -> bytes | None:
        """The key's value, polling ``check`` until it is set or ``seconds`` have passed."""
        end = time.perf_counter() + seconds
        pause = 0.0005
        while not self.store.check([key]):
            left = end - time.perf_counter()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.004)
        return self.store.get(key)

    def _forget_old(self, key: str) -> None:
        if self.rank != 0 or self.keep_steps < 0:
            return
        self._consumed.append(key)
        while len(self._consumed) > self.keep_steps:
            old = self._consumed.popleft()
            try:
                self.store.delete_key(old)
            except (RuntimeError, NotImplementedError):
                log.info("this Store cannot delete keys; old plans stay in it")
                self.keep_steps = -1
                return
