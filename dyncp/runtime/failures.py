"""Naming the rank that failed a step, through the Store, when collectives with it cannot.

A rank whose ``step_fn`` raises leaves its error in the pool's Store namespace and raises at once.
The others learn of it while they wait at the wave's status exchange (they look at the Store
between polls of the exchange), or after their own ring collectives with it time out. A rank that
hangs, exits or never reaches a synchronisation point leaves nothing: the survivors then mark
themselves as having reported, wait a short grace period, and name the ranks that stayed silent.

Keys (under the pool's namespace; ``n`` counts ``execute`` calls, ``w`` is the wave, ``-1`` the
plan agreement before the first wave)::

    c<n>/first          the rank that reported an error first (compare_set: one writer wins)
    c<n>/w<w>/err/<r>   "<kind> <seconds into the wait> <message>" of rank r; kind: raised|comm
    c<n>/w<w>/ok/<r>    rank r got to the exchange without an error of its own
    c<n>/w<w>/reported  how many ranks wrote one of the two

Nothing is written while steps succeed; these keys exist only for failed steps.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["Culprit", "FailureBoard", "is_communication_error"]

_COMM = re.compile(
    r"timed out|timeout|connection (closed|reset|refused)|pair closure|broken pipe|"
    r"peer|socket|NCCL error|watchdog",
    re.IGNORECASE,
)


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed (a peer timed out or left), not the rank's code."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM.search(str(exc)))


@dataclass(frozen=True, slots=True)
class Culprit:
    """Who failed a step and how, as every rank can tell from the Store."""

    ranks: tuple[int, ...]
    message: str


class FailureBoard:
    """The Store namespace of one ``execute`` call (see the module docstring for the keys).

    Args:
        store: the pool's Store namespace.
        call: the ``execute`` call number (the same on every rank).
        world: ranks on the axis (positions 0..world-1; ``names`` maps them to global ranks).
        names: global rank of each position.
    """

    def __init__(self, store: Store, *, call: int, world: int, names: tuple[int, ...]) -> None:
        self.store, self.call, self.world, self.names = store, call, world, names

    def _key(self, wave: int, what: str) -> str:
        return f"c{self.call}/w{wave}/{what}"

    def report_error(self, wave: int, position: int, exc: BaseException, waited: float) -> None:
        """Leave this rank's error (first one wins ``first``); never raises."""
        kind = "comm" if is_communication_error(exc) else "raised"
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:2000]
        try:
            self.store.set(self._key(wave, f"err/{position}"), f"{kind} {waited:.3f} {text}")
            self.store.compare_set(f"c{self.call}/first", "", f"{wave} {position}")
            self.store.add(self._key(wave, "reported"), 1)
        except (RuntimeError, ValueError):  # the Store is gone too: the collectives still fail
            pass

    def report_ok(self, wave: int, position: int) -> None:
        try:
            self.store.set(self._key(wave, f"ok/{position}"), "")
            self.store.add(self._key(wave, "reported"), 1)
        except (RuntimeError, ValueError):
            pass

    def first(self) -> tuple[int, int] | None:
        """(wave, position) of the first error reported in this call, if any."""
        try:
            key = f"c{self.call}/first"
            if not self.store.check([key]):
                return None
            wave, position = self.store.get(key).split()
            return int(wave), int(position)
        except (RuntimeError, ValueError):
            return None

    def _error(self, wave: int, position: int) -> tuple[str, float, str] | None:
        key = self._key(wave, f"err/{position}")
        if not self.store.check([key]):
            return None
        kind, waited, text = self.store.get(key).decode(errors="replace").split(" ", 2)
        return kind, float(waited), text

    def _reported(self, wave: int, position: int) -> bool:
        keys = [self._key(wave, f"err/{position}"), self._key(wave, f"ok/{position}")]
        return any(self.store.check([k]) for k in keys)

    def culprit(
        self, wave: int, *, suspects: tuple[int, ...] | None, until: float, label: str
    ) -> Culprit:
        """Wait until ``until`` (``time.monotonic()``) for the survivors to report, then name
        who failed: a rank that raised, else the ranks that stayed silent.

        Args:
            wave: the wave (or -1, the plan agreement) whose exchange failed.
            suspects: positions whose silence matters (the failing ring's members), or None
                for every position.
            until: when to stop waiting for the survivors; a survivor blocked in the same
                collective is released by the group's timeout, so this is at least that.
            label: where, in words, for the message.
        """
        end = until
        try:
            while True:
                first = self.first()
                if first is not None:
                    error = self._error(*first)
                    if error is not None and error[0] == "raised":
                        return self._named(first, error, label)
                group = range(self.world) if suspects is None else suspects
                silent = [p for p in group if not self._reported(wave, p)]
                if not silent or time.monotonic() >= end:
                    break
                time.sleep(min(0.02, max(0.0, end - time.monotonic())))
            errors = {p: e for p in range(self.world) if (e := self._error(wave, p)) is not None}
        except (RuntimeError, ValueError) as exc:
            return Culprit((), f"{label}: a rank failed and the Store cannot say which ({exc})")
        error = None if first is None else self._error(*first)
        if first is not None and error is not None and (error[0] == "raised" or not silent):
            return self._named(first, error, label)
        if silent:
            names = tuple(self.names[p] for p in silent)
            seen = "; ".join(f"rank {self.names[p]}: {e[2]}" for p, e in sorted(errors.items()))
            return Culprit(
                names,
                f"{label}: rank(s) {list(names)} stopped responding (hung, exited, or never "
                f"reached this point; no error reported)"
                + (f"; what the others saw: {seen}" if seen else ""),
            )
        return Culprit((), f"{label}: the status exchange failed but every rank reported")

    def _named(self, first: tuple[int, int], error: tuple[str, float, str], label: str) -> Culprit:
        wave, position = first
        rank = self.names[position]
        where = "the plan agreement" if wave < 0 else f"wave {wave}"
        return Culprit((rank,), f"{label}: rank {rank} failed in {where}: {error[2]}")
