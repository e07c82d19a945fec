"""Where a sampler's step plans come from, and the record of how each step's plan was obtained.

``LocalPlans`` plans in this process (``lookahead`` steps ahead in a thread); ``StorePlans`` reads
the plan service's plans from the job's Store and runs the service on the rank that serves.
``StepInfo`` and ``SamplerCounters`` record the outcome per step and in total.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from dyncp.data.schedule import BatchSchedule
from dyncp.plan import StepPlan
from dyncp.planner.budget import StepBudget
from dyncp.planner.planner import Planner
from dyncp.service import Fetched, PlanClient, PlanService, lookahead_targets, plan_batch
from dyncp.service.run_check import RUN_OK

__all__ = ["LocalPlans", "SamplerCounters", "StepInfo", "StorePlans"]


@dataclass(frozen=True, slots=True)
class StepInfo:
    """How one step's plan was obtained (passed to ``on_step`` with the plan)."""

    epoch: int
    step: int
    source: str  # "service", "local", "fallback" or "restored" (from a saved state)
    reason: str | None  # for "fallback": "late" or "rejected"
    ready: bool  # the plan was there when the sampler asked (no wait on planning)
    wait_seconds: float  # time the sampler spent obtaining the plan
    digest: int
    microbatches: int  # this rank's micro-batches in the step


@dataclass(slots=True)
class SamplerCounters:
    """Plain counters of one sampler (for logs; a metrics exporter can read or hook them)."""

    steps: int = 0
    service_plans: int = 0
    local_plans: int = 0
    restored_plans: int = 0
    fallbacks: int = 0
    late_plans: int = 0  # fallbacks because no plan was published by the deadline
    rejected_plans: int = 0  # fallbacks because the published plan did not match the batch
    waits: int = 0  # steps whose plan was not ready when asked
    wait_seconds_total: float = 0.0
    wait_seconds_max: float = 0.0
    truncated_samples: int = 0
    skipped_samples: int = 0
    dropped_samples: int = 0  # by drop_last, summed over the epochs iterated

    def record(self, info: StepInfo) -> None:
        """Count one step's plan by where it came from and how long it was waited for."""
        self.steps += 1
        if info.source == "fallback":
            self.fallbacks += 1
            self.late_plans += info.reason == "late"
            self.rejected_plans += info.reason == "rejected"
        elif info.source == "service":
            self.service_plans += 1
        elif info.source == "local":
            self.local_plans += 1
        else:
            self.restored_plans += 1
        self.waits += not info.ready
        self.wait_seconds_total += info.wait_seconds
        self.wait_seconds_max = max(self.wait_seconds_max, info.wait_seconds)


class LocalPlans:
    """Plans in this process, ``lookahead`` steps ahead in one background thread."""

    def __init__(
        self,
        schedule: BatchSchedule,
        planner: Planner,
        lookahead: int,
        *,
        budget: StepBudget | None = None,
    ) -> None:
        self.schedule, self.planner, self.lookahead = schedule, planner, lookahead
        self.budget = budget  # the planner's own limit when None
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[tuple[int, int], Future[StepPlan]] = {}

    def _plan(self, epoch: int, step: int) -> StepPlan:
        return plan_batch(self.planner, *self.schedule.batch(epoch, step), budget=self.budget)

    def fetch(self, epoch: int, step: int) -> Fetched:
        if not self.lookahead:
            return Fetched(self._plan(epoch, step), "local", None, False)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dyncp-lookahead")
        targets = lookahead_targets(self.schedule, epoch, step, self.lookahead)
        for key in [k for k in self._futures if k not in targets]:
            self._futures.pop(key).cancel()
        for key in targets:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._plan, *key)
        future = self._futures.pop((epoch, step))
        ready = future.done()
        return Fetched(future.result(), "local", None, ready)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._futures.clear()


class StorePlans:
    """Plans read from the Store; this rank's service thread starts with the first fetch.

    Before its first fetch the reader checks that the service serves its run
    (``PlanClient.check_run``, waiting up to ``service_wait`` seconds); with ``agree`` (the
    sampler's agreement: the largest of every rank's verdicts, a collective) every rank raises
    the same :class:`~dyncp.service.run_check.ServiceRunError` when any rank's check failed.
    """

    def __init__(
        self,
        client: PlanClient,
        service: PlanService | None,
        *,
        service_wait: float,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        self.client, self.service = client, service
        self.service_wait, self.agree = service_wait, agree
        self._serving = False
        self._checked = False

    def fetch(self, epoch: int, step: int) -> Fetched:
        if self.service is not None and not self._serving:
            self.service.start()
            self._serving = True
        if not self._checked:
            code = self.client.check_run(self.service_wait)
            if self.agree is not None:
                code = self.agree(code)
            if code != RUN_OK:
                raise self.client.run_error(code, self.service_wait)
            self._checked = True
        return self.client.fetch(epoch, step)

    def close(self) -> None:
        if self._serving:
            self.service.stop()
            self._serving = False
