"""Online calibration: measured micro-batches in, versioned cost models out.

    calibrator = OnlineCalibrator(load_profile("cpu-gloo"), ranks_per_node=8)
    ...
    new = calibrator.observe(measurements, waves)    # after each step, where they are gathered
    if new is not None:                              # a refit was adopted: model version + 1
        planner = VersionedPlanner(planner, new)     # plans from now on are priced with it
    calibrator.save("profiles/my-cluster.json")      # the next run starts calibrated

One process calibrates (the plan service, or rank 0); every rank must plan with the same model
version at the same step, so versions travel with the plans (``plan.stats["model_version"]``) and
are handed to the other ranks explicitly: by a collective at a step boundary
(:class:`dyncp.runtime.measure.CollectiveCalibration`) or through the Store
(:class:`dyncp.model_channel.ModelChannel`), where a fallback plan names the version it uses.

Refits are rate-limited (``refit_every`` new micro-batches) and adopted only when they predict the
buffered measurements better than the current model, so a model never gets worse on what was
measured. The buffer is bounded (:class:`MeasurementBuffer`). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dyncp.cost_model.calibrate import (
    CalibrationError,
    CalibrationResult,
    Measurement,
    MeasurementBuffer,
    WaveMeasurement,
    fit_profile,
)
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, ProfileError
from dyncp.plan import StepPlan

__all__ = [
    "ModelVersion",
    "OnlineCalibrator",
    "VersionedPlanner",
    "decode_measurements",
    "encode_measurements",
]

#: Largest encoded measurement record a reader accepts (bytes): bounded memory per record.
MAX_RECORD_BYTES = 4 << 20
#: Plausibility limits on a decoded measurement (a record is refused beyond them).
MAX_CP, MAX_LENGTH, MAX_SECONDS = 1 << 20, 1 << 31, 1e6


@dataclass(frozen=True)
class ModelVersion:
    """A cost-model profile and its version number (0: the profile the job started with)."""

    version: int
    profile: Profile

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    @property
    def digest(self) -> str:
        """Short content hash: two processes holding the same version hold the same numbers."""
        return hashlib.blake2b(self.profile.to_json().encode(), digest_size=8).hexdigest()

    def model(self, ranks_per_node: int) -> CostModel:
        return CostModel(self.profile, ranks_per_node)

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "profile": json.loads(self.profile.to_json())})

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelVersion:
        """Decode; any malformed input raises ProfileError (never another exception)."""
        try:
            data = json.loads(text)
            version = data["version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(f"version must be an integer >= 0, got {version!r}")
            return cls(version, Profile.model_validate(data["profile"]))
        except ProfileError:
            raise
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise ProfileError(f"not a model version record: {exc}") from None


class VersionedPlanner:
    """A planner whose plans carry the model version they were priced with.

    Delegates everything to ``planner`` built on ``version``'s cost model; ``plan()`` adds
    ``plan.stats["model_version"]``. ``planner.model`` must be the version's model (use
    :meth:`rebuild` to move a planner to a new version).
    """

    def __init__(self, planner: Any, version: ModelVersion) -> None:
        self.inner = planner
        self.version = version

    @classmethod
    def rebuild(cls, planner: Any, version: ModelVersion) -> VersionedPlanner:
        """``planner`` with the same options on ``version``'s model (a shallow copy: the solver
        and its status counters are shared)."""
        import copy

        base = planner.inner if isinstance(planner, VersionedPlanner) else planner
        inner = copy.copy(base)
        inner.model = version.model(base.model.ranks_per_node)
        return cls(inner, version)

    def plan(self, lengths: Sequence[int] | np.ndarray) -> StepPlan:
        plan = self.inner.plan(lengths)
        plan.stats["model_version"] = self.version.version
        return plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ---------------------------------------------------------------------------------- records


def encode_measurements(
    step: int, microbatches: Sequence[Measurement], waves: Sequence[WaveMeasurement] = ()
) -> bytes:
    """A compact JSON record of one step's measurements (what travels through the Store)."""
    return json.dumps(
        {
            "step": int(step),
            "mb": [[m.cp, list(m.lengths), m.seconds] for m in microbatches],
            "waves": [[w.seconds, w.busy_seconds] for w in waves],
        },
        separators=(",", ":"),
    ).encode()


def decode_measurements(raw: bytes) -> tuple[int, list[Measurement], list[WaveMeasurement]]:
    """Inverse of :func:`encode_measurements`; any malformed record raises CalibrationError.

    Total on arbitrary bytes (the Store is writable by whoever reaches it): wrong types, huge
    numbers, deep nesting and non-finite values are all CalibrationError.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise CalibrationError(f"measurement record of {len(raw)} bytes (max {MAX_RECORD_BYTES})")
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise TypeError(f"a record is a JSON object, got {type(data).__name__}")
        step = data["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an integer, got {step!r}")
        mbs = []
        for item in data["mb"]:
            cp, lengths, seconds = item
            if not isinstance(cp, int) or not all(isinstance(s, int) for s in lengths):
                raise TypeError("cp and lengths must be integers")
            if cp > MAX_CP or any(s > MAX_LENGTH for s in lengths) or not seconds <= MAX_SECONDS:
                raise ValueError(
                    f"a measurement beyond what any job runs (cp <= {MAX_CP}, lengths <= "
                    f"{MAX_LENGTH}, seconds <= {MAX_SECONDS})"
                )
            mbs.append(Measurement(cp, tuple(lengths), float(seconds)))
        waves = [WaveMeasurement(float(s), float(b)) for s, b in data["waves"]]
    except CalibrationError:
        raise
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as exc:
        raise CalibrationError(f"malformed measurement record: {exc}") from None
    return step, mbs, waves


# ---------------------------------------------------------------------------------- calibrator


class OnlineCalibrator:
    """Keeps measurements, refits the profile now and then, and versions the results.

    Args:
        profile: the job's starting profile (version 0).
        ranks_per_node: the job's node size.
        buffer: where measurements are kept (default: 256 per CP size, 256 waves).
        refit_every: new micro-batch measurements between refits.
        min_measurements: no refit before this many are held.
        min_gain: a refit is adopted only when it lowers the mean relative error on the held
            measurements by at least this much (absolute), so noise does not churn versions.

    Attributes:
        current: the adopted model version.
        history: every refit tried, adopted or not (bounded: the last 64).
        rejected: measurement records refused as malformed.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        ranks_per_node: int,
        buffer: MeasurementBuffer | None = None,
        refit_every: int = 64,
        min_measurements: int = 32,
        min_gain: float = 0.002,
    ) -> None:
        if refit_every < 1 or min_measurements < 1:
            raise ValueError(
                f"refit_every and min_measurements must be >= 1, got {refit_every}, "
                f"{min_measurements}"
            )
        if not (math.isfinite(min_gain) and min_gain >= 0):
            raise ValueError(f"min_gain must be a finite number >= 0, got {min_gain}")
        if profile.layer_mix is not None:  # refused here, not silently at every refit
            raise CalibrationError(
                f"profile {profile.name!r} has a layer_mix section; online calibration refits "
                "dense-transformer profiles only"
            )
        self.ranks_per_node = ranks_per_node
        self.buffer = buffer or MeasurementBuffer()
        self.refit_every = refit_every
        self.min_measurements = min_measurements
        self.min_gain = min_gain
        self.current = ModelVersion(0, profile)
        self.history: list[tuple[CalibrationResult, bool]] = []
        self.rejected = 0
        self.refits = 0  # refits tried (history keeps the last 64 of them)
        self._since_fit = 0

    @property
    def last(self) -> CalibrationResult | None:
        """The latest refit tried, or None."""
        return self.history[-1][0] if self.history else None

    def observe(
        self, microbatches: Iterable[Measurement], waves: Iterable[WaveMeasurement] = ()
    ) -> ModelVersion | None:
        """Add one step's measurements; returns the new version when a refit was adopted."""
        mbs = list(microbatches)
        self.buffer.add(mbs)
        self.buffer.add(waves)
        self._since_fit += len(mbs)
        if self._since_fit < self.refit_every or len(self.buffer) < self.min_measurements:
            return None
        return self.refit()

    def observe_record(self, raw: bytes) -> ModelVersion | None:
        """:meth:`observe` an encoded record; a malformed one is counted and ignored."""
        try:
            _, mbs, waves = decode_measurements(raw)
        except CalibrationError:
            self.rejected += 1
            return None
        return self.observe(mbs, waves)

    def refit(self) -> ModelVersion | None:
        """Fit now on what the buffer holds; the new version if adopted."""
        self._since_fit = 0
        try:
            result = fit_profile(
                self.current.profile,
                self.buffer.microbatches(),
                ranks_per_node=self.ranks_per_node,
                waves=self.buffer.waves(),
                min_measurements=self.min_measurements,
            )
        except CalibrationError:
            return None
        adopted = result.error_after <= result.error_before - self.min_gain
        self.refits += 1
        self.history = [*self.history[-63:], (result, adopted)]
        if not adopted:
            return None
        self.current = ModelVersion(self.current.version + 1, result.profile)
        return self.current

    def save(self, path: str | Path) -> Path:
        """Write the current profile as JSON (provenance says what it was fitted from)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.current.profile.to_json())
        return path
