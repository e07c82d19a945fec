"""Cost-model versions and measurements through the job's Store.

With a plan service (a thread on rank 0, or ``python -m dyncp.serve``), calibration happens where
the plans are made, and the trainers and the service talk only through the Store:

    trainers (rank 0)  --push(step, measurements)-->  dyncp/<prefix>/meas/<n>
    plan service       --drain()--> OnlineCalibrator --publish(version)--> dyncp/<prefix>/model/v<k>
                                                                          dyncp/<prefix>/model/latest

Keys (under ``dyncp/<prefix>/``)::

    meas/next      counter (Store.add): the number of the last record pushed
    meas/<n>       one step's measurements (dyncp.calibration.encode_measurements)
    model/v<k>     model version k (ModelVersion JSON); written once, before ``latest`` names it
    model/latest   "<k>": the newest published version

Agreement: a version is written before ``model/latest`` points to it, and never rewritten, so any
version a reader learns from ``latest`` can be fetched by every rank. A fallback decision names
the version it was priced with (``FALLBACK v<k>``: see ``dyncp.service``), and every rank reads
that same decision, fetches that same version and computes the same plan.

Bounded: the pusher deletes records ``max_pending`` behind its newest (a service that is not
draining costs at most that many keys); the service deletes what it drained, and versions older
than ``keep_versions`` behind the newest. Malformed records or versions (the Store is writable by
whoever reaches it) are counted and skipped, never raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dyncp.calibration import ModelVersion, OnlineCalibrator, encode_measurements
from dyncp.cost_model.calibrate import Measurement, WaveMeasurement
from dyncp.cost_model.schema import ProfileError

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["MeasurementChannel", "ModelChannel"]

log = logging.getLogger(__name__)


def _key(prefix: str, *parts: str) -> str:
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix must be a non-empty string without '/', got {prefix!r}")
    return "/".join(("dyncp", prefix, *parts))


class ModelChannel:
    """Publishes and reads cost-model versions in the Store.

    Args:
        store: the job's Store.
        prefix: job namespace (the samplers' ``prefix``).
        keep_versions: older versions than this many behind the newest are deleted.
    """

    def __init__(self, store: Store, prefix: str, keep_versions: int = 8) -> None:
        self.store = store
        self.prefix = prefix
        self.keep_versions = keep_versions
        self.rejected = 0
        self._cache: dict[int, ModelVersion] = {}
        self._latest_key = _key(prefix, "model", "latest")

    def _version_key(self, version: int) -> str:
        return _key(self.prefix, "model", f"v{version}")

    def publish(self, version: ModelVersion) -> None:
        """Write ``version`` (once), then point ``latest`` to it."""
        key = self._version_key(version.version)
        self.store.compare_set(key, "", version.to_json())
        self.store.set(self._latest_key, str(version.version))
        self._cache[version.version] = version
        old = version.version - self.keep_versions
        if old > 0:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(self._version_key(old))

    def latest(self) -> int | None:
        """The newest published version number, or None (none yet, or an unreadable value)."""
        if not self.store.check([self._latest_key]):
            return None
        raw = self.store.get(self._latest_key)
        try:
            value = int(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
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
            mv = ModelVersion.from_json(self.store.get(key))
        except ProfileError as exc:
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
    """

    def __init__(self, store: Store, prefix: str, max_pending: int = 256) -> None:
        self.store = store
        self.prefix = prefix
        self.max_pending = max_pending
        self._next_key = _key(prefix, "meas", "next")
        self._read = 0

    def _record_key(self, n: int) -> str:
        return _key(self.prefix, "meas", str(n))

    def push(
        self,
        step: int,
        microbatches: Sequence[Measurement],
        waves: Sequence[WaveMeasurement] = (),
    ) -> None:
        """Publish one step's measurements (from one process, e.g. rank 0 after a gather)."""
        n = int(self.store.add(self._next_key, 1))
        self.store.set(self._record_key(n), encode_measurements(step, microbatches, waves))
        old = n - self.max_pending
        if old > 0:
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(self._record_key(old))

    def drain(self, calibrator: OnlineCalibrator) -> ModelVersion | None:
        """Feed every record pushed since the last drain to ``calibrator``; the newest version
        it adopted, or None. Records are deleted once read."""
        newest = int(self.store.add(self._next_key, 0))
        if newest < self._read:  # the counter restarted: a new job under the same prefix
            self._read = 0
        adopted = None
        for n in range(max(self._read + 1, newest - self.max_pending + 1), newest + 1):
            key = self._record_key(n)
            if not self.store.check([key]):
                continue
            raw = self.store.get(key)
            with contextlib.suppress(RuntimeError, NotImplementedError):  # Store without delete
                self.store.delete_key(key)
            new = calibrator.observe_record(raw)
            adopted = new or adopted
        self._read = newest
        return adopted
