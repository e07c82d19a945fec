"""The catalog of dyncp's metrics: each one's name, help, labels and buckets, as data.

``Metrics`` (``dyncp.observability.metrics``) builds one prometheus_client metric per entry of
``METRICS`` in a loop, so what is exported -- the names the bundled dashboard and alert rules
read -- is one table to read and review, apart from the code that feeds the values. The label
value sets (policies, sources, solver statuses, fallback reasons, calibration stages) are bounded
and live here too: every series a dashboard reads exists from the first scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "CALIBRATION_STAGES",
    "DEFAULT_POLICIES",
    "FALLBACK_REASONS",
    "METRICS",
    "RANK_BUSY",
    "SOLVER_STATUSES",
    "SOURCES",
    "MetricSpec",
]

# The planner's policies (dyncp.planner.planner.POLICIES), repeated so that importing the metrics
# does not import the planner and its solver.
DEFAULT_POLICIES = ("static", "dp-balanced", "batch-adaptive", "megatron", "dyncp")
SOURCES = ("predicted", "measured")
# CP-SAT outcomes plus the planner's own (SKIPPED: no time left, REJECTED: an invalid or worse
# improvement, ERROR: the solver raised); anything else is counted as OTHER.
SOLVER_STATUSES = (
    "OPTIMAL",
    "FEASIBLE",
    "UNKNOWN",
    "INFEASIBLE",
    "MODEL_INVALID",
    "ERROR",
    "SKIPPED",
    "REJECTED",
    "OTHER",
)
# Why a step ran on a locally computed fallback plan instead of the plan service's plan (the
# reasons of dyncp.service.Fetched): no plan by the deadline, a published plan that failed the
# checks, planning raised.
FALLBACK_REASONS = ("late", "rejected", "error")
CALIBRATION_STAGES = ("before", "after")

IMBALANCE_BUCKETS = (1.0, 1.005, 1.01, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 2.0, 3.0)
STEP_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0)
PLAN_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RELATIVE_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric of ``Metrics``: the attribute holding it and how prometheus_client builds it.

    Every gauge is a latest-value gauge: in multi-process mode the most recently written value
    wins (``multiprocess_mode="mostrecent"``).
    """

    attr: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def build(self, registry: CollectorRegistry) -> Any:
        """The metric, registered in ``registry``."""
        extra: dict[str, Any] = {}
        if self.buckets is not None:
            extra["buckets"] = self.buckets
        if self.kind is Gauge:
            extra["multiprocess_mode"] = "mostrecent"
        return self.kind(self.name, self.doc, self.labels, registry=registry, **extra)


_PS, _PCS, _P = ("policy", "source"), ("policy", "cp_size"), ("policy",)

#: Every metric of ``Metrics`` but the opt-in ``RANK_BUSY``, in registration (exposition) order.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        attr="step_imbalance",
        kind=Histogram,
        name="dyncp_step_imbalance_ratio",
        doc="Busiest rank's busy seconds over the mean rank's, per step.",
        labels=_PS,
        buckets=IMBALANCE_BUCKETS,
    ),
    MetricSpec(
        attr="last_step_imbalance",
        kind=Gauge,
        name="dyncp_last_step_imbalance_ratio",
        doc="Imbalance (busiest rank / mean rank) of the latest step.",
        labels=_PS,
    ),
    MetricSpec(
        attr="step_seconds",
        kind=Histogram,
        name="dyncp_step_seconds",
        doc="Step time: predicted by the cost model or measured.",
        labels=_PS,
        buckets=STEP_SECONDS_BUCKETS,
    ),
    MetricSpec(
        attr="last_step_seconds",
        kind=Gauge,
        name="dyncp_last_step_seconds",
        doc="Step time of the latest step.",
        labels=_PS,
    ),
    MetricSpec(
        attr="plan_seconds",
        kind=Histogram,
        name="dyncp_plan_seconds",
        doc="Wall-clock seconds the planner took for one step.",
        labels=_P,
        buckets=PLAN_SECONDS_BUCKETS,
    ),
    MetricSpec(
        attr="gap_to_lower_bound",
        kind=Gauge,
        name="dyncp_gap_to_lower_bound_ratio",
        doc="Latest step: predicted step seconds / lower bound - 1.",
        labels=_P,
    ),
    MetricSpec(
        attr="lower_bound_seconds",
        kind=Gauge,
        name="dyncp_lower_bound_seconds",
        doc="Latest step: the lower bound no valid plan can beat.",
        labels=_P,
    ),
    MetricSpec(
        attr="solver_status",
        kind=Counter,
        name="dyncp_solver_status",
        doc="Planner improvement runs by outcome.",
        labels=("policy", "status"),
    ),
    MetricSpec(
        attr="fallback_plans",
        kind=Counter,
        name="dyncp_fallback_plans",
        doc="Steps run on a locally computed fallback plan, by reason.",
        labels=("policy", "reason"),
    ),
    MetricSpec(
        attr="lookahead_steps",
        kind=Gauge,
        name="dyncp_plan_service_lookahead_steps",
        doc="Plans ready ahead of the step being trained.",
        labels=_P,
    ),
    MetricSpec(
        attr="late_plans",
        kind=Counter,
        name="dyncp_plan_service_late_plans",
        doc="Steps whose plan was not ready when the trainer asked (it waited or fell back).",
        labels=_P,
    ),
    MetricSpec(
        attr="microbatches",
        kind=Counter,
        name="dyncp_microbatches",
        doc="Micro-batches planned, by CP size.",
        labels=_PCS,
    ),
    MetricSpec(
        attr="sequences",
        kind=Counter,
        name="dyncp_sequences",
        doc="Sequences planned, by the CP size they run at.",
        labels=_PCS,
    ),
    MetricSpec(
        attr="tokens",
        kind=Counter,
        name="dyncp_tokens",
        doc="Real (unpadded) tokens planned, by CP size.",
        labels=_PCS,
    ),
    MetricSpec(
        attr="layout_sequences",
        kind=Counter,
        name="dyncp_layout_sequences",
        doc="Sequences planned, by group layout: ring<c>, a2a<u> (heads exchanged by all-to-all "
        "over u ranks), a2a<u>xring<r> (both).",
        labels=("policy", "layout"),
    ),
    MetricSpec(
        attr="padding_tokens",
        kind=Counter,
        name="dyncp_padding_tokens",
        doc="Zigzag padding tokens (each sequence padded to a multiple of 2 x CP size).",
        labels=_PCS,
    ),
    MetricSpec(
        attr="relative_error",
        kind=Histogram,
        name="dyncp_cost_model_relative_error_ratio",
        doc="|predicted / measured - 1| of the step time.",
        labels=_P,
        buckets=RELATIVE_ERROR_BUCKETS,
    ),
    MetricSpec(
        attr="last_signed_error",
        kind=Gauge,
        name="dyncp_last_cost_model_signed_error_ratio",
        doc="Latest step: predicted / measured - 1 (> 0: the model overestimates).",
        labels=_P,
    ),
    MetricSpec(
        attr="model_version",
        kind=Gauge,
        name="dyncp_cost_model_version",
        doc="Version of the cost model plans are priced with (0: the profile loaded at start).",
    ),
    MetricSpec(
        attr="calibration_error",
        kind=Gauge,
        name="dyncp_cost_model_calibration_error_ratio",
        doc="Latest refit: mean |predicted / measured - 1| of the held micro-batch measurements "
        "under the model before and after the refit.",
        labels=("stage",),
    ),
    MetricSpec(
        attr="calibration_refits",
        kind=Counter,
        name="dyncp_cost_model_refits",
        doc="Online refits of the cost model, by outcome (adopted, or kept the current model).",
        labels=("outcome",),
    ),
    MetricSpec(
        attr="calibration_measurements",
        kind=Gauge,
        name="dyncp_cost_model_calibration_measurements",
        doc="Latest refit: micro-batch measurements it was fitted to, and how many were outliers.",
        labels=("kind",),
    ),
    MetricSpec(
        attr="calibration_refused",
        kind=Counter,
        name="dyncp_cost_model_calibration_refused",
        doc="Measurements online calibration refused, by reason: record (a whole record "
        "malformed or unsigned), entry (a micro-batch or wave the current profile cannot "
        "price, or malformed), dropped (held measurements dropped after a failed refit).",
        labels=("reason",),
    ),
)

#: ``Metrics(rank_label=True)`` only: W series per policy and source.
RANK_BUSY = MetricSpec(
    attr="rank_busy",
    kind=Gauge,
    name="dyncp_rank_busy_seconds",
    doc="Latest step: seconds each rank spent in micro-batches.",
    labels=("policy", "source", "rank"),
)
