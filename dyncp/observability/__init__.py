"""Prometheus metrics of what dyncp decided for each step, and their exporter; torch-free.

Modules: ``metrics`` (Metrics: feeding the values from plans, measurements and refits),
``catalog`` (every metric's name, help, labels and buckets, as data; the label value sets),
``exporter`` (the ``/metrics`` HTTP endpoint and multi-process mode).
"""

from dyncp.observability.catalog import (
    CALIBRATION_STAGES,
    DEFAULT_POLICIES,
    FALLBACK_REASONS,
    METRICS,
    SOLVER_STATUSES,
    SOURCES,
    MetricSpec,
)
from dyncp.observability.exporter import MULTIPROC_ENV, Exporter
from dyncp.observability.metrics import Metrics

__all__ = [
    "CALIBRATION_STAGES",
    "DEFAULT_POLICIES",
    "FALLBACK_REASONS",
    "METRICS",
    "MULTIPROC_ENV",
    "SOLVER_STATUSES",
    "SOURCES",
    "Exporter",
    "MetricSpec",
    "Metrics",
]
