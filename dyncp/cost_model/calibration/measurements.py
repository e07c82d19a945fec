"""What calibration learns from: measured micro-batches and waves, and the bounded buffer of them.

A measurement arrives from the runtime, from a Store record anyone on the job's network can
write, or from a user's code; each is checked once, here, with an error that names the field and
what is allowed, and normalised to plain Python numbers (numpy integers and floats are accepted
and converted, so a record built from numpy arrays encodes as JSON like any other).

The buffer keeps the most recent measurements per CP size and remembers *regimes*: when the
calibrator detects that the machine changed (every time moved by the same factor, a slower
network), it marks a change point, and measurements from before it are fitted with a free level
of their own (``dyncp.cost_model.calibration.fit``): they still say how cost varies with lengths and
CP sizes, but no longer what a micro-batch costs now.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BufferedMeasurement",
    "CalibrationError",
    "Measurement",
    "MeasurementBuffer",
    "WaveMeasurement",
]


class CalibrationError(ValueError):
    """Measurements that cannot calibrate anything (the message says what is wrong)."""


def _integer(what: str, value: object, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise CalibrationError(
            f"{what} must be an integer >= {low} (int or numpy integer), got {value!r} "
            f"({type(value).__name__})"
        )
    out = int(value)
    if out < low:
        raise CalibrationError(f"{what} must be an integer >= {low}, got {out}")
    return out


def _seconds(what: str, value: object, *, positive: bool) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise CalibrationError(
            f"{what} must be a real number of seconds, got {value!r} ({type(value).__name__})"
        )
    out = float(value)
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        bound = "> 0" if positive else ">= 0"
        raise CalibrationError(f"{what} must be finite and {bound}, got {out!r}")
    return out


@dataclass(frozen=True, slots=True)
class Measurement:
    """One micro-batch as run: its CP size, its sequence lengths and the group's seconds.

    ``seconds`` is the slowest rank of the group (ring ranks finish together; the micro-batch is
    over when the last one is). ``heads`` > 1: the group was split into ``heads`` x
    ``cp // heads`` (``dyncp.plan.Group.heads``).

    Raises:
        CalibrationError: a field of the wrong type (``True``, ``2.0`` or ``'100'`` where an
            integer is meant) or out of range; numpy integers and floats are accepted.
    """

    cp: int
    lengths: tuple[int, ...]
    seconds: float
    heads: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cp", _integer("measurement cp", self.cp, 1))
        set_(self, "heads", _integer("measurement heads", self.heads, 1))
        if self.cp % self.heads:
            raise CalibrationError(f"measurement heads {self.heads} must divide its cp {self.cp}")
        raw = self.lengths
        if isinstance(raw, (str, bytes)) or not isinstance(raw, (tuple, list, np.ndarray)):
            raise CalibrationError(
                "measurement lengths must be a non-empty sequence (tuple, list or numpy array) "
                f"of integers >= 1, got {raw!r} ({type(raw).__name__})"
            )
        lengths = tuple(_integer("each measurement length", s, 1) for s in list(raw))
        if not lengths:
            raise CalibrationError("measurement lengths must be a non-empty sequence, got ()")
        set_(self, "lengths", lengths)
        set_(self, "seconds", _seconds("measurement seconds", self.seconds, positive=True))


@dataclass(frozen=True, slots=True)
class WaveMeasurement:
    """One wave as run: its wall-clock seconds and its slowest group's micro-batch seconds.

    The difference is what the wave's synchronisation cost (``overheads.wave_seconds``).
    """

    seconds: float
    busy_seconds: float

    def __post_init__(self) -> None:
        for name in ("seconds", "busy_seconds"):
            value = _seconds(f"wave measurement {name}", getattr(self, name), positive=False)
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class BufferedMeasurement:
    """A held measurement with where it came from: ``order`` (arrival number, from 0) and
    ``step`` (the calibrator's step count when it arrived)."""

    order: int
    step: int
    measurement: Measurement


class MeasurementBuffer:
    """The most recent measurements, bounded: ``per_cp`` micro-batches per CP size, ``waves`` waves.

    Bounded per CP size so that a run dominated by one CP size still remembers the others (the
    fit needs each size to learn its ring cost). Recent-first: each CP size keeps its newest
    ``per_cp``, and :meth:`mark_change` records a change point so that the fit prices what came
    before it at a level of its own (``regimes``), so the model follows a machine that changes
    within a few steps instead of waiting for old data to age out. Memory is
    O(per_cp x CP sizes x sequences per micro-batch).
    """

    def __init__(self, per_cp: int = 256, waves: int = 256) -> None:
        for name, value in (("per_cp", per_cp), ("waves", waves)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.per_cp = per_cp
        self._mb: dict[tuple[int, int], deque[BufferedMeasurement]] = {}
        self._waves: deque[WaveMeasurement] = deque(maxlen=waves)
        self._changes: list[int] = []  # steps at which a new regime starts, increasing
        self.seen = 0  # micro-batch measurements ever added

    def add(self, items: Iterable[Measurement | WaveMeasurement], *, step: int = 0) -> None:
        """Hold ``items`` (arrived at ``step``); the oldest of a full CP size is forgotten."""
        for m in items:
            if isinstance(m, WaveMeasurement):
                self._waves.append(m)
            elif isinstance(m, Measurement):
                key = (m.cp, m.heads)
                held = self._mb.setdefault(key, deque(maxlen=self.per_cp))
                held.append(BufferedMeasurement(self.seen, step, m))
                self.seen += 1
            else:
                raise CalibrationError(
                    f"a buffer holds Measurement and WaveMeasurement objects, got "
                    f"{type(m).__name__}"
                )

    def entries(self) -> list[BufferedMeasurement]:
        """Held micro-batches, by (CP size, heads) then age (a deterministic order)."""
        return [e for key in sorted(self._mb) for e in self._mb[key]]

    def microbatches(self) -> list[Measurement]:
        """Held micro-batch measurements, by (CP size, heads) then age."""
        return [e.measurement for e in self.entries()]

    def waves(self) -> list[WaveMeasurement]:
        return list(self._waves)

    def mark_change(self, step: int) -> None:
        """The machine changed: measurements that arrived before ``step`` belong to older
        regimes from now on."""
        if self._changes and step <= self._changes[-1]:
            return
        self._changes.append(step)

    def move_change(self, step: int) -> None:
        """Place the latest change point at ``step`` instead (after the one before it): where
        a change began is known better a few steps later."""
        if not self._changes or (len(self._changes) > 1 and step <= self._changes[-2]):
            raise ValueError(f"no latest change point that can move to step {step}")
        self._changes[-1] = step

    def regime(self, entry: BufferedMeasurement) -> int:
        """0 for the current regime, k for the one k change points back."""
        return sum(1 for c in self._changes if entry.step < c)

    @property
    def change_points(self) -> tuple[int, ...]:
        return tuple(self._changes)

    def discard(self, drop: Callable[[BufferedMeasurement], bool]) -> int:
        """Forget every held micro-batch for which ``drop`` is true; how many were dropped."""
        dropped = 0
        for key in list(self._mb):
            held = self._mb[key]
            kept = [e for e in held if not drop(e)]
            dropped += len(held) - len(kept)
            if kept:
                self._mb[key] = deque(kept, maxlen=self.per_cp)
            else:
                del self._mb[key]
        return dropped

    def __len__(self) -> int:
        return sum(len(d) for d in self._mb.values())
