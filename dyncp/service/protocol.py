"""The plan service's Store protocol: the keys, what each holds, and who writes it when.

One process plans (a thread on one training rank, or ``python -m dyncp.service`` next to the job);
every rank reads the published plan of each step. A plan that is not there by a rank's deadline is
replaced, on every rank, by the deterministic greedy plan of that step, computed locally. All of
it runs over a ``torch.distributed.Store`` (the job's TCPStore); no process group is needed.

Store protocol (keys under ``dyncp/<prefix>/``)::

    cursor              "<epoch> <step>": written by reader rank 0 (one writer) when it starts
                        needing a step, sealed like the plans; with a secret at
                        ``cursor-<tag>``, a name only holders of the secret can compute
                        (``PlanSigner.private_key``), so that a client rewriting the cursor
                        cannot hide rank 0's from the service
    run                 the run the service serves, written by the service when it starts:
                        with a secret, a keyed tag of its run id (never the id), signed
                        (``dyncp.service.run_check``); readers with the secret compare it with
                        their own run's at start
    e<epoch>/s<step>    the step's decision, written once with compare_set(key, "", value):
                        the plan JSON (by the service) or FALLBACK (by a reader whose deadline
                        passed first), sealed with the job's secret and run
                        (``dyncp.control.signing``)

Each step key is a one-shot register: the first writer wins and nothing rewrites it, so every rank
reads the same value however late the plan and however differently the ranks time out. Every
genuine decision is non-empty; an empty value (which ``compare_set(key, "", ...)`` cannot tell
from an absent key) is no decision, so a reader that finds one offers its fallback in its place
and takes whatever the register then holds. A plan that arrives after a reader wrote FALLBACK is
counted late (``ServiceCounters.late``) and unused. The service plans the steps ``cursor ..
cursor + lookahead`` (spilling into epoch + 1 at the end of an epoch), following the cursor where
rank 0 last put it, forward or back. Reader rank 0 deletes step keys ``keep_steps`` behind it, so
the Store stays bounded (what stays: the last ``keep_steps`` keys, and at most ``lookahead`` keys
of an epoch + 1 that a job never runs).

Anything can be written at these keys by any client of the Store: readers decode every value
totally (a StepPlan or a PlanError, never a crash), reject unsigned or wrongly signed records, or
records of another run, when the job has a secret, and fall back deterministically, counting why.
A cursor that is not two non-negative integers (or, with a secret, not sealed for this run) is a
counted service error, logged at most once per ``BAD_CURSOR_LOG_SECONDS``; the service keeps
serving. Without a secret a forged cursor is followed until rank 0 writes its next one (one
step). When the Store itself fails the service thread stops and says why
(``PlanService.failure``).

Slices (``slices`` on the service and every reader; ``dyncp.plan.slice``): the step's decision
is a slice header (signed like a plan) that commits to one record per span of positions (a
node), written first at ``e<epoch>/s<step>/n<record>``; a reader checks for the header and its
span's record together and reads both in one request (``get_many``: ``multi_get``), and checks
the record against the header. The first position of a span deletes the span's record
``keep_steps`` steps later (not on reading: a job restarted from a checkpoint behind its readers
reads the same steps again), and the service never republishes a step already decided (its
records stay the ones the decision committed to). A reader whose record is missing or does not
verify cannot run the step: :class:`SliceUnavailable` makes its sampler say so in the per-step
agreement, and every rank runs its slice of the step's deterministic fallback
(``PlanUnusable``).

The publisher (``dyncp.service.publisher``) and the readers (``dyncp.service.client``) both speak
it; this module holds what they share -- the key names, the cursor's format, the batches both
sides plan -- so that neither imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "BatchSource",
    "cursor_key",
    "cursor_value",
    "get_many",
    "parse_cursor",
    "run_key",
    "slice_key",
    "step_key",
]


class BatchSource(Protocol):
    """The global batches of each epoch (``dyncp.sampler.BatchSchedule`` implements it)."""

    def num_steps(self, epoch: int) -> int: ...

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset indices, admitted lengths) of one global batch."""
        ...


def step_key(prefix: str, epoch: int, step: int) -> str:
    """Store key holding the decision for one step."""
    return f"dyncp/{prefix}/e{epoch}/s{step}"


def slice_key(key: str, record: int) -> str:
    """Store key of one slice record (one span of positions, ``dyncp.plan.record_index``) of the
    plan decided at step key ``key``."""
    return f"{key}/n{record}"


def get_many(store: Store, keys: list[str]) -> list[bytes]:
    """The values of keys known to be set, in one request where the Store can (``multi_get``;
    torch's TCPStore, HashStore and PrefixStore can), else one ``get`` each."""
    multi = getattr(store, "multi_get", None)
    if multi is not None:
        try:
            return list(multi(keys))
        except (NotImplementedError, TypeError):
            pass
    return [store.get(k) for k in keys]


def cursor_key(prefix: str) -> str:
    """Store key of the cursor: the step reader rank 0 needs now."""
    return f"dyncp/{prefix}/cursor"


def run_key(prefix: str) -> str:
    """Store key of the service's run announcement (``dyncp.service.run_check``)."""
    return f"dyncp/{prefix}/run"


def cursor_value(epoch: int, step: int) -> bytes:
    """The cursor's value (before sealing): ``b"<epoch> <step>"``."""
    return f"{epoch} {step}".encode()


def parse_cursor(raw: bytes) -> tuple[int, int] | None:
    """(epoch, step) from a cursor value, or None unless it is two integers >= 0."""
    parts = raw.split()
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 18 for p in parts):
        return None
    return int(parts[0]), int(parts[1])
