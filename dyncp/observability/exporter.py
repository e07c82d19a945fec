"""The metrics exporter: a ``/metrics`` HTTP endpoint, and what it exposes in multi-process mode.

Multi-process mode: when several processes on a host write metrics (trainer ranks, DataLoader
workers running the sampler, the plan service), set ``PROMETHEUS_MULTIPROC_DIR`` to an empty
directory in the environment *before the processes start* (prometheus_client chooses its storage
when it is imported). Each process then writes its values to files there, and ``serve()`` /
``exposition()`` in any one process aggregate all of them with prometheus_client's
``MultiProcessCollector``: counters and histograms are summed, the "last value" gauges report
the most recently written value. Clear the directory between runs; call
``prometheus_client.multiprocess.mark_process_dead(pid)`` when a worker exits.

Apart from ``dyncp.observability.metrics`` because serving is about the process and the host
(one endpoint per host, the storage prometheus_client chose at import), not about what is
measured; ``Metrics.serve`` and ``Metrics.exposition`` call it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server, values
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = [
    "MULTIPROC_ENV",
    "Exporter",
    "check_port",
    "exposition_registry",
    "multiprocess_dir",
    "start_exporter",
]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, slots=True)
class Exporter:
    """A running ``/metrics`` HTTP endpoint (a daemon thread); ``close()`` stops it."""

    server: Any
    thread: Any
    addr: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def multiprocess_dir() -> str | None:
    """The multi-process directory this process writes its metrics to, or None (in memory).

    Raises:
        RuntimeError: ``PROMETHEUS_MULTIPROC_DIR`` set after prometheus_client was imported, or
            not an existing directory.
    """
    path = os.environ.get(MULTIPROC_ENV)
    multiprocess_values = bool(getattr(values.ValueClass, "_multiprocess", False))
    if path and not multiprocess_values:
        raise RuntimeError(
            f"{MULTIPROC_ENV}={path!r} was set after prometheus_client was imported, so this "
            f"process keeps its metrics in memory; set {MULTIPROC_ENV} in the environment "
            f"before the process starts"
        )
    if multiprocess_values and not (path and os.path.isdir(path)):
        raise RuntimeError(f"{MULTIPROC_ENV}={path!r} is not an existing directory")
    return path or None


def exposition_registry(registry: CollectorRegistry, path: str | None) -> CollectorRegistry:
    """What to expose: ``registry``, or in multi-process mode (``path``) every process's files."""
    if path is None:
        return registry
    merged = CollectorRegistry()
    MultiProcessCollector(merged, path=path)
    return merged


def check_port(port: int) -> int:
    """``port`` as an int, if in 0..65535 (0: a free port); else ValueError."""
    if isinstance(port, bool) or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics port must be in 0..65535, got {port!r}")
    return int(port)


def start_exporter(registry: CollectorRegistry, *, port: int, addr: str) -> Exporter:
    """Serve ``registry`` at ``http://addr:port/metrics`` in a daemon thread."""
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return Exporter(server, thread, addr, int(server.server_port))
