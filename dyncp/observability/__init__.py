"""Prometheus metrics of what dyncp decided for each step, and their exporter; torch-free."""

from dyncp.observability.metrics import (
    CALIBRATION_STAGES,
    DEFAULT_POLICIES,
    FALLBACK_REASONS,
    MULTIPROC_ENV,
    SOLVER_STATUSES,
    SOURCES,
    Exporter,
    Metrics,
)

__all__ = [
    "CALIBRATION_STAGES",
    "DEFAULT_POLICIES",
    "FALLBACK_REASONS",
    "MULTIPROC_ENV",
    "SOLVER_STATUSES",
    "SOURCES",
    "Exporter",
    "Metrics",
]
