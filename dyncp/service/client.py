"""PlanClient: a reader of the plan service; the published plan or, past the deadline, the fallback.

Every rank reads the decision of each step from its one-shot register (``dyncp.service.protocol``);
when none is there by the deadline it offers the fallback in its place and takes whatever the
register then holds, so all ranks run the same plan however late the service. Anything may have
been written at a key, so a value is decoded totally and checked against the batch, and a
rejected one is replaced by the deterministic fallback (``dyncp.service.fallback``), counted.

Readers poll ``store.check`` rather than block in ``store.wait(keys, timeout)``: a timed-out wait
logs C++ warnings on every fallback, and a blocked wait holds the client's connection.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dyncp.control.namespace import check_prefix
from dyncp.control.signing import FALLBACK, PlanSigner, is_fallback
from dyncp.cost_model.calibration.online import ModelVersion
from dyncp.plan import (
    PlanError,
    PlanSlice,
    SliceHeader,
    SliceUnavailable,
    StepPlan,
    check_slice_header,
    is_header,
    open_slice,
    own_slice,
    record_index,
    slice_span,
    use_slices,
)
from dyncp.planner.planner import Planner
from dyncp.planner.versioned import VersionedPlanner
from dyncp.service.fallback import check_plan, fallback_planner, plan_batch
from dyncp.service.protocol import (
    BatchSource,
    cursor_key,
    cursor_value,
    get_many,
    run_key,
    slice_key,
    step_key,
)
from dyncp.service.run_check import RUN_OK, ServiceRunError, verdict_message, wait_for_run

if TYPE_CHECKING:
    from torch.distributed import Store

    from dyncp.control.model_channel import ModelChannel

__all__ = ["Fetched", "PlanClient"]

log = logging.getLogger(__name__)

#: Why a record of the other form is refused (by whether this reader reads slices only).
_FORMS = {
    True: "the service publishes whole plans and this reader reads slices only (slices=True): "
    "give the service slices too, or the reader 'auto'",
    False: "the service publishes slices and this reader reads whole plans only (slices=False): "
    "give the service slices=False too, or the reader 'auto'",
}


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
            :class:`~dyncp.plan.slice.PlanSlice` in ``Fetched.plan``), not the whole plan;
            ``"auto"``: whichever the service publishes, looked for first in the form
            ``dyncp.plan.use_slices`` picks for the planner (what the sampler passes, so that a
            service of the other form costs its readers nothing but the extra reads).
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
        slices: bool | str = False,
    ) -> None:
        if not deadline >= 0 or not late_deadline >= 0:
            raise ValueError(
                f"deadline and late_deadline must be >= 0 seconds, got {deadline}, {late_deadline}"
            )
        self.prefix = check_prefix(prefix)
        self.either = slices == "auto"  # take the form the service publishes
        self.slices = use_slices(slices, planner.topology, pipelined=planner.pipeline is not None)
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
        self._slices: deque[str] = deque()  # its span's record keys (first of a span), oldest first

    def fetch(self, epoch: int, step: int) -> Fetched:
        """The plan of one step: the published one, or the same fallback on every rank."""
        key = step_key(self.prefix, epoch, step)
        ids, lengths = self.source.batch(epoch, step)
        if self.rank == 0:  # one writer: the service follows rank 0
            cursor = self.signer.private_key(cursor_key(self.prefix))
            self.store.set(cursor, self.signer.seal(cursor, cursor_value(epoch, step)))
        value, record, ready = self._read(key)
        if not value:  # none by the deadline, or an empty value: no decision (module docstring)
            value = self.store.compare_set(key, "", self.signer.seal(key, self._fallback_body()))
        self._forget_old(key)
        try:
            body = self.signer.open(key, value)
            self._missed = is_fallback(body)
            if self._missed:
                plan = plan_batch(self._fallback_for(body), ids, lengths)
                return Fetched(self._mine(plan), "fallback", "late", False)
            sliced = is_header(body)
            if sliced != self.slices and not self.either:
                raise PlanError("decode", _FORMS[self.slices])
            if sliced:
                header = SliceHeader.from_json(body)
                check_slice_header(header, topology=self.topology, lengths=lengths)
                mine = self._own_slice(key, header, ids, lengths, record)
                return Fetched(mine, "service", None, ready)
            plan = StepPlan.from_json(body)
            check_plan(plan, topology=self.topology, sample_ids=ids, lengths=lengths)
        except SliceUnavailable:
            raise
        except ValueError as exc:  # PlanError (decoding, signature) or another batch's plan
            log.warning("published plan of epoch %d step %d rejected: %s", epoch, step, exc)
            plan = plan_batch(self.fallback, ids, lengths)
            return Fetched(self._mine(plan), "fallback", "rejected", ready)
        return Fetched(plan, "service", None, ready)

    def check_run(self, seconds: float) -> int:
        """Wait up to ``seconds`` for the plan service to announce this reader's run
        (``dyncp.service.run_check``); the verdict, ``RUN_OK`` when it does. Without a secret
        the records bind no run and there is nothing to check (``RUN_OK``)."""
        if not self.signer.authenticated:
            return RUN_OK
        return wait_for_run(self.store, self.signer, run_key(self.prefix), seconds)

    def run_error(self, code: int, seconds: float) -> ServiceRunError:
        """The error for a ``check_run`` verdict other than ``RUN_OK``."""
        key, run = run_key(self.prefix), self.signer.run
        return ServiceRunError(verdict_message(code, key=key, run=run, seconds=seconds))

    def fallback_slice(self, epoch: int, step: int) -> PlanSlice:
        """This rank's slice of the step's deterministic fallback plan (the same on every
        rank): what every reader runs when some could not use their slices of the header."""
        plan = plan_batch(self.fallback, *self.source.batch(epoch, step))
        return own_slice(plan, self.rank)

    def _mine(self, plan: StepPlan) -> StepPlan | PlanSlice:
        """A plan this rank computed itself, as the reader returns plans (whole, or its slice)."""
        return own_slice(plan, self.rank) if self.slices else plan

    def _read(self, key: str) -> tuple[bytes | None, bytes | None, bool]:
        """The step's decision, this rank's slice record when read with it, and whether the
        decision was there when asked. With slices, the header and the record are checked for
        together and read in one request: two requests a step while the service is ahead."""
        if self.slices:
            own = self._record_key(key)
            if self.store.check([key, own]):
                value, record = get_many(self.store, [key, own])
                return value, record, True
        if self.store.check([key]):
            return self.store.get(key), None, True
        wait = self.late_deadline if self._missed else self.deadline
        return self._poll(key, wait), None, False

    def _record_key(self, key: str) -> str:
        return slice_key(key, record_index(self.topology, self.rank))

    def _own_slice(
        self,
        key: str,
        header: SliceHeader,
        ids: np.ndarray,
        lengths: np.ndarray,
        record: bytes | None,
    ) -> PlanSlice:
        """This rank's slice of a verified header (from its span's record, read with the header
        or now), checked against the batch.

        The record is not deleted on reading: a job restarted from a checkpoint behind its
        readers (a prefetching sampler) reads the same steps again. The span's first position
        deletes it ``keep_steps`` steps later, like the step keys rank 0 deletes
        (``_forget_old``).

        Raises:
            SliceUnavailable: missing, not the header's, or not this batch's.
        """
        own = self._record_key(key)
        if self.rank % slice_span(self.topology) == 0:
            self._forget_slice(own)
        try:
            if record is None:
                if not self.store.check([own]):
                    raise SliceUnavailable(
                        f"rank {self.rank}: no slice at {own}", header.digest, missing=True
                    )
                record = self.store.get(own)
            mine = open_slice(header, record, self.rank)
            for i, length in mine.lengths.items():
                if length != int(lengths[i]) or mine.sample_ids[i] != int(ids[i]):
                    raise PlanError("slice", f"sequence {i} of the slice is not this batch's")
        except SliceUnavailable:
            raise
        except PlanError as exc:
            raise SliceUnavailable(f"rank {self.rank}: {exc}", header.digest) from None
        return mine

    def _forget_slice(self, own: str) -> None:
        """Delete this reader's span record of the step ``keep_steps`` behind ``own``'s."""
        if self.keep_steps < 0 or own in self._slices:
            return
        self._slices.append(own)
        while len(self._slices) > self.keep_steps:
            try:
                self.store.delete_key(self._slices.popleft())
            except (RuntimeError, NotImplementedError):
                self.keep_steps = -1
                return

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
