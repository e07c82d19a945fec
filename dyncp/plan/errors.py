"""PlanError: the one exception a broken rule of the plan contract raises, naming the rule.

Its own module because every layer of the plan raises it -- the topology's memory rules, the JSON
codec's hardening, ``validate()``, the slices -- and each of those modules imports it from here
without importing the others.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan breaks a rule of the contract.

    Attributes:
        rule: short name of the violated rule (e.g. ``"exactly-once"``, ``"capacity"``).
        ids: the offending sequence ids, ranks or group starts, as named in the message.
    """

    def __init__(self, rule: str, message: str, ids: Sequence[int] = ()) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.ids = tuple(int(i) for i in ids)
