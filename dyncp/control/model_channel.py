"""Cost-model versions and measurements through the job's Store.

With a plan service (a thread on rank 0, or ``python -m dyncp.service``), calibration happens where
the plans are made, and the trainers and the service talk only through the Store:

    trainers (rank 0)  --push(step, measurements)-->  dyncp/<prefix>/meas/<n>
    plan service       --drain()--> OnlineCalibrator --publish(version)--> dyncp/<prefix>/model/v<k>
                                                                          dyncp/<prefix>/model/latest

Keys (under ``dyncp/<prefix>/``)::

    meas/head      "<session> <n>": the pusher's session and the number of its last record
                   (a plain set, sealed; written after the record)
    meas/<session>/<n>
                   one step's measurements (dyncp.cost_model.calibration.online.encode_measurements)
    model/v<k>     model version k (ModelVersion JSON); written once, before ``latest`` names it
    model/latest   "<k>": the newest published version

Agreement: a version is written before ``model/latest`` points to it, and never rewritten, so any
version a reader learns from ``latest`` can be fetched by every rank. A fallback decision names
the version it was priced with (``FALLBACK v<k>``: see ``dyncp.service``), and every rank reads
that same decision, fetches that same version and computes the same plan.

Signed like the plans (``dyncp.control.signing``): with the job's secret every record and version is
sealed with an HMAC over its key, and a reader refuses anything else (counted in ``rejected``).

No counter: the job's one pusher numbers its records itself, under a session drawn when it
starts (so a restarted pusher never rewrites a record a drain has not read), and says how far it
got in ``meas/head``, a sealed value, not a ``Store.add`` counter. A counter can be set to
``"abc"`` by any client, after which every ``add`` on it fails in the Store server (a TCPStore
drops the connection); a head that does not verify or parse is counted
(``MeasurementChannel.bad_heads``) and that drain reads nothing.

Bounded: the pusher deletes records ``max_pending`` behind its newest (a service that is not
draining costs at most that many keys); the service deletes what it drained, and versions older
than ``keep_versions`` behind the newest. Malformed records or versions (the Store is writable by
whoever reaches it) are counted and skipped, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dyncp.control.namespace import store_key
from dyncp.control.signing import PlanSigner
from dyncp.cost_model.calibration.fit import Measurement, WaveMeasurement
from dyncp.cost_model.calibration.online import ModelVersion, OnlineCalibrator, encode_measurements
from dyncp.cost_model.schema import ProfileError
from dyncp.plan import PlanError
from dyncp.planner.versioned import VersionedPlanner

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["MeasurementChannel", "ModelChannel", "ServiceCalibration"]

log = logging.getLogger(__name__)


class ModelChannel:
    """Publishes and reads cost-model versions in the Store.

    Args:
        store: the job's Store.
        prefix: job namespace (the samplers' ``prefix``).
        keep_versions: older versions than this many behind the newest are deleted.
        signer: seals and opens the records (default: the job's secret from the environment).
    """

    def __init__(
        self,
        store: Store,
        prefix: str,
        keep_versions: int = 8,
        signer: PlanSigner | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.keep_versions = keep_versions
        self.signer = signer or PlanSigner.from_env()
        self.rejected = 0
        self._cache: dict[int, ModelVersion] = {}
        self._latest_key = store_key(prefix, "model", "latest")

    def _version_key(self, version: int) -> str:
        return store_key(self.prefix, "model", f"v{version}")

    def publish(self, version: ModelVersion) -> None:
        """Write ``version`` (once), then point ``latest`` to it."""
        key = self._version_key(version.version)
        self.store.compare_set(key, "", self.signer.seal(key, version.to_json().encode()))
        latest = self.signer.seal(self._latest_key, b"%d" % version.version)
        self.store.set(self._latest_key, latest)
        self._cache[version.version] = version
        old = version.version - self.keep_versions
        if old > 0:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(self._version_key(old))

    def latest(self) -> int | None:
        """The newest published version number, or None (none yet, or an unreadable value)."""
        if not self.store.check([self._latest_key]):
            return None
        try:
            raw = self.signer.open(self._latest_key, self.store.get(self._latest_key))
            value = int(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):  # PlanError (signature) is a ValueError
            self.rejected += 1
            return None
        return value if value >= 0 else None

    def get(self, version: int) -> ModelVersion | None:
        """Version ``version`` (cached), or None when it is absent or malformed."""
        if version in self._cache:
            return self._cache[version]
        key = self._version_key(version)
        if not self.store.check([key]):
            return None
        try:
            mv = ModelVersion.from_json(self.signer.open(key, self.store.get(key)))
        except (ProfileError, PlanError) as exc:
            log.warning("model version %d in the Store is malformed: %s", version, exc)
            self.rejected += 1
            return None
        if mv.version != version:
            self.rejected += 1
            return None
        self._cache[version] = mv
        return mv


class MeasurementChannel:
    """Carries each step's measurements from the trainers to the calibrating service.

    Args:
        store: the job's Store.
        prefix: job namespace.
        max_pending: records kept for a service that has not drained them yet.
        signer: seals and opens the records (default: the job's secret from the environment).
        grace: seconds a drain waits for a record the head names but that is not in the
            Store (deleted by another client). Past it the record is counted in ``lost``.

    Attributes:
        lost: records that never reached a drain (evicted unread, or missing).
        bad_heads: heads that did not verify or parse (ignored: that drain read nothing).
    """

    def __init__(
        self,
        store: Store,
        prefix: str,
        max_pending: int = 256,
        signer: PlanSigner | None = None,
        grace: float = 30.0,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.max_pending = max_pending
        self.signer = signer or PlanSigner.from_env()
        self.grace = grace
        self.lost = 0
        self.bad_heads = 0
        self._head_key = store_key(prefix, "meas", "head")
        self._session = os.urandom(8).hex()  # this pusher's
        self._pushed = 0
        self._reads: dict[str, int] = {}  # the drain's position in each session seen (recent)
        self._gap: tuple[int, float] | None = None  # (record awaited, since when)

    def _record_key(self, n: int, session: str | None = None) -> str:
        return store_key(self.prefix, "meas", session or self._session, str(n))

    def _head(self) -> tuple[str, int] | None:
        """The pusher's (session, last record) from the head; None if absent or bad (counted)."""
        if not self.store.check([self._head_key]):
            return None
        try:
            parts = self.signer.open(self._head_key, self.store.get(self._head_key)).split()
            if len(parts) != 2 or len(parts[0]) != 16 or not parts[1].isdigit():
                raise PlanError("decode", "expected '<session> <n>'")
            return parts[0].decode("ascii"), int(parts[1])
        except (PlanError, UnicodeDecodeError, ValueError) as exc:
            self.bad_heads += 1
            log.warning("ignoring measurement head: %s", exc)
            return None

    def push(
        self,
        step: int,
        microbatches: Sequence[Measurement],
        waves: Sequence[WaveMeasurement] = (),
    ) -> None:
        """Publish one step's measurements (from the job's one pusher, e.g. position 0 after a
        gather): the record, then the head that names it."""
        n = self._pushed = self._pushed + 1
        key = self._record_key(n)
        self.store.set(key, self.signer.seal(key, encode_measurements(step, microbatches, waves)))
        head = f"{self._session} {n}".encode()
        self.store.set(self._head_key, self.signer.seal(self._head_key, head))
        old = n - self.max_pending
        if old > 0:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(self._record_key(old))

    def drain(self, calibrator: OnlineCalibrator) -> ModelVersion | None:
        """Feed every record pushed since the last drain to ``calibrator``, in push order; the
        newest version it adopted, or None. Records are deleted once read.

        A record the head names that is missing stops the drain there: the next drain starts
        from it, and gives up on it after ``grace`` seconds (counted in ``lost``, as are records
        the pusher evicted unread). A new session (a restarted pusher) is read from its start."""
        head = self._head()
        if head is None:
            return None
        session, newest = head
        if session not in self._reads:
            self._gap = None
            while len(self._reads) >= 4:  # a few sessions remembered: a forged head and back
                self._reads.pop(next(iter(self._reads)))
        read = self._reads.setdefault(session, 0)
        adopted = None
        first = max(read + 1, newest - self.max_pending + 1)
        evicted = first - read - 1  # the pusher deleted them before any drain read them
        if evicted > 0:
            self.lost += evicted
            log.warning("%d measurement records evicted before they were drained", evicted)
        self._reads[session] = max(read, first - 1)
        for n in range(first, newest + 1):
            key = self._record_key(n, session)
            if not self.store.check([key]):
                if self._waits_for(n):
                    break
                self._reads[session] = n
                continue
            self._reads[session], self._gap = n, None
            raw = self.store.get(key)
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(key)
            try:
                raw = self.signer.open(key, raw)
            except PlanError:
                calibrator.rejected += 1
                continue
            new = calibrator.observe_record(raw)
            adopted = new or adopted
        return adopted

    def _waits_for(self, n: int) -> bool:
        """Whether the drain should wait for missing record ``n`` (False: count it lost)."""
        now = time.monotonic()
        if self._gap is None or self._gap[0] != n:
            self._gap = (n, now)
        if now - self._gap[1] < self.grace:
            return True
        self._gap = None
        self.lost += 1
        log.warning("measurement record %d never arrived within %.0f s; skipped", n, self.grace)
        return False


class ServiceCalibration:
    """Online calibration where the plans are made: the plan service's side of the loop.

    ``PlanService`` calls :meth:`poll` between plans: it drains the trainers' measurements, lets
    the calibrator refit, and when a new version is adopted it is first published to the Store
    (so every reader can fetch it before any plan or fallback names it) and then returned as the
    planner the service prices the next plans with.

    Args:
        store, prefix: the job's Store and namespace.
        calibrator: the calibrator (its version 0 must be the profile every rank started with).
        metrics: optional ``dyncp.observability.metrics.Metrics`` to record each refit in.
        save_path: where to write the calibrated profile after each adopted refit (optional).
        interval: seconds between two drains (the service loop polls much more often).
        signer: seals the records (default: the job's secret from the environment).
    """

    def __init__(
        self,
        store: Store,
        prefix: str,
        calibrator: OnlineCalibrator,
        *,
        metrics: Any = None,
        save_path: str | None = None,
        interval: float = 0.05,
        signer: PlanSigner | None = None,
    ) -> None:
        signer = signer or PlanSigner.from_env()
        self.calibrator = calibrator
        self.measurements = MeasurementChannel(store, prefix, signer=signer)
        self.models = ModelChannel(store, prefix, signer=signer)
        self.metrics = metrics
        self.save_path = save_path
        self.interval = interval
        self._next = 0.0
        self._seen_refits = 0
        self._seen_counts = (0, 0, 0, 0)

    def _report(self) -> None:
        cal = self.calibrator
        fresh = cal.refits - self._seen_refits
        self._seen_refits = cal.refits
        counts = (cal.failures, cal.rejected, cal.refused, cal.dropped)
        delta = [now - seen for now, seen in zip(counts, self._seen_counts)]
        self._seen_counts = counts
        if self.metrics is None:
            return
        version = cal.current.version
        for result, adopted in cal.history[-fresh:] if fresh > 0 else ():
            self.metrics.observe_calibration(result, adopted=adopted, version=version)
        self.metrics.observe_calibration_refusals(
            failed=delta[0], record=delta[1], entry=delta[2] - delta[3], dropped=delta[3]
        )

    def bind(self, store: Store) -> None:
        """Use ``store`` (the service thread's own connection) from now on."""
        self.measurements.store = store
        self.models.store = store

    def poll(self, planner: Any) -> Any:
        """``planner``, or a planner on the newly adopted model version."""
        if not isinstance(planner, VersionedPlanner):  # plans name their version from the start
            planner = VersionedPlanner(planner, self.calibrator.current)
        now = time.monotonic()
        if now < self._next:
            return planner
        self._next = now + self.interval
        new = self.measurements.drain(self.calibrator)  # never raises on what was measured
        try:
            self._report()
        except ValueError:  # a metric refused a value: calibration and planning go on
            log.exception("calibration metrics not recorded")
        if new is None:
            return planner
        self.models.publish(new)
        if self.save_path is not None:
            self.calibrator.save(self.save_path)
        log.info(
            "cost model v%d adopted (mean error %.1f%% -> %.1f%%)",
            new.version,
            100 * self.calibrator.last.error_before,
            100 * self.calibrator.last.error_after,
        )
        return VersionedPlanner.rebuild(planner, new)
