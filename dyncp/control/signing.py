"""Signed plan records: what the plan service writes at a step key, and how readers check it.

The job's Store (torch's TCPStore) accepts any client that reaches its port, with no
authentication, so anything at a plan key may have been written by someone other than the plan
service. With a per-job secret (``DYNCP_PLAN_SECRET``, or a file named by
``DYNCP_PLAN_SECRET_FILE``, both set by the launcher on every process of the job), each record is
sealed with an HMAC-SHA256 over the key and the body::

    dyncp-hmac-sha256 <64 hex digits> <body>

The key is part of the MAC, so a signed plan cannot be replayed at another step's key. So is the
run (``run``: an id that differs between runs of the same job, see ``DynamicCPSampler``), so a
record from an earlier run of the same job -- same secret, same prefix, same keys -- does not
verify in this one. A reader with the secret accepts only records that carry a valid MAC for
their own key and run; anything else is a :class:`PlanError` (rule ``"signature"``) that the
reader counts and answers with the step's deterministic fallback. Without a secret, records are
the bare bodies and a warning says, once per process, that the channel is unauthenticated.
Either way a record longer than ``MAX_RECORD_BYTES`` is refused (rule ``"size"``) before it is
checked or decoded.

A body is either plan JSON or a fallback record: ``FALLBACK``, optionally followed by a space and
a short suffix (e.g. ``FALLBACK v3``, the cost-model version the fallback is priced with). The
suffix is inside the MAC.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import warnings
from pathlib import Path

from dyncp.plan import PlanError

__all__ = [
    "FALLBACK",
    "MAX_RECORD_BYTES",
    "RUN_ENV",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "PlanSigner",
    "UnauthenticatedPlansWarning",
    "is_fallback",
]

FALLBACK = b"FALLBACK"
SECRET_ENV = "DYNCP_PLAN_SECRET"
SECRET_FILE_ENV = "DYNCP_PLAN_SECRET_FILE"
#: The run id given by the launcher (the same on every process of one run, new for each run).
RUN_ENV = "DYNCP_RUN_ID"
#: Longest record accepted: 64 MiB (a plan of 131,072 sequences on 16,384 ranks is ~6.5 MB).
MAX_RECORD_BYTES = 64 << 20
#: Shortest secret accepted: 16 bytes (128 bits), the HMAC key length below which it is weak.
MIN_SECRET_BYTES = 16
_TAG = b"dyncp-hmac-sha256 "
_MAC_HEX = 64


class UnauthenticatedPlansWarning(UserWarning):
    """Plans travel through the Store without a signature (no per-job secret was given)."""


def is_fallback(body: bytes) -> bool:
    """Whether a record body is a fallback decision (``FALLBACK`` or ``FALLBACK <suffix>``)."""
    return body == FALLBACK or body.startswith(FALLBACK + b" ")


class PlanSigner:
    """Seals and opens the records at plan keys with the job's secret (or none).

    Args:
        secret: the per-job secret; None reads it from the environment (see :meth:`from_env`).
        run: the run the records belong to (part of every MAC; "" binds to no run).

    Raises:
        ValueError: a secret shorter than 16 bytes, or an unreadable secret file.
    """

    def __init__(self, secret: bytes | str | None, *, run: str = "") -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the plan secret has {len(secret)} bytes; give at least {MIN_SECRET_BYTES} "
                "(e.g. 32 random bytes from the launcher)"
            )
        if not isinstance(run, str) or "\0" in run:
            raise ValueError(f"run must be a string without NUL bytes, got {run!r}")
        self._secret = secret
        self.run = run

    @classmethod
    def from_env(cls, secret: bytes | str | None = None, *, run: str = "") -> PlanSigner:
        """The given secret, else ``$DYNCP_PLAN_SECRET``, else the file ``$DYNCP_PLAN_SECRET_FILE``.

        Without any, the signer is unauthenticated and a warning says so (once per process).
        """
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or None
        if secret is None and os.environ.get(SECRET_FILE_ENV):
            path = Path(os.environ[SECRET_FILE_ENV])
            try:
                secret = path.read_bytes().strip()
            except OSError as exc:
                raise ValueError(
                    f"{SECRET_FILE_ENV}={path}: cannot read the plan secret ({exc.strerror})"
                ) from None
        if secret is None:
            warnings.warn(
                "dyncp plans travel through the job's Store UNAUTHENTICATED: any process that "
                f"reaches the Store's port can replace them. Set {SECRET_ENV} (or "
                f"{SECRET_FILE_ENV}) to the same secret on every process of the job.",
                UnauthenticatedPlansWarning,
                stacklevel=1,  # one location: Python's default filter shows it once per process
            )
        return cls(secret, run=run)

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def private_key(self, key: str) -> str:
        """``key`` with a suffix only holders of the secret (and the run) can compute, so a
        Store client without it cannot name the key to overwrite it (a TCPStore cannot list its
        keys); ``key`` itself without a secret. For values a job rewrites all the time (the
        cursor), where a forger's overwrite, though refused, would hide the genuine value."""
        if self._secret is None:
            return key
        tag = hmac.new(
            self._secret, b"private\0" + self.run.encode() + b"\0" + key.encode(), hashlib.sha256
        )
        return f"{key}-{tag.hexdigest()[:32]}"

    def unbound(self) -> PlanSigner:
        """A signer with this one's secret and no run: for records every run of the job must
        be able to check (the plan service's run announcement, ``dyncp.service.run_check``)."""
        return PlanSigner(self._secret, run="")

    def run_tag(self) -> bytes:
        """A keyed tag of this signer's run (32 hex digits): equal for equal secrets and runs,
        and without the secret it tells nothing of the run, so it may be written in the Store
        where the run id itself may not. Requires a secret."""
        if self._secret is None:
            raise ValueError("a run tag needs the job's secret")
        tag = hmac.new(self._secret, b"run-tag\0" + self.run.encode(), hashlib.sha256)
        return tag.hexdigest()[:32].encode()

    def _mac(self, key: str, body: bytes) -> bytes:
        assert self._secret is not None
        msg = key.encode() + b"\0" + body
        if self.run:  # records of no run keep the form they always had
            msg = b"run " + self.run.encode() + b"\0" + msg
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, body: bytes) -> bytes:
        """The record to store at ``key`` (deterministic: every rank seals the same bytes)."""
        if self._secret is None:
            return body
        return _TAG + self._mac(key, body) + b" " + body

    def open(self, key: str, record: bytes) -> bytes:
        """The body of the record found at ``key``.

        Raises:
            PlanError: (rule ``"size"``) the record is longer than ``MAX_RECORD_BYTES``;
                (rule ``"signature"``) with a secret: the record is unsigned, malformed, or its
                MAC does not match this key, run and body.
        """
        if len(record) > MAX_RECORD_BYTES:
            raise PlanError(
                "size", f"the record at {key} has {len(record)} bytes (at most {MAX_RECORD_BYTES})"
            )
        if self._secret is None:
            if record.startswith(_TAG):  # signed by a service that has a secret; cannot check
                return record[len(_TAG) + _MAC_HEX + 1 :]
            return record
        if not record.startswith(_TAG) or len(record) < len(_TAG) + _MAC_HEX + 1:
            raise PlanError("signature", f"the record at {key} is not signed")
        mac = record[len(_TAG) : len(_TAG) + _MAC_HEX]
        body = record[len(_TAG) + _MAC_HEX + 1 :]
        if not hmac.compare_digest(mac, self._mac(key, body)):
            raise PlanError("signature", f"the record at {key} has a wrong signature")
        return body
