"""PlanService: plans the steps readers are about to need and publishes them in the job's Store.

One process plans (a thread on one training rank, or ``python -m dyncp.service`` next to the job);
it follows the cursor reader rank 0 writes, plans ``lookahead`` steps beyond it and offers each
plan to the step's one-shot register (``dyncp.service.protocol``). It never waits for a reader and
no reader waits for it past its deadline, so a slow plan costs a fallback, never a stall.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dyncp.control.namespace import check_prefix
from dyncp.control.signing import FALLBACK, PlanSigner
from dyncp.plan import PlanError, slice_plan
from dyncp.planner.budget import DEFAULT_STEP_BUDGET, StepBudget
from dyncp.planner.planner import Planner
from dyncp.service.fallback import plan_batch
from dyncp.service.protocol import (
    BatchSource,
    cursor_key,
    parse_cursor,
    run_key,
    slice_key,
    step_key,
)
from dyncp.service.run_check import announcement

if TYPE_CHECKING:
    from torch.distributed import Store

    from dyncp.control.model_channel import ServiceCalibration

__all__ = ["BAD_CURSOR_LOG_SECONDS", "PlanService", "ServiceCounters", "lookahead_targets"]

#: Bad cursors are logged at most once in this many seconds (with the count since the last line).
BAD_CURSOR_LOG_SECONDS = 10.0

log = logging.getLogger(__name__)


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
        slices: publish a slice header and one slice record per node instead of the whole
            plan (the readers' ``slices``).

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
        self.prefix = check_prefix(prefix)
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
        """Announce the run (``announce``), then run the service in a daemon thread on a cloned
        Store connection."""
        if self._thread is not None:
            raise RuntimeError("PlanService already started")
        self.store = _clone(self.store)
        self.announce()
        if self.calibration is not None:
            self.calibration.bind(self.store)
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="dyncp-plan-service", daemon=True)
        self._thread.start()
        return self

    def announce(self) -> None:
        """Write the run this service serves at the run key (``dyncp.service.run_check``), so
        that readers of another run stop at start instead of falling back at every step;
        ``start()`` does it before the first plan."""
        key = run_key(self.prefix)
        self.store.set(key, announcement(self.signer, key))

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
            log.error("plan service stopped: %s", (str(exc).splitlines() or [repr(exc)])[0])

    def _next_target(self) -> tuple[int, int] | None:
        cursor = self._read_cursor()
        if cursor is None:
            return None
        targets = lookahead_targets(self.source, *cursor, self.lookahead)
        self._done = {t for t in self._done if t >= cursor}
        return next((t for t in targets if t not in self._done), None)

    def _read_cursor(self) -> tuple[int, int] | None:
        key = self.signer.private_key(cursor_key(self.prefix))
        if not self.store.check([key]):
            return self._cursor
        raw = self.store.get(key)
        try:
            seen = parse_cursor(self.signer.open(key, raw))
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
        key = step_key(self.prefix, epoch, step)
        if self.store.check([key]):  # decided already (a restart reads its steps again): its
            self.counters.late += 1  # slices must stay the ones the decision committed to
            return False
        ids, lengths = self.source.batch(epoch, step)
        start = time.perf_counter()
        records: list[bytes] = []
        try:
            plan = plan_batch(self.planner, ids, lengths, budget=self.budget)
            if self.slices:  # the slices first: a reader that sees the header finds its slice
                header, records = slice_plan(plan)
                _set_many(self.store, _record_keys(key, records), records)
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
            for k in _record_keys(key, records):  # nobody will read them
                self.store.delete_key(k)
        return won

    def __enter__(self) -> PlanService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clone(store: Store) -> Store:
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


def _record_keys(key: str, records: list[bytes]) -> list[str]:
    """The keys of a sliced plan's records (one per span of positions)."""
    return [slice_key(key, k) for k in range(len(records))]


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
