"""Prometheus metrics: what dyncp decided for each step and how far the predictions were off.

    metrics = Metrics(cp_sizes=topology.group_sizes)       # owns its own CollectorRegistry
    exporter = metrics.serve(port=9464)                     # plan service / rank 0 only
    plan = planner.plan(lengths)
    metrics.observe_step(plan)                               # predicted: imbalance, seconds, ...
    ...                                                      # the step runs
    metrics.observe_measured_step(policy=plan.policy, step_seconds=wall,
                                  rank_busy_seconds=busy,    # all ranks (e.g. all_gather'ed)
                                  predicted_step_seconds=plan.stats["predicted_step_seconds"])
    metrics.observe_late_plan(policy="dyncp")                # plan service / sampler hooks
    metrics.observe_fallback(policy="dyncp", reason="late")
    metrics.set_lookahead_depth(policy="dyncp", steps=2)
    exporter.close()

Step-level metrics describe the whole job: report each step once (rank 0 or the plan service),
not once per rank. Names follow Prometheus conventions (base units; ``_seconds``, ``_ratio``,
``_total``); labels come from bounded sets only: ``policy`` (the constructor's ``policies``),
``source`` (predicted / measured), ``cp_size`` (the menu's sizes and powers of two), ``layout``
(``ring<c>``, ``a2a<u>``, ``a2a<u>xring<r>``), ``status`` (solver outcomes), ``reason``
(fallback reasons), and for online calibration ``stage`` (before / after a refit), ``outcome``
(adopted / kept) and ``kind`` (fitted / outliers). A ``rank`` label is opt-in
(``rank_label=True``): it adds ``dyncp_rank_busy_seconds`` with one series per rank.

Every labelled series the bundled dashboard and rules read exists from the first scrape
(counters and histograms at 0, latest-value gauges at NaN until a value is observed), given
``cp_sizes``; series of other CP sizes and of head-split layouts appear when first observed.

Multi-process mode (several processes on a host writing metrics) and the HTTP endpoint are
``dyncp.observability.exporter``. The metrics themselves are declared as data, one entry each
(``dyncp.observability.catalog``), and built in a loop: this module feeds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from dyncp.observability.catalog import (
    CALIBRATION_STAGES,
    DEFAULT_POLICIES,
    FALLBACK_REASONS,
    METRICS,
    RANK_BUSY,
    SOLVER_STATUSES,
    SOURCES,
)
from dyncp.observability.exporter import (
    Exporter,
    check_port,
    exposition_registry,
    multiprocess_dir,
    start_exporter,
)
from dyncp.plan import StepPlan, padded_length
from dyncp.planner.improvement.head_split import layout_histogram

if TYPE_CHECKING:
    from dyncp.cost_model.evaluate import PlanCost

__all__ = ["Metrics"]


def _no_value_yet(child: Any) -> None:
    """Create a latest-value gauge's series holding NaN ("no value yet").

    Written without a timestamp (the value object's ``set``, not ``Gauge.set``): in
    multi-process mode the "mostrecent" gauges report the value written last, and a process
    starting after another has reported a step must not replace that step's value with NaN.
    """
    child._value.set(math.nan)


def _finite(name: str, value: float, *, positive: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return value


class Metrics:
    """dyncp's Prometheus metrics, in a registry this object owns (never the global one).

    Args:
        policies: the allowed values of the ``policy`` label.
        cp_sizes: CP sizes to initialise at zero (e.g. ``topology.group_sizes``), so that rates
            are defined from the first scrape; they and powers of two are the label values (a
            menu beyond powers of two, ``dyncp.plan.menu``, is given here, so labels stay bounded).
        rank_label: also export ``dyncp_rank_busy_seconds{policy,source,rank}``, one series per
            rank (off by default: W series per policy and source).
        registry: the registry to register in; default a new ``CollectorRegistry``.

    Raises:
        ValueError: an empty or duplicated ``policies``, or a CP size below 1.
        RuntimeError: ``PROMETHEUS_MULTIPROC_DIR`` set too late, or not a directory.
    """

    def __init__(
        self,
        *,
        policies: Sequence[str] = DEFAULT_POLICIES,
        cp_sizes: Iterable[int] = (),
        rank_label: bool = False,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.policies = tuple(policies)
        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must be distinct names, got {list(self.policies)}")
        self.rank_label = rank_label
        self.multiprocess_dir = multiprocess_dir()
        self.registry = CollectorRegistry() if registry is None else registry
        for spec in METRICS:
            setattr(self, spec.attr, spec.build(self.registry))
        self.rank_busy: Gauge | None = RANK_BUSY.build(self.registry) if rank_label else None
        self._cp_sizes: set[int] = set()
        self._menu: frozenset[int] = frozenset()
        # Every labelled series a dashboard or rule reads exists from the first scrape, so a
        # panel shows "none yet" rather than "no data" (e.g. solver outcomes when CP-SAT never
        # ran): counters and histograms at zero, the latest-value gauges at NaN (no step yet:
        # a 0 would read as a perfectly balanced, optimal, exactly predicted step).
        for stage in CALIBRATION_STAGES:
            _no_value_yet(self.calibration_error.labels(stage))
        for outcome in ("adopted", "kept", "failed"):
            self.calibration_refits.labels(outcome)
        for reason in ("record", "entry", "dropped"):
            self.calibration_refused.labels(reason)
        for kind in ("fitted", "outliers"):
            _no_value_yet(self.calibration_measurements.labels(kind))
        for policy in self.policies:
            for source in SOURCES:
                self.step_imbalance.labels(policy, source)
                self.step_seconds.labels(policy, source)
                _no_value_yet(self.last_step_imbalance.labels(policy, source))
                _no_value_yet(self.last_step_seconds.labels(policy, source))
            self.plan_seconds.labels(policy)
            self.relative_error.labels(policy)
            self.late_plans.labels(policy)
            for gauge in (
                self.gap_to_lower_bound,
                self.lower_bound_seconds,
                self.lookahead_steps,
                self.last_signed_error,
            ):
                _no_value_yet(gauge.labels(policy))
            for reason in FALLBACK_REASONS:
                self.fallback_plans.labels(policy, reason)
            for status in SOLVER_STATUSES:
                self.solver_status.labels(policy, status)
        menu = [int(cp) for cp in cp_sizes]
        bad = [cp for cp in menu if cp < 1]
        if bad:
            raise ValueError(f"cp_sizes must be positive integers, got {bad}")
        self._menu = frozenset(menu)
        for cp in menu:
            self._cp_label(cp)

    # ------------------------------------------------------------------------------ labels
    def _policy(self, policy: str) -> str:
        if policy not in self.policies:
            raise ValueError(
                f"policy {policy!r} is not a label value of these metrics; allowed: "
                f"{', '.join(self.policies)} (Metrics(policies=...))"
            )
        return policy

    def _cp_label(self, cp: int) -> str:
        if cp < 1 or (cp & (cp - 1) and cp not in self._menu):
            raise ValueError(
                f"cp_size {cp} is neither a power of two nor one of the CP sizes these metrics "
                f"were given ({sorted(self._menu)}; Metrics(cp_sizes=topology.group_sizes))"
            )
        label = str(cp)
        if cp not in self._cp_sizes:
            self._cp_sizes.add(cp)
            for policy in self.policies:
                for family in (self.microbatches, self.sequences, self.tokens, self.padding_tokens):
                    family.labels(policy, label)
                self.layout_sequences.labels(policy, f"ring{cp}")  # splits appear when planned
        return label

    def _observe_balance(self, policy: str, source: str, imbalance: float, seconds: float) -> None:
        self.step_imbalance.labels(policy, source).observe(imbalance)
        self.last_step_imbalance.labels(policy, source).set(imbalance)
        self.step_seconds.labels(policy, source).observe(seconds)
        self.last_step_seconds.labels(policy, source).set(seconds)

    def _set_rank_busy(self, policy: str, source: str, busy: np.ndarray) -> None:
        if self.rank_busy is not None:
            for rank, seconds in enumerate(busy.tolist()):
                self.rank_busy.labels(policy, source, str(rank)).set(seconds)

    # ------------------------------------------------------------------------------ feeding
    def observe_step(self, plan: StepPlan, *, cost: PlanCost | None = None) -> None:
        """Record a planned step: its predictions, plan latency, solver outcome and layout.

        Args:
            plan: a plan from ``Planner.plan`` (its ``stats`` carry the predictions).
            cost: the plan's ``evaluate_plan`` result; used only with ``rank_label=True``.

        A plan whose lower bound is deferred and not written yet (``None``: ``Planner``'s
        ``defer_bound``) leaves the bound and gap gauges at their previous values.

        Raises:
            ValueError: the policy is not allowed, or ``plan.stats`` lacks a prediction.
        """
        st = plan.stats
        policy = self._policy(str(st.get("policy") or plan.policy))
        try:
            imbalance = float(st["imbalance"])
            seconds = float(st["predicted_step_seconds"])
            plan_seconds = float(st["timings"]["plan_seconds"])
            gap, bound = st["gap_to_lower_bound"], st["lower_bound_seconds"]
        except KeyError as exc:
            raise ValueError(
                f"plan.stats lacks {exc.args[0]!r}: observe_step needs a plan from Planner.plan"
            ) from None
        self._observe_balance(policy, "predicted", imbalance, seconds)
        self.plan_seconds.labels(policy).observe(plan_seconds)
        if gap is not None and bound is not None:  # None: a deferred bound, not done yet
            self.gap_to_lower_bound.labels(policy).set(float(gap))
            self.lower_bound_seconds.labels(policy).set(float(bound))
        solver = st.get("solver")
        if isinstance(solver, dict) and "status" in solver:
            status = str(solver["status"]).split(":")[0]
            self.solver_status.labels(
                policy, status if status in SOLVER_STATUSES else "OTHER"
            ).inc()
        counts: dict[int, list[int]] = {}  # cp -> [micro-batches, sequences, tokens, padding]
        for _, group, mb in plan.microbatches():
            c = counts.setdefault(group.size, [0, 0, 0, 0])
            c[0] += 1
            c[1] += len(mb.seq_ids)
            for i in mb.seq_ids:
                s = int(plan.lengths[i])
                c[2] += s
                c[3] += padded_length(s, group.size) - s
        for cp, (n_mb, n_seq, n_tok, n_pad) in sorted(counts.items()):
            label = self._cp_label(cp)
            self.microbatches.labels(policy, label).inc(n_mb)
            self.sequences.labels(policy, label).inc(n_seq)
            self.tokens.labels(policy, label).inc(n_tok)
            self.padding_tokens.labels(policy, label).inc(n_pad)
        for name, n in sorted(layout_histogram(plan).items()):
            self.layout_sequences.labels(policy, name).inc(n)
        if cost is not None:
            self._set_rank_busy(policy, "predicted", np.asarray(cost.rank_busy_seconds))

    def observe_measured_step(
        self,
        *,
        policy: str,
        step_seconds: float,
        rank_busy_seconds: Sequence[float] | np.ndarray | None = None,
        imbalance: float | None = None,
        predicted_step_seconds: float | None = None,
    ) -> None:
        """Record what a step really took (the runtime's measurement, once per step for the job).

        Args:
            policy: the policy whose plan ran.
            step_seconds: measured wall-clock seconds of the step.
            rank_busy_seconds: seconds each rank spent in its micro-batches (all ranks); gives the
                measured imbalance (busiest / mean) and, with ``rank_label``, per-rank series.
            imbalance: the measured imbalance, if already computed (instead of the busy times).
            predicted_step_seconds: the plan's prediction; gives the cost model's error.

        Raises:
            ValueError: an unknown policy, a non-finite or negative time, or both
                ``rank_busy_seconds`` and ``imbalance``.
        """
        policy = self._policy(policy)
        seconds = _finite("step_seconds", step_seconds, positive=True)
        if rank_busy_seconds is not None and imbalance is not None:
            raise ValueError("give rank_busy_seconds or imbalance, not both")
        if rank_busy_seconds is not None:
            busy = np.asarray(rank_busy_seconds, dtype=np.float64)
            if busy.ndim != 1 or not len(busy) or not np.isfinite(busy).all() or (busy < 0).any():
                raise ValueError("rank_busy_seconds must be a non-empty 1-D array of seconds >= 0")
            mean = float(busy.mean())
            imbalance = float(busy.max()) / mean if mean > 0 else 1.0
            self._set_rank_busy(policy, "measured", busy)
        if imbalance is not None:
            imbalance = _finite("imbalance", imbalance, positive=True)
            self.step_imbalance.labels(policy, "measured").observe(imbalance)
            self.last_step_imbalance.labels(policy, "measured").set(imbalance)
        self.step_seconds.labels(policy, "measured").observe(seconds)
        self.last_step_seconds.labels(policy, "measured").set(seconds)
        if predicted_step_seconds is not None:
            predicted = _finite("predicted_step_seconds", predicted_step_seconds)
            error = predicted / seconds - 1.0
            self.relative_error.labels(policy).observe(abs(error))
            self.last_signed_error.labels(policy).set(error)

    def observe_calibration(self, result: Any, *, adopted: bool, version: int) -> None:
        """Record an online refit (a ``dyncp.cost_model.calibration.fit.CalibrationResult``).

        Args:
            result: the refit's result (errors before and after, measurements, outliers).
            adopted: whether it became the model plans are priced with.
            version: the model version in use after this refit.
        """
        if isinstance(version, bool) or int(version) != version or version < 0:
            raise ValueError(f"model version must be an integer >= 0, got {version!r}")
        self.calibration_error.labels("before").set(_finite("error_before", result.error_before))
        self.calibration_error.labels("after").set(_finite("error_after", result.error_after))
        self.calibration_refits.labels("adopted" if adopted else "kept").inc()
        self.calibration_measurements.labels("fitted").set(result.measurements)
        self.calibration_measurements.labels("outliers").set(result.outliers)
        self.model_version.set(int(version))

    def observe_calibration_refusals(
        self, *, failed: int = 0, record: int = 0, entry: int = 0, dropped: int = 0
    ) -> None:
        """Count what online calibration contained since the last call: refits that failed,
        and measurements refused (see ``dyncp_cost_model_calibration_refused``)."""
        for name, value in (
            ("failed", failed),
            ("record", record),
            ("entry", entry),
            ("dropped", dropped),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if failed:
            self.calibration_refits.labels("failed").inc(failed)
        for reason, value in (("record", record), ("entry", entry), ("dropped", dropped)):
            if value:
                self.calibration_refused.labels(reason).inc(value)

    def observe_fallback(self, *, policy: str, reason: str) -> None:
        """A step ran on a fallback plan; ``reason`` is one of ``FALLBACK_REASONS``."""
        if reason not in FALLBACK_REASONS:
            raise ValueError(
                f"fallback reason {reason!r}; choose one of {', '.join(FALLBACK_REASONS)}"
            )
        self.fallback_plans.labels(self._policy(policy), reason).inc()

    def observe_late_plan(self, *, policy: str) -> None:
        """The trainer asked for a step's plan before the plan service had it ready (it waited or
        fell back; ``dyncp.service.Fetched.ready`` is False)."""
        self.late_plans.labels(self._policy(policy)).inc()

    def set_lookahead_depth(self, *, policy: str, steps: int) -> None:
        """How many plans are ready ahead of the step being trained."""
        if isinstance(steps, bool) or int(steps) != steps or steps < 0:
            raise ValueError(f"lookahead steps must be an integer >= 0, got {steps!r}")
        self.lookahead_steps.labels(self._policy(policy)).set(int(steps))

    def sampler_hook(self, *, lookahead: int | None = None) -> Callable[[StepPlan, Any], None]:
        """An ``on_step(plan, info)`` callback for ``DynamicCPSampler`` (install it on one rank).

        Records each step's plan (predictions, latency, CP mix), whether it was late, fallbacks
        with their reason, and the lookahead depth.
        """

        def on_step(plan: StepPlan, info: Any) -> None:
            policy = self._policy(str(plan.stats.get("policy") or plan.policy or "dyncp"))
            if "predicted_step_seconds" in plan.stats:  # restored plans may carry no stats
                self.observe_step(plan)
            if not info.ready:
                self.observe_late_plan(policy=policy)
            if info.source == "fallback":
                reason = info.reason if info.reason in FALLBACK_REASONS else "error"
                self.observe_fallback(policy=policy, reason=reason)
            if lookahead is not None:
                self.set_lookahead_depth(policy=policy, steps=lookahead)

        return on_step

    # ------------------------------------------------------------------------------ export
    def exposition_registry(self) -> CollectorRegistry:
        """What to expose: this registry, or in multi-process mode every process's files."""
        return exposition_registry(self.registry, self.multiprocess_dir)

    def exposition(self) -> bytes:
        """The Prometheus text format of ``exposition_registry()`` (what ``/metrics`` serves)."""
        return generate_latest(self.exposition_registry())

    def serve(self, *, port: int, addr: str = "127.0.0.1") -> Exporter:
        """Serve ``/metrics`` over HTTP on ``addr:port`` (port 0: a free port) in a daemon thread.

        Binds loopback unless ``addr`` says otherwise (e.g. ``"0.0.0.0"`` for a Prometheus on
        another host): the metrics name the job's configuration and timings.

        Call it in one process per host (the plan service or rank 0); in multi-process mode it
        exposes the metrics of every process writing to ``PROMETHEUS_MULTIPROC_DIR``.

        Raises:
            ValueError: a port outside 0..65535.
            OSError: the port is taken.
        """
        port = check_port(port)
        return start_exporter(self.exposition_registry(), port=port, addr=addr)
