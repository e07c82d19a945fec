"""Whether the plan service serves this run: one check at start instead of a fallback every step.

With a secret, every record a reader accepts is bound to its run (``dyncp.control.signing``), so a
service started with another run id than the readers' (``--run-id A`` against ``run_id="B"``, a
service bound to no run against ranks bound to one, or the other way round) publishes plans that
every reader rejects: each step then falls back, late or rejected, and nothing says why. So the
service announces its run when it starts and the readers compare it before their first step.

The announcement, at ``dyncp/<prefix>/run`` (``protocol.run_key``), is written by
``PlanService.start``: with a secret, ``RUN <tag>`` where the tag is a keyed hash of the service's
run id (``PlanSigner.run_tag``: HMAC-SHA256 under the secret), sealed under the secret and no
run, so that a reader of any run can check the record and then compare the tag with its own
run's; neither the run id nor the secret is in the Store. A service without a secret writes
``UNSIGNED`` (the readers with a secret would reject all its plans).

A reader waits for an announcement of its own run up to ``seconds`` (the readers may start
before the service; an earlier run's announcement may still be there until the new service
overwrites it), polling the key, and ends with a verdict (``RUN_OK`` or the code of what it saw
last); ``verdict_message`` turns a code into the one line every rank raises
(:class:`ServiceRunError`). The sampler compares the codes over its agreement group first, so
that every rank raises the same error even when the announcement arrives while some ranks are
still waiting and others have stopped. Readers without a secret skip the check: their records
are bound to no run.

A Store client without the secret can delete or overwrite the announcement: the readers then
stop at start with a clear error (a denial of service, like writing garbage at a step key); it
cannot make a reader accept a service of another run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dyncp.control.signing import PlanSigner
from dyncp.plan import PlanError

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "RUN_CHECK_SECONDS",
    "RUN_OK",
    "ServiceRunError",
    "announcement",
    "verdict",
    "verdict_message",
    "wait_for_run",
]

#: Seconds a reader waits at start for the service's announcement of its run (the default of
#: ``SamplerConfig.service_wait``): ``python -m dyncp.service`` may start after the ranks, and
#: its own default ``--connect-timeout`` is 60 s.
RUN_CHECK_SECONDS = 60.0

_RUN = b"RUN "
_UNSIGNED = b"UNSIGNED"

# Verdicts, in the order the agreement's MAX picks the one every rank reports.
RUN_OK = 0
_ABSENT = 1  # nothing at the key
_UNSIGNED_SERVICE = 2  # a service without the secret
_FOREIGN = 3  # not signed with this job's secret, or not an announcement
_SERVICE_UNBOUND = 4  # the service is bound to no run, this rank to one
_READER_UNBOUND = 5  # this rank is bound to no run, the service to one
_OTHER_RUN = 6  # the service is bound to another run


class ServiceRunError(ValueError):
    """The plan service does not serve this run (its run id, its secret, or no service)."""


def announcement(signer: PlanSigner, key: str) -> bytes:
    """What a service with ``signer`` writes at the run key ``key`` when it starts."""
    if not signer.authenticated:
        return _UNSIGNED
    return signer.unbound().seal(key, _RUN + signer.run_tag())


def verdict(signer: PlanSigner, key: str, record: bytes | None) -> int:
    """The code of what ``record`` (None: nothing at ``key``) says to a reader with ``signer``
    (which must have a secret): ``RUN_OK`` when it announces this reader's run."""
    if record is None:
        return _ABSENT
    if record == _UNSIGNED:
        return _UNSIGNED_SERVICE
    try:
        body = signer.unbound().open(key, record)
    except PlanError:
        return _FOREIGN
    if not body.startswith(_RUN):
        return _FOREIGN
    tag = body[len(_RUN) :]
    if tag == signer.run_tag():
        return RUN_OK
    if not signer.run:
        return _READER_UNBOUND
    if tag == signer.unbound().run_tag():
        return _SERVICE_UNBOUND
    return _OTHER_RUN


def wait_for_run(store: Store, signer: PlanSigner, key: str, seconds: float) -> int:
    """Poll ``key`` until it announces ``signer``'s run or ``seconds`` have passed; the verdict
    of the last record seen (``RUN_OK``, or why not)."""
    end = time.monotonic() + seconds
    pause = 0.001
    while True:
        record = store.get(key) if store.check([key]) else None
        code = verdict(signer, key, record)
        left = end - time.monotonic()
        if code == RUN_OK or left <= 0:
            return code
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.05)


def verdict_message(code: int, *, key: str, run: str, seconds: float) -> str:
    """The one line a reader raises for ``code`` (not ``RUN_OK``): what is wrong and the fix."""
    mine = f"run_id {run!r}" if run else "no run id"
    within = f"within {seconds:g} s"
    why = {
        _ABSENT: f"no plan service announced itself at {key} {within}: start "
        "python -m dyncp.service (or serve=True on one rank) with the same prefix",
        _UNSIGNED_SERVICE: f"the plan service at {key} has no secret, this rank has one: every "
        "plan would be rejected; give the service the job's DYNCP_PLAN_SECRET",
        _FOREIGN: f"the record at {key} is not a run announcement signed with this job's "
        "secret (a service with another secret, or a forged record)",
        _SERVICE_UNBOUND: f"the plan service at {key} is bound to no run, this rank to {mine}: "
        f"every plan would be rejected; give it --run-id equal to the ranks' run_id",
        _READER_UNBOUND: f"the plan service at {key} is bound to a run, this rank to none: give "
        "every rank the service's run id (run_id= or $DYNCP_RUN_ID)",
        _OTHER_RUN: f"the plan service at {key} serves another run than this rank's ({mine}) "
        f"{within}: give python -m dyncp.service --run-id equal to the ranks' run_id (or the "
        "same $DYNCP_RUN_ID to both)",
    }
    if code not in why:
        raise ValueError(f"unknown run-check verdict {code!r}")
    return why[code]
