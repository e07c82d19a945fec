"""Lower bounds off the critical path, computed on a worker thread after the plan is out.

``Planner.plan`` hands the plan out first; the bound is written into the plan's ``stats`` when
done.

Why: the bounds are a report (how far the plan may be from the best one), and nothing in the
step waits for them; yet at 16,384 ranks the tight LP bound of 131,072 sequences takes as long
as building the plan (3.3-3.6 s measured, the closed form another 0.2-0.4 s). Computed inside
``plan()`` they doubled its latency and broke its deadline. ``Planner(defer_bound=...)`` decides
when they are deferred (``dyncp.planner.planner``); this module runs them.

While a bound is pending, the plan's ``stats`` hold ``None`` under every key the bound fills
(``lower_bound_seconds``, ``simple_lower_bound_seconds``, ``gap_to_lower_bound``,
``gap_to_simple_bound``, ``timings.bound_seconds``) and ``stats["bound"]["status"]`` is
``"PENDING"``. The worker replaces those values one key at a time and never adds or removes a
key, so a reader iterating over ``stats`` meanwhile (the plan service encoding the plan as
JSON) never sees the dict change size; a reader that needs the values calls ``wait``, which
returns once all of them are written. Bounds run one at a time, in the order submitted.

The worker holds the GIL while it builds the LP (Python and numpy) and releases it while
OR-tools solves it (measured: a busy caller thread was never paused more than 0.22 s during a
16,384-rank bound on a loaded 2-core machine). A caller that plans back to back on one core
therefore shares that core with the previous step's bound; one that waits for it (``wait``)
between steps, or a step that lasts longer than the bound, does not. The worker is not a daemon:
a process that ends with a bound pending finishes it first (seconds at 16,384 ranks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from dyncp.plan import StepPlan

__all__ = ["DeferredBounds", "PENDING", "BOUND_KEYS"]

#: ``stats["bound"]["status"]`` while the bound is being computed.
PENDING = "PENDING"
#: Keys of ``stats`` a deferred bound fills (``None`` until then), besides ``bound`` and
#: ``timings.bound_seconds``.
BOUND_KEYS = (
    "lower_bound_seconds",
    "simple_lower_bound_seconds",
    "gap_to_lower_bound",
    "gap_to_simple_bound",
)

log = logging.getLogger(__name__)


class DeferredBounds:
    """Bounds computed on one worker thread, each written into its plan's ``stats``.

    One per ``Planner``; the thread starts with the first deferred bound.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[StepPlan, Future[None]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy: a planner sent to another process) starts with no worker
        and nothing pending: threads and locks do not travel."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def submit(
        self,
        plan: StepPlan,
        compute: Callable[[], dict[str, Any]],
        fallback: Callable[[BaseException], dict[str, Any]],
    ) -> Future[None]:
        """Mark ``plan``'s bound fields pending and fill them with ``compute()`` on the worker.

        ``compute`` returns the fields (``BOUND_KEYS``, ``bound``, ``bound_seconds``); should
        it raise, ``fallback(exc)`` gives the fields to write instead (a bound never fails a
        step). The returned future is done once the fields are written.
        """
        stats = plan.stats
        for key in BOUND_KEYS:
            stats[key] = None
        stats["bound"] = {**stats.get("bound", {}), "deferred": True, "status": PENDING}
        stats.setdefault("timings", {})["bound_seconds"] = None
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dyncp-bound")
            future = self._pool.submit(self._run, plan, compute, fallback)
            self._pending[id(plan)] = (plan, future)
        return future

    def _run(
        self,
        plan: StepPlan,
        compute: Callable[[], dict[str, Any]],
        fallback: Callable[[BaseException], dict[str, Any]],
    ) -> None:
        try:
            try:
                fields = compute()
            except Exception as exc:  # a report: the plan is out already, never fail it
                log.warning("deferred lower bound failed: %r", exc)
                fields = fallback(exc)
            stats = plan.stats
            for key in BOUND_KEYS:
                stats[key] = fields[key]
            stats["timings"]["bound_seconds"] = fields["bound_seconds"]
            stats["bound"] = {**fields["bound"], "deferred": True}
        finally:
            with self._lock:
                self._pending.pop(id(plan), None)

    def pending(self, plan: StepPlan) -> bool:
        """Whether ``plan``'s bound is still being computed."""
        with self._lock:
            entry = self._pending.get(id(plan))
        return entry is not None and entry[0] is plan

    def wait(self, plan: StepPlan, timeout: float | None = None) -> StepPlan:
        """``plan`` once its deferred bound is in its ``stats`` (at once if none is pending).

        Raises:
            TimeoutError: the bound is not done within ``timeout`` seconds.
        """
        with self._lock:
            entry = self._pending.get(id(plan))
        if entry is not None and entry[0] is plan:
            try:
                entry[1].result(timeout)
            except FutureTimeout as exc:  # the builtin from Python 3.11 on, not before
                raise TimeoutError(f"the deferred bound is not done after {timeout} s") from exc
        return plan

    def wait_all(self, timeout: float | None = None) -> None:
        """Return once every bound submitted so far is written."""
        with self._lock:
            futures = [f for _, f in self._pending.values()]
        for future in futures:
            future.result(timeout)

    def close(self) -> None:
        """Let the pending bounds finish, then stop the worker."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
