"""The job's namespace in the Store: every dyncp key is ``dyncp/<prefix>/...``; the prefix check.

The plan service's keys (``dyncp.service.protocol``) and the model and measurement channels'
(``dyncp.control.model_channel``) share one Store per job, so one function says what a prefix may
be: a non-empty string without ``/``, so that no job's keys can reach into another's. Torch-free.
"""

from __future__ import annotations

__all__ = ["check_prefix", "store_key"]


def check_prefix(prefix: str) -> str:
    """``prefix``, if it is a non-empty string without ``/``; else ValueError naming it."""
    if not prefix or not isinstance(prefix, str) or "/" in prefix:
        raise ValueError(f"prefix must be a non-empty string without '/', got {prefix!r}")
    return prefix


def store_key(prefix: str, *parts: str) -> str:
    """The Store key ``dyncp/<prefix>/<parts...>`` (``prefix`` checked)."""
    return "/".join(("dyncp", check_prefix(prefix), *parts))
