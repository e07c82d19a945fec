"""Metrics.serve binds loopback by default: the exporter is not reachable from other hosts
unless the caller names an address."""

from __future__ import annotations

import urllib.request

from dyncp.observability.metrics import Metrics


def test_metrics_serve_binds_loopback_unless_given_a_host() -> None:
    exporter = Metrics().serve(port=0)
    try:
        assert exporter.server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(exporter.url, timeout=10) as response:
            assert b"dyncp_" in response.read()
    finally:
        exporter.close()
    exporter = Metrics().serve(port=0, addr="0.0.0.0")
    try:
        assert exporter.server.server_address[0] == "0.0.0.0"
    finally:
        exporter.close()
