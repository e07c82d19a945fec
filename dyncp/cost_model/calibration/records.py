"""What calibration sends through the Store: measurement records and model versions.

One process calibrates (the plan service, or rank 0) and every rank plans with the model
version it adopted, so both directions travel as bytes: a step's measurements from the trainers
(:func:`encode_measurements`, :func:`decode_measurements`) and the versions back
(:class:`ModelVersion`, JSON). The Store is writable by whoever reaches it, so decoding is total
on arbitrary bytes: a record that is not one raises (CalibrationError, ProfileError), and an
implausible entry inside a valid record is refused alone and counted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dyncp.cost_model.calibration.measurements import (
    CalibrationError,
    Measurement,
    WaveMeasurement,
)
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, ProfileError

__all__ = [
    "MAX_RECORD_BYTES",
    "MeasurementRecord",
    "ModelVersion",
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


class MeasurementRecord(NamedTuple):
    """One decoded step: its number, the micro-batches and waves that passed, and how many
    entries were refused (each one alone: the rest of the step is kept)."""

    step: int
    microbatches: list[Measurement]
    waves: list[WaveMeasurement]
    refused: int


def encode_measurements(
    step: int, microbatches: Sequence[Measurement], waves: Sequence[WaveMeasurement] = ()
) -> bytes:
    """A compact JSON record of one step's measurements (what travels through the Store).

    A micro-batch is ``[cp, lengths, seconds]``, or ``[cp, lengths, seconds, heads]`` when its
    group split heads.
    """
    return json.dumps(
        {
            "step": int(step),
            "mb": [
                [m.cp, list(m.lengths), m.seconds, *([m.heads] if m.heads != 1 else [])]
                for m in microbatches
            ],
            "waves": [[w.seconds, w.busy_seconds] for w in waves],
        },
        separators=(",", ":"),
    ).encode()


def _decode_microbatch(item: object) -> Measurement:
    if not isinstance(item, list) or len(item) not in (3, 4):
        raise TypeError(f"a micro-batch is [cp, lengths, seconds(, heads)], got {item!r:.80}")
    cp, lengths, seconds, *rest = item
    heads = rest[0] if rest else 1
    for name, value in (("cp", cp), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r:.40}")
    if not isinstance(lengths, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in lengths
    ):
        raise TypeError("lengths must be a list of integers")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"seconds must be a number, got {seconds!r:.40}")
    if cp > MAX_CP or any(s > MAX_LENGTH for s in lengths) or not seconds <= MAX_SECONDS:
        raise ValueError(
            f"a measurement beyond what any job runs (cp <= {MAX_CP}, lengths <= "
            f"{MAX_LENGTH}, seconds <= {MAX_SECONDS})"
        )
    return Measurement(cp, tuple(lengths), float(seconds), heads)


def decode_measurements(raw: bytes) -> MeasurementRecord:
    """Inverse of :func:`encode_measurements`.

    Total on arbitrary bytes (the Store is writable by whoever reaches it): a record that is not
    one (not JSON, not an object, no step, wrong types, deep nesting) raises CalibrationError; a
    malformed or implausible micro-batch or wave inside a valid record is refused alone and
    counted in ``refused``, so one bad entry does not cost its step's other measurements.
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
        items, wave_items = data["mb"], data["waves"]
        if not isinstance(items, list) or not isinstance(wave_items, list):
            raise TypeError("mb and waves must be lists")
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as exc:
        raise CalibrationError(f"malformed measurement record: {exc}") from None
    mbs: list[Measurement] = []
    waves: list[WaveMeasurement] = []
    refused = 0
    for item in items:
        try:
            mbs.append(_decode_microbatch(item))
        except (ValueError, TypeError, OverflowError):  # CalibrationError is a ValueError
            refused += 1
    for item in wave_items:
        try:
            if not isinstance(item, list) or len(item) != 2:
                raise TypeError("a wave is [seconds, busy_seconds]")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in item):
                raise TypeError("wave seconds must be numbers")
            waves.append(WaveMeasurement(float(item[0]), float(item[1])))
        except (ValueError, TypeError, OverflowError):
            refused += 1
    return MeasurementRecord(step, mbs, waves, refused)
