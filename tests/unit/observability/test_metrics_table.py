"""The observability guide's metrics table is the exporter's: every metric a ``Metrics`` object
exposes is documented, with its type and labels, and nothing else is (tools/metrics_table.py)."""

from __future__ import annotations

import re

import metrics_table
from prometheus_client.parser import text_string_to_metric_families

from dyncp.observability import Metrics


def _documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = re.findall(
        r"^\| `([a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", metrics_table.PAGE.read_text(), re.M
    )
    return {
        name: (kind, () if labels.strip() == "-" else tuple(x.strip() for x in labels.split(",")))
        for name, kind, labels in rows
    }


def test_the_page_holds_the_catalogs_table() -> None:
    assert metrics_table.main(["--check"]) == 0


def test_every_exported_metric_is_documented_with_its_type_and_labels() -> None:
    text = Metrics(cp_sizes=(1, 2), rank_label=True).exposition().decode()
    exported = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # prometheus_client's creation timestamps
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k not in ("le",)}
        exported[name] = (family.type, labels)
    documented = _documented()
    assert set(documented) == set(exported)
    for name, (kind, labels) in exported.items():
        assert documented[name][0] == kind, name
        if labels:  # a labelled metric with no series yet (per-rank busy) shows no labels
            assert set(documented[name][1]) == labels, name


def test_a_stale_table_is_caught(monkeypatch) -> None:
    page = metrics_table.PAGE.read_text()
    stale = page.replace("| `dyncp_plan_seconds` |", "| `dyncp_plan_secs` |")
    monkeypatch.setattr(metrics_table.Path, "read_text", lambda self: stale)
    assert metrics_table.main(["--check"]) == 1
