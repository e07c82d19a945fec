"""One plan per step, proven before it runs: every rank compares its plan digest with the others'.

The sampler (before the first micro-batch of a step is yielded) and ``runtime.execute`` (before
the first collective of a step) call :func:`agree` with where they are (e.g. epoch and step) and
the digest of the plan they are about to run. One synchronous all_gather of a few int64 on a CPU
(gloo) group compares them; if any rank is elsewhere or holds another plan, every rank raises the
same :class:`PlanMismatchError` (one message, the same everywhere), in that step, naming the
ranks and the digests. A rank that never arrives makes the others raise
:class:`PlanAgreementError` after the group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "PendingAgreement",
    "PlanAgreementError",
    "PlanMismatchError",
    "agree",
    "format_digest",
]


class PlanAgreementError(RuntimeError):
    """The plan comparison itself failed (a rank did not arrive in time, or died)."""


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


def format_digest(digest: int) -> str:
    """A digest as 16 hex digits (the signed int64 read as unsigned)."""
    return f"{digest & (2**64 - 1):016x}"


class PendingAgreement:
    """One comparison in flight: the all_gather is started now and checked by :meth:`result`.

    Ranks must start their comparisons in the same order on the group (each one is a
    collective); several may be in flight at once.
    """

    def __init__(
        self, group: ProcessGroup, *, where: Sequence[int], digest: int, label: str
    ) -> None:
        self.group, self.label = group, label
        self.ranks = list(dist.get_process_group_ranks(group))
        mine = torch.tensor([*where, digest], dtype=torch.int64)
        self._out = [torch.empty_like(mine) for _ in self.ranks]
        try:
            self._work = dist.all_gather(self._out, mine, group=group, async_op=True)
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: BaseException) -> PlanAgreementError:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return PlanAgreementError(
            f"{self.label}: the plan agreement over ranks {self.ranks[0]}..{self.ranks[-1]} "
            f"failed (a rank did not arrive within the group's timeout or exited): {first}"
        )

    def result(self) -> None:
        """Wait (at most the group's timeout) and raise unless every rank agreed.

        Raises:
            PlanMismatchError: some rank is at another position or holds another plan.
            PlanAgreementError: the all_gather failed.
        """
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        _compare(self.ranks, [tuple(int(v) for v in t.tolist()) for t in self._out], self.label)


def agree(group: ProcessGroup, *, where: Sequence[int], digest: int, label: str) -> None:
    """Raise on every rank of ``group`` unless all hold the same ``where`` and ``digest``.

    Args:
        group: a CPU (gloo) group over the ranks that must agree.
        where: this rank's position (e.g. ``(epoch, step)``); ranks at other positions differ.
        digest: the 64-bit signed digest of the plan this rank is about to run.
        label: the position in words, for messages (e.g. ``"epoch 0 step 3"``).

    Raises:
        PlanMismatchError: some rank is at another position or holds another plan.
        PlanAgreementError: the all_gather failed (a rank did not arrive within the group's
            timeout, or its process died).
    """
    PendingAgreement(group, where=where, digest=digest, label=label).result()


def _compare(ranks: list[int], rows: list[tuple[int, ...]], label: str) -> None:
    if len(set(rows)) == 1:
        return
    counts = {row: rows.count(row) for row in rows}
    majority = max(counts, key=lambda row: (counts[row], row == rows[0]))
    odd = [r for r, row in zip(ranks, rows) if row != majority]
    digests = [row[-1] for row in rows]
    detail = ""
    if any(row[:-1] != majority[:-1] for row in rows):
        at = {r: row[:-1] for r, row in zip(ranks, rows) if row[:-1] != majority[:-1]}
        detail = f"; they are at {at}, the others at {majority[:-1]}"
    shown = sorted({format_digest(d) for d in digests})
    raise PlanMismatchError(
        f"{label}: ranks {odd} executed a different plan from the other ranks{detail} "
        f"(digests {' vs '.join(shown)}; by rank: "
        f"{dict(zip(ranks, (format_digest(d) for d in digests)))}); check that every rank has "
        "the same lengths, seed, batch size and planner, and that nobody else writes the "
        "job's Store",
        odd,
        digests,
    )
