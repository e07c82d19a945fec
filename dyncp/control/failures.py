"""Naming the rank that failed a step, through the Store, when collectives with it cannot.

A rank whose ``step_fn`` raises leaves its error on the board and raises at once. The others learn
of it while they wait at a synchronisation point (they watch one counter in the Store between
polls of the collective), or after their own ring collectives with it fail. A rank that hangs,
exits or never reaches a synchronisation point leaves nothing: the survivors report, wait for one
another, and name the ranks that stayed silent.

Who is named (:meth:`FailureBoard.culprit`), in this order:

1. a rank whose own code raised (the earliest such report);
2. the ranks that stayed silent until the survivors stopped waiting;
3. the ranks that arrived *late*: after the first survivor had already given up waiting for them
   (a timeout). A rank that stalls for 1.1 T and resumes finds its peers gone and reports too, so
   it is not silent; but it arrived after their timeout fired, which no waiting rank can have
   done (a waiting rank arrived before, by definition). Arrival is the time a rank reached the
   synchronisation point, or, for a rank whose collective timed out, the timeout's start (the
   failure time less T); for any other communication error the error's time. A margin of
   ``LATE_MARGIN`` T absorbs the milliseconds in which a timeout's closed connections reach the
   ranks blocked behind it. Times are wall clocks (``time.time()``): ranks on different hosts
   must agree to a small fraction of T, which NTP gives.
4. nobody, when every rank reported in time and no one raised: the message says so and lists what
   each rank saw, rather than blame a rank that merely reported first.

The survivors wait for one another until ``SURVIVOR_WAIT`` T after they entered the failing wait:
a survivor blocked in the same collective is released by its timeout (T) and then reports; the
rest is margin for a loaded machine.

Trust: the job's Store accepts any client, so every record is sealed with an HMAC under a
secret that never touches the Store: the first rank of the pool's control group draws 32 random
bytes at start-up and broadcasts them over that group (:func:`shared_secret`). A record that does
not verify (forged, replayed from another pool or run, or garbled) is ignored and counted
(``FailureBoard.forged``).

Signing alone does not stop a client from *removing* a genuine report, or replacing it with
garbage: either makes a healthy rank look silent, and the survivors then blame it. So a report
is also out of every other client's reach, by three rules:

* its key is unpredictable: ``<scope>/w<w>/<tag>`` where ``tag`` is an HMAC of the slot and
  position under the secret, so only the pool's ranks know where reports live (a TCPStore
  client cannot list keys; it can only name them);
* it is written once (``compare_set(key, "", report)``): a rank's first report in a slot stands;
* a reader keeps every report it has verified: deleting it after it was read changes nothing.

No counter decides anything: a counter is a value anyone can set to ``"abc"``, after which the
Store server fails every ``add`` on it (and a TCPStore drops the connection). A waiter polls the
Store's key count (``num_keys``, computed by the server, not a stored value) as a hint that
something was written, and re-reads only the positions it has no verified report for. Keys (under
the pool's namespace; ``scope`` is ``c<n>`` for the n-th ``execute`` call, ``w`` the wave, ``-1``
the plan agreement before the first wave)::

    <scope>/w<w>/<tag(p)>   rank p's signed report:
                            "<kind> <timed_out> <arrived> <failed> <message>";
                            kind: raised | comm | ok (reached the synchronisation point);
                            w = number of waves: the gradient reduction after the call

Nothing is written while steps succeed; these keys exist only for failed steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dyncp.control.signing import PlanSigner
from dyncp.plan import PlanError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

__all__ = [
    "Culprit",
    "FailureBoard",
    "Report",
    "is_communication_error",
    "is_timeout",
    "name_after_failed_wait",
    "shared_secret",
]

log = logging.getLogger(__name__)

_COMM = re.compile(
    r"timed out|timeout|connection (closed|reset|refused)|pair closure|broken pipe|"
    r"peer|socket|NCCL error|watchdog",
    re.IGNORECASE,
)
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_KINDS = ("raised", "comm", "ok")
#: Longest message kept in a report (a traceback's first lines are enough to name the error).
MAX_MESSAGE = 2000
#: Survivors wait for one another until this many timeouts after they entered the failing wait:
#: a survivor blocked in the same collective is released by the timeout (1) and then reports;
#: the rest is margin for a loaded machine. Below 2: every rank raises within 2 T.
SURVIVOR_WAIT = 1.5
#: A rank is late when it arrived more than this many timeouts after the first timeout fired.
LATE_MARGIN = 0.05
#: Seconds between two reads of the report counter while a rank waits for the others' reports.
POLL_SECONDS = 0.02


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed (a peer timed out or left), not the rank's code."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM.search(str(exc)))


def is_timeout(exc: BaseException) -> bool:
    """Whether a communication error is a timeout (this rank waited T for a peer)."""
    return is_communication_error(exc) and bool(_TIMEOUT.search(str(exc)))


def shared_secret(group: ProcessGroup) -> bytes:
    """32 random bytes drawn by the group's first rank and broadcast to the others (collective).

    The bytes travel over the group's own connections, never through the Store, so a Store
    client cannot learn them; each pool (and each run) gets new ones.
    """
    ranks = dist.get_process_group_ranks(group)
    mine = dist.get_rank()
    data = torch.zeros(32, dtype=torch.uint8)
    if mine == ranks[0]:
        data = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8).clone()
    dist.broadcast(data, src=ranks[0], group=group)
    return bytes(data.tolist())


@dataclass(frozen=True, slots=True)
class Culprit:
    """Who failed a step and how, as every rank can tell from the Store."""

    ranks: tuple[int, ...]
    message: str


@dataclass(frozen=True, slots=True)
class Report:
    """One rank's signed report (times are wall clocks, seconds since the epoch)."""

    kind: str  # raised | comm | ok
    timed_out: bool  # the error this rank saw was a timeout: it waited T for someone
    arrived: float  # when it reached the point where it waited (see the module docstring)
    failed: float  # when it learned of the failure
    message: str
    wave: int = 0  # the slot it was read from (not encoded: the key says it)

    def encode(self) -> bytes:
        text = self.message.replace("\n", " ")[:MAX_MESSAGE]
        times = f"{self.arrived:.6f} {self.failed:.6f}"
        return f"{self.kind} {int(self.timed_out)} {times} {text}".encode()

    @classmethod
    def decode(cls, body: bytes) -> Report:
        """Parse a report body; ValueError unless it is exactly what :meth:`encode` writes."""
        parts = body.decode("utf-8").split(" ", 4)
        if len(parts) != 5 or parts[0] not in _KINDS or parts[1] not in ("0", "1"):
            raise ValueError("not a failure report")
        arrived, failed = float(parts[2]), float(parts[3])
        if not (math.isfinite(arrived) and math.isfinite(failed)):
            raise ValueError("report times must be finite")
        return cls(parts[0], parts[1] == "1", arrived, failed, parts[4])


class FailureBoard:
    """The signed reports of one failing call (see the module docstring for keys and rules).

    Args:
        store: the pool's Store namespace.
        scope: the call's key prefix (``c<n>`` for ``execute`` call n; the same on every rank).
        world: ranks on the axis (positions 0..world-1; ``names`` maps them to global ranks).
        names: global rank of each position.
        secret: the key reports are sealed with (:func:`shared_secret`).
        timeout: T, the groups' timeout in seconds.

    Attributes:
        forged: reports read that did not verify or parse (ignored).
        store_errors: Store operations that failed (each logged; the collectives' timeouts
            still bound the step).
    """

    def __init__(
        self,
        store: Store,
        *,
        scope: str,
        world: int,
        names: Sequence[int],
        secret: bytes,
        timeout: float,
    ) -> None:
        self.store, self.scope, self.world = store, scope, world
        self.names = tuple(names)
        self.timeout = timeout
        self._signer = PlanSigner(secret)
        self._secret = secret
        self._seen = -1  # the Store's key count when last looked at
        self._verified: dict[tuple[int, int], Report] = {}  # (slot, position): reports read
        self.forged = 0
        self.store_errors = 0

    def _key(self, wave: int, position: int) -> str:
        """The report key of a slot and position: unpredictable without the secret."""
        slot = f"{self.scope}/w{wave}"
        tag = hmac.new(self._secret, f"{slot}/r{position}".encode(), hashlib.sha256)
        return f"{slot}/{tag.hexdigest()[:32]}"

    def _store_failed(self, what: str, exc: BaseException) -> None:
        self.store_errors += 1
        log.warning("failure board: %s failed in the Store: %s", what, str(exc).splitlines()[0])

    # ------------------------------------------------------------------------------ writing
    def report(self, wave: int, position: int, report: Report) -> None:
        """Leave this rank's report, once per slot (never raises: a Store failure is logged and
        counted; a second report in the same slot leaves the first)."""
        key = self._key(wave, position)
        try:
            self.store.compare_set(key, "", self._signer.seal(key, report.encode()))
        except (RuntimeError, ValueError) as exc:
            self._store_failed("writing a report", exc)

    def report_error(
        self, wave: int, position: int, exc: BaseException, *, arrived: float | None = None
    ) -> Report:
        """Report an exception this rank caught now (``arrived``: when it reached the wait)."""
        now = time.time()
        timed_out = is_timeout(exc)
        if arrived is None:
            arrived = now - self.timeout if timed_out else now
        kind = "comm" if is_communication_error(exc) else "raised"
        report = Report(kind, timed_out, arrived, now, f"{type(exc).__name__}: {exc}")
        self.report(wave, position, report)
        return report

    def report_ok(self, wave: int, position: int, *, arrived: float, timed_out: bool) -> None:
        """Report that this rank reached the synchronisation point at ``arrived``."""
        self.report(wave, position, Report("ok", timed_out, arrived, time.time(), ""))

    def survivors_until(self, entered: float) -> float:
        """When (``time.monotonic()``) a survivor that entered the failing wait at ``entered``
        stops waiting for the others' reports: ``SURVIVOR_WAIT`` T after it entered, and at least
        T/4 from now."""
        return max(entered + SURVIVOR_WAIT * self.timeout, time.monotonic() + self.timeout / 4)

    # ------------------------------------------------------------------------------ reading
    def changed(self) -> bool:
        """Whether keys were written to the Store since the last look (one Store read of the
        server's key count: a hint only, which no client can poison; a Store without a count
        is always re-read)."""
        try:
            count = int(self.store.num_keys())
        except (RuntimeError, ValueError, NotImplementedError, AttributeError):
            return True
        if count == self._seen:
            return False
        self._seen = count
        return True

    def reports(self, wave: int, earlier: Sequence[int] = ()) -> dict[int, Report]:
        """The verified reports of ``wave`` and the ``earlier`` slots, by position: each
        position's most telling one (raised, then comm, then ok; the earliest of a kind).
        Forged or garbled records are counted and left out; a verified report is kept (read
        once), so a later deletion or rewrite of its key changes nothing."""
        rank = {"raised": 0, "comm": 1, "ok": 2}
        out: dict[int, Report] = {}
        for slot in (*earlier, wave):
            for p in range(self.world):
                found = self._verified.get((slot, p))
                if found is None:
                    found = self._read(slot, p)
                if found is None:
                    continue
                old = out.get(p)
                if old is None or (rank[found.kind], found.failed) < (rank[old.kind], old.failed):
                    out[p] = found
        return out

    def _read(self, slot: int, position: int) -> Report | None:
        """The verified report of one slot and position, or None (absent, forged, garbled)."""
        key = self._key(slot, position)
        if not self.store.check([key]):
            return None
        try:
            found = Report.decode(self._signer.open(key, self.store.get(key)))
        except (PlanError, ValueError, UnicodeDecodeError):
            self.forged += 1
            return None
        found = dataclasses.replace(found, wave=slot)
        self._verified[(slot, position)] = found
        return found

    def culprit(
        self,
        wave: int,
        *,
        suspects: Sequence[int] | None,
        until: float,
        label: str,
        earlier: Sequence[int] = (),
    ) -> Culprit:
        """Wait until ``until`` (``time.monotonic()``) for the survivors to report, then name
        who failed (see the module docstring for the order of the rules).

        Args:
            wave: the wave (or -1, the plan agreement) whose synchronisation failed.
            suspects: positions whose silence matters (the failing ring's members), or None
                for every position.
            until: when to stop waiting for the survivors.
            label: where, in words, for the message.
            earlier: slots (waves) whose reports count too: a rank that failed in an earlier
                wave never reaches this one.
        """
        group = range(self.world) if suspects is None else suspects
        try:
            while True:
                reports = self.reports(wave, earlier)
                raised = [p for p, r in reports.items() if r.kind == "raised"]
                if raised:
                    first = min(raised, key=lambda p: (reports[p].failed, p))
                    return self._named(first, reports[first], label)
                silent = [p for p in group if p not in reports]
                if not silent or time.monotonic() >= until:
                    break
                while time.monotonic() < until and not self.changed():
                    time.sleep(min(POLL_SECONDS, max(0.0, until - time.monotonic())))
        except (RuntimeError, ValueError) as exc:
            self._store_failed("reading the reports", exc)
            return Culprit((), f"{label}: a rank failed and the Store cannot say which ({exc})")
        seen = "; ".join(
            f"rank {self.names[p]}: {r.message or 'reached the synchronisation point'}"
            for p, r in sorted(reports.items())
        )
        if silent:
            names = tuple(self.names[p] for p in silent)
            return Culprit(
                names,
                f"{label}: rank(s) {list(names)} stopped responding (hung, exited, or never "
                f"reached this point; no error reported)"
                + (f"; what the others saw: {seen}" if seen else ""),
            )
        late, first_timeout = self._late(reports)
        if late:
            names = tuple(self.names[p] for p in late)
            delays = ", ".join(
                f"rank {self.names[p]} {reports[p].arrived - first_timeout:.2f} s" for p in late
            )
            return Culprit(
                names,
                f"{label}: rank(s) {list(names)} arrived after the others had timed out waiting "
                f"(timeout {self.timeout:g} s; late by {delays}): stalled or too slow"
                f"; what the others saw: {seen}",
            )
        return Culprit(
            (),
            f"{label}: a collective failed but every rank reported in time and none raised; "
            f"no rank can be named; what each saw: {seen}",
        )

    def _late(self, reports: dict[int, Report]) -> tuple[list[int], float]:
        """Positions that arrived after the first timeout fired (and that first timeout)."""
        timeouts = [r.failed for r in reports.values() if r.timed_out]
        if not timeouts:
            return [], math.inf
        first = min(timeouts)
        margin = LATE_MARGIN * self.timeout
        return sorted(p for p, r in reports.items() if r.arrived > first + margin), first

    def _named(self, position: int, report: Report, label: str) -> Culprit:
        rank = self.names[position]
        where = "the plan agreement" if report.wave < 0 else f"wave {report.wave}"
        return Culprit((rank,), f"{label}: rank {rank} failed in {where}: {report.message}")


def name_after_failed_wait(
    board: FailureBoard,
    wave: int,
    position: int,
    exc: BaseException,
    *,
    entered: float,
    entered_wall: float,
    label: str,
    earlier: Sequence[int] = (),
) -> Culprit:
    """A synchronisation this rank reached in time (at ``entered``, monotonic, and
    ``entered_wall``, wall clock) failed with ``exc``: report that, wait for the survivors and
    name who failed (``earlier``: slots whose reports count too)."""
    board.report_ok(wave, position, arrived=entered_wall, timed_out=is_timeout(exc))
    until = board.survivors_until(entered)
    return board.culprit(wave, suspects=None, until=until, label=label, earlier=earlier)
