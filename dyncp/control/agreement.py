"""One plan per step, proven before it runs: every rank compares its plan digest with the others'.

The sampler (before the first micro-batch of a step is yielded) and ``runtime.execute`` (before
the first collective of a step) call :func:`agree` with where they are (e.g. epoch and step) and
the digest of the plan they are about to run. The comparison is one all_reduce(MAX) of each
value and its bitwise complement (``~x`` reverses the order of int64, so the MAX of ``~x`` is
``~min(x)``): all ranks agree exactly when every maximum equals its minimum. An all_reduce's
latency grows with the logarithm of the group size on NCCL (tree algorithms for small messages)
where an all_gather's bytes grow with it; on the rare path where ranks differ, a second round
(an all_gather of the values) names them: every rank raises the same :class:`PlanMismatchError`
(one message, the same everywhere), in that step, naming the ranks and the digests. A rank that
never arrives makes the others raise :class:`PlanAgreementError` after the group's timeout; with
an :class:`AgreementGroup` (what the sampler uses) that error names the ranks that did not
arrive, through a signed failure board (``dyncp.control.failures``) written only on that path.

A rank that holds the step's plan but cannot run its part (its slice of a sliced plan is missing
or does not verify) says so with ``unusable``, a reason code compared with the rest: every rank
then raises the same :class:`PlanUnusable`, naming those ranks and their reasons, and the caller
falls back on every rank alike. A mismatch with no majority (two ranks, or a tie) names no rank:
the evidence cannot tell which side is wrong, and the message says so.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from dyncp.control.failures import FailureBoard

__all__ = [
    "AgreementGroup",
    "PendingAgreement",
    "PlanAgreementError",
    "PlanMismatchError",
    "PlanUnusable",
    "UNUSABLE_REASONS",
    "agree",
    "format_digest",
]


class PlanAgreementError(RuntimeError):
    """The plan comparison itself failed (a rank did not arrive in time, or died).

    Attributes:
        ranks: the ranks named as the cause (empty when they could not be named).
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class PlanMismatchError(RuntimeError):
    """Ranks were about to run different plans (or different steps) for the same step.

    Attributes:
        ranks: the ranks that differ from the majority.
        digests: each rank's digest (in the group's rank order).
    """

    def __init__(self, message: str, ranks: Sequence[int], digests: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.digests = tuple(digests)


#: What an ``unusable`` code says (codes > 0; 0: the rank can run its part).
UNUSABLE_REASONS = {1: "its slice is missing", 2: "its slice is malformed or does not verify"}


class PlanUnusable(RuntimeError):
    """Every rank holds the same plan, but some cannot run their part of it (the same error on
    every rank, so every rank can fall back alike).

    Attributes:
        ranks: the ranks that cannot run their part.
        reasons: each one's reason code (``UNUSABLE_REASONS``).
    """

    def __init__(self, message: str, ranks: Sequence[int], reasons: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.reasons = tuple(reasons)


def format_digest(digest: int) -> str:
    """A digest as 16 hex digits (the signed int64 read as unsigned)."""
    return f"{digest & (2**64 - 1):016x}"


class PendingAgreement:
    """One comparison in flight: the all_reduce is started now and checked by :meth:`result`.

    Ranks must start their comparisons in the same order on the group (each one is a
    collective); several may be in flight at once.

    Args:
        group: the ranks that must agree.
        where, digest, label: see :func:`agree`.
        board: names the ranks that did not arrive when the comparison fails (optional).
        device: where the comparison's tensors live ("cuda" for an NCCL group).
        unusable: 0, or why this rank cannot run its part of the plan (``UNUSABLE_REASONS``).
    """

    def __init__(
        self,
        group: ProcessGroup,
        *,
        where: Sequence[int],
        digest: int,
        label: str,
        board: FailureBoard | None = None,
        device: torch.device | str = "cpu",
        unusable: int = 0,
    ) -> None:
        self.group, self.label, self.board = group, label, board
        self.ranks = list(dist.get_process_group_ranks(group))
        self._entered, self._entered_wall = time.monotonic(), time.time()
        self._mine = (*(int(v) for v in where), int(unusable), int(digest))
        values = torch.tensor(self._mine, dtype=torch.int64)
        self._both = torch.cat([values, torch.bitwise_not(values)]).to(device)
        try:
            self._work = dist.all_reduce(
                self._both, op=dist.ReduceOp.MAX, group=group, async_op=True
            )
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: BaseException) -> PlanAgreementError:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        text = (
            f"{self.label}: the plan agreement over ranks {self.ranks[0]}..{self.ranks[-1]} "
            f"failed (a rank did not arrive within the group's timeout or exited): {first}"
        )
        if self.board is None:
            return PlanAgreementError(text)
        from dyncp.control.failures import name_after_failed_wait

        culprit = name_after_failed_wait(
            self.board,
            -1,
            self.ranks.index(dist.get_rank()),
            exc,
            entered=self._entered,
            entered_wall=self._entered_wall,
            label=self.label,
        )
        return PlanAgreementError(f"{text}; {culprit.message}", culprit.ranks)

    def result(self) -> None:
        """Wait (at most the group's timeout) and raise unless every rank agreed.

        Raises:
            PlanMismatchError: some rank is at another position or holds another plan.
            PlanUnusable: every rank holds the same plan at the same position, but some said
                they cannot run their part (``unusable``).
            PlanAgreementError: the comparison failed (a rank did not arrive, or died).
        """
        try:
            self._work.wait()
            both = [int(v) for v in self._both.cpu().tolist()]
            n = len(self._mine)
            if both[:n] == [~v for v in both[n:]]:  # every maximum is its minimum: all agree
                return
            # The rare path: a second round to name the ranks that differ.
            mine = torch.tensor(self._mine, dtype=torch.int64, device=self._both.device)
            rows = [torch.empty_like(mine) for _ in self.ranks]
            dist.all_gather(rows, mine, group=self.group)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        _compare(self.ranks, [tuple(int(v) for v in t.cpu().tolist()) for t in rows], self.label)


class AgreementGroup:
    """A CPU group the ranks compare plan digests on, with the board that names absentees.

    Args:
        group: a gloo group over the ranks that must agree; None creates one over the whole job
            with the job's timeout (a collective: every rank of the job must construct it).
        store: where the board lives (default: the job's Store).
        timeout: the group's timeout in seconds (default: the job's).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        store: Store | None = None,
        timeout: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("plan agreement needs torch.distributed to be initialised first")
        from dyncp.control.failures import shared_secret
        from dyncp.control.job import job_timeout

        self.timeout = job_timeout() if timeout is None else float(timeout)
        if group is None:
            span = datetime.timedelta(seconds=self.timeout)
            group = dist.new_group(backend="gloo", timeout=span)
        self.group = group
        self.ranks = tuple(dist.get_process_group_ranks(group))
        base = dist.distributed_c10d._get_default_store() if store is None else store
        self._base_store = base  # kept alive (see GroupPool)
        self.store = dist.PrefixStore(f"dyncp/agree/{group.group_name}/", base)
        self._secret = shared_secret(group)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of the group (a collective)."""
        return bool(self.max(int(bool(flag))))

    def max(self, value: int) -> int:
        """The largest of every rank's ``value`` (a collective: one all_reduce of 8 bytes)."""
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def derive(self, label: str) -> str:
        """An id the group's ranks share and nobody else knows or can predict (32 hex digits),
        new for each group (each run), from the group's secret."""
        return hmac.new(self._secret, label.encode(), hashlib.sha256).hexdigest()[:32]

    def start(
        self, *, where: Sequence[int], digest: int, label: str, unusable: int = 0
    ) -> PendingAgreement:
        """Start one comparison (every rank must start its comparisons in the same order;
        ``unusable``: see :class:`PendingAgreement`)."""
        from dyncp.control.failures import FailureBoard

        board = FailureBoard(
            self.store,
            scope="a" + "-".join(str(int(v)) for v in where),
            world=len(self.ranks),
            names=self.ranks,
            secret=self._secret,
            timeout=self.timeout,
        )
        return PendingAgreement(
            self.group, where=where, digest=digest, label=label, board=board, unusable=unusable
        )


def agree(group: ProcessGroup, *, where: Sequence[int], digest: int, label: str) -> None:
    """Raise on every rank of ``group`` unless all hold the same ``where`` and ``digest``.

    Args:
        group: a CPU (gloo) group over the ranks that must agree.
        where: this rank's position (e.g. ``(epoch, step)``); ranks at other positions differ.
        digest: the 64-bit signed digest of the plan this rank is about to run.
        label: the position in words, for messages (e.g. ``"epoch 0 step 3"``).

    Raises:
        PlanMismatchError: some rank is at another position or holds another plan.
        PlanAgreementError: the comparison failed (a rank did not arrive within the group's
            timeout, or its process died).
    """
    PendingAgreement(group, where=where, digest=digest, label=label).result()


def _compare(ranks: list[int], rows: list[tuple[int, ...]], label: str) -> None:
    """Raise the same error on every rank unless all ``rows`` (where..., unusable, digest) agree."""
    if len(set(rows)) == 1:
        return
    plans = [(*row[:-2], row[-1]) for row in rows]  # position and digest, without the flag
    if len(set(plans)) == 1:  # the same plan everywhere; some ranks cannot run their part
        bad = [(r, row[-2]) for r, row in zip(ranks, rows) if row[-2]]
        said = "; ".join(
            f"rank {r}: {UNUSABLE_REASONS.get(code, f'reason {code}')}" for r, code in bad
        )
        raise PlanUnusable(
            f"{label}: every rank holds the same plan, but {len(bad)} cannot run its part ({said})",
            [r for r, _ in bad],
            [code for _, code in bad],
        )
    counts = {row: plans.count(row) for row in plans}
    top = max(counts.values())
    leaders = [row for row, n in counts.items() if n == top]
    digests = [row[-1] for row in rows]
    shown = sorted({format_digest(d) for d in digests})
    by_rank = dict(zip(ranks, (format_digest(d) for d in digests)))
    if len(leaders) > 1:  # no majority: nothing says which side is wrong
        raise PlanMismatchError(
            f"{label}: ranks hold different plans and no plan has a majority (digests "
            f"{' vs '.join(shown)}; by rank: {by_rank}), so no rank can be named; check that "
            "every rank has the same lengths, seed, batch size and planner, and that nobody else "
            "writes the job's Store",
            [],
            digests,
        )
    majority = leaders[0]
    odd = [r for r, row in zip(ranks, plans) if row != majority]
    detail = ""
    if any(row[:-1] != majority[:-1] for row in plans):
        at = {r: row[:-1] for r, row in zip(ranks, plans) if row[:-1] != majority[:-1]}
        detail = f"; they are at {at}, the others at {majority[:-1]}"
    raise PlanMismatchError(
        f"{label}: ranks {odd} executed a different plan from the other ranks{detail} "
        f"(digests {' vs '.join(shown)}; by rank: {by_rank}); check that every rank has "
        "the same lengths, seed, batch size and planner, and that nobody else writes the "
        "job's Store",
        odd,
        digests,
    )
