"""The slot order of a pipelined plan: the anchors' rule, then a local search under the real price.

In a pipeline the first slots fill the stages (warm-up) and the last drain them (cool-down); a
long slot there is paid by every stage that waits on it, while in the steady state it overlaps
the other stages' work. verl orders its dynamic micro-batches so that the smallest sit at both
ends (``verl.utils.seqlen_balancing``: workloads sorted, then dealt alternately to the front
and to the back): :func:`ends_small_order` is that rule on the slots' predicted seconds.

The rule looks at one number per slot; the pipelined price sees the columns: a slot's groups
need not be long on the same columns, and idle columns of one slot can absorb another's. So
:class:`OrderSearch` starts from the better of the plan's own order and the rule's, and tries
moves -- a swap of two slots, or one slot moved elsewhere -- each priced by the caller's
``OrderPrice`` (the pipelined step seconds of the plan with its slots in a given order: the
slots' operation costs do not depend on their order, so a pricer computes them once per plan
and only re-runs the schedule per order), keeping a move only when it is faster (first
improvement). Moves are drawn from a ``random.Random(seed)``, so the same plan, seed and work
budget give the same order on every machine; the search stops after ``evaluations`` prices or
at ``deadline`` (``time.perf_counter()`` seconds), whichever comes first, and never returns an
order priced slower than the one it started from.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dyncp.plan import StepPlan
from dyncp.planner.pipeline.slots import with_order

__all__ = [
    "OrderPrice",
    "OrderPricer",
    "OrderResult",
    "OrderSearch",
    "Price",
    "by_plan",
    "ends_small_order",
]

#: The pipelined step seconds of a plan (``price_pipeline(plan, model).step_seconds``).
Price = Callable[[StepPlan], float]
#: The pipelined step seconds of one plan with its slots in a given order (indices into its
#: slots).
OrderPrice = Callable[[Sequence[int]], float]
#: A plan's ``OrderPrice``.
OrderPricer = Callable[[StepPlan], OrderPrice]


def by_plan(price: Price) -> OrderPricer:
    """The ``OrderPricer`` that prices each order as the reordered plan (no reuse)."""
    return lambda plan: lambda order: price(with_order(plan, order))


def ends_small_order(weights: Sequence[float]) -> list[int]:
    """verl's rule: indices sorted by weight, the smallest dealt alternately to the first and
    the last free position, so the weights rise to the middle and fall again (ties by index)."""
    ranked = sorted(range(len(weights)), key=lambda i: (float(weights[i]), i))
    out = [0] * len(ranked)
    left, right = 0, len(ranked) - 1
    for k, i in enumerate(ranked):
        if k % 2 == 0:
            out[left] = i
            left += 1
        else:
            out[right] = i
            right -= 1
    return out


@dataclass(frozen=True, slots=True)
class OrderResult:
    """The best order found, its price, and what the search did."""

    order: tuple[int, ...]
    seconds: float
    start_seconds: float  # the order it started from (the better of given and rule)
    evaluations: int
    accepted: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderSearch:
    """Local search over slot orders (module docstring).

    Args:
        evaluations: at most this many prices (the deterministic budget).
        seed: the move generator's seed.
    """

    evaluations: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.evaluations, bool) or not isinstance(self.evaluations, int):
            raise ValueError(f"evaluations must be an integer >= 0, got {self.evaluations!r}")
        if self.evaluations < 0:
            raise ValueError(f"evaluations must be an integer >= 0, got {self.evaluations}")

    def run(
        self,
        slots: int,
        price: OrderPrice,
        *,
        start: Sequence[int] | None = None,
        start_seconds: float | None = None,
        deadline: float | None = None,
    ) -> OrderResult:
        """The best order of ``slots`` slots found from ``start`` (default: as they are),
        priced by ``price``; ``start_seconds`` is ``start``'s price when the caller knows it."""
        n = slots
        order = list(range(n)) if start is None else list(start)
        used = 0
        if start_seconds is None:
            start_seconds = price(order)
            used += 1
        best = start_seconds
        accepted = 0
        rng = random.Random(self.seed)
        while n >= 2 and used < self.evaluations:
            if deadline is not None and time.perf_counter() >= deadline:
                break
            i, j = rng.sample(range(n), 2)
            trial = list(order)
            if rng.random() < 0.5:
                trial[i], trial[j] = trial[j], trial[i]
            else:
                trial.insert(j, trial.pop(i))
            seconds = price(trial)
            used += 1
            if seconds < best:
                best, order = seconds, trial
                accepted += 1
        return OrderResult(tuple(order), best, start_seconds, used, accepted)
