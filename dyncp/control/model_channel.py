"""Cost-model versions and measurements through the job's Store.

With a plan service (a thread on rank 0, or ``python -m dyncp.service``), calibration happens where
the plans are made, and the trainers and the service talk only through the Store:

    trainers (rank 0)  --push(step, measurements)-->  dyncp/<prefix>/meas/<n>
    plan service       --drain()--> OnlineCalibrator --publish(version)--> dyncp/<prefix>/model/v<k>
                                                                          dyncp/<prefix>/model/latest

Keys (under ``dyncp/<prefix>/``)::

    meas/next      counter (Store.add): the number of the last record pushed
    meas/<n>       one step's measurements (dyncp.cost_model.calibration.online.encode_measurements)
    model/v<k>     model version k (ModelVersion JSON); written once, before ``latest`` names it
    model/latest   "<k>": the newest published version

Agreement: a version is written before ``model/latest`` points to it, and never rewritten, so any
version a reader learns from ``latest`` can be fetched by every rank. A fallback decision names
the version it was priced with (``FALLBACK v<k>``: see ``dyncp.service``), and every rank reads
that same decision, fetches that same version and computes the same plan.

Signed like the plans (``dyncp.control.signing``): with the job's secret every record and version is
sealed with an HMAC over its key, and a reader refuses anything else (counted in ``rejected``).

Bounded: the pusher deletes records ``max_pending`` behind its newest (a service that is not
draining costs at most that many keys); the service deletes what it drained, and versions older
than ``keep_versions`` behind the newest. Malformed records or versions (the Store is writable by
whoever reaches it) are counted and skipped, never raised.
"""

from __future__ import annotations

import contextlib
import logging
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
        grace: seconds a drain waits for a record whose number was taken but that is not
            written yet (``push`` takes the number, then writes the record: a drain between the
            two sees the gap). Past it the pusher is taken to have died in between, and the
            record is counted in ``lost``.
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
        self._next_key = store_key(prefix, "meas", "next")
        self._read = 0
        self._gap: tuple[int, float] | None = None  # (record awaited, since when)

    def _record_key(self, n: int) -> str:
        return store_key(self.prefix, "meas", str(n))

    def push(
        self,
        step: int,
        microbatches: Sequence[Measurement],
        waves: Sequence[WaveMeasurement] = (),
    ) -> None:
        """Publish one step's measurements (from one process, e.g. rank 0 after a gather)."""
        n = int(self.store.add(self._next_key, 1))
        key = self._record_key(n)
        self.store.set(key, self.signer.seal(key, encode_measurements(step, microbatches, waves)))
        old = n - self.max_pending
        if old > 0:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(self._record_key(old))

    def drain(self, calibrator: OnlineCalibrator) -> ModelVersion | None:
        """Feed every record pushed since the last drain to ``calibrator``, in push order; the
        newest version it adopted, or None. Records are deleted once read.

        A record not written yet stops the drain there: the next drain starts from it (one
        pushed between the counter and the write is read then, not skipped), and gives up on it
        after ``grace`` seconds (counted in ``lost``, as are records the pusher evicted unread)."""
        newest = int(self.store.add(self._next_key, 0))
        if newest < self._read:  # the counter restarted: a new job under the same prefix
            self._read, self._gap = 0, None
        adopted = None
        first = max(self._read + 1, newest - self.max_pending + 1)
        evicted = first - self._read - 1  # the pusher deleted them before any drain read them
        if evicted > 0:
            self.lost += evicted
            log.warning("%d measurement records evicted before they were drained", evicted)
        for n in range(first, newest + 1):
            key = self._record_key(n)
            if not self.store.check([key]):
                if self._waits_for(n):
                    break
                self._read = n
                continue
            self._read, self._gap = n, None
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
