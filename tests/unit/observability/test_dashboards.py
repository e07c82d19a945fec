"""The Grafana dashboard and the Prometheus rules against the metrics dyncp really exports.

Without a GPU: every metric the dashboard and the rules query exists in the exporter's output;
promtool checks the rules and runs their unit tests; a real Prometheus scrapes
``python -m dyncp.sim --metrics-port`` and answers the imbalance query with the value of the
simulator's JSON report, and runs every dashboard query. The promtool and Prometheus tests skip
when the binaries are missing (Debian: ``apt-get install prometheus``), unless
``DYNCP_REQUIRE_PROMETHEUS=1`` (set by CI) turns the skip into a failure.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.observability.metrics import DEFAULT_POLICIES, FALLBACK_REASONS, SOLVER_STATUSES, Metrics
from dyncp.planner.planner import POLICIES, Planner

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "dashboards" / "grafana" / "dyncp.json"
RULES = REPO / "dashboards" / "prometheus" / "rules.yml"
RULES_TEST = REPO / "dashboards" / "prometheus" / "rules_test.yml"
SMALL = ["--world", "8", "--ranks-per-node", "4", "--capacity", "512", "--max-length", "4096"]
STEPS = 3
# Grafana's variables, replaced by what a dashboard on all policies would send.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$policy": ".*"}
# Panels the simulator cannot fill: it has no plan service and fits no model. Their descriptions
# say so (test_panels_the_simulator_cannot_fill_say_so).
EMPTY_IN_SIM = {"dyncp_plan_service_lookahead_steps", "dyncp_cost_model_calibration_error_ratio"}
METRIC = re.compile(r"(?<![\w:])dyncp_[a-z0-9_]+")


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        reason = f"{binary} is not installed (Debian: apt-get install prometheus); CI installs it"
        if os.environ.get("DYNCP_REQUIRE_PROMETHEUS"):
            pytest.fail(f"DYNCP_REQUIRE_PROMETHEUS is set but {reason}")
        pytest.skip(reason)
    return path


@functools.cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard's panels (repeated rows included)."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            out.extend(t["expr"] for t in panel.get("targets", ()))
            walk(panel.get("panels", []))

    walk(dashboard()["panels"])
    return out


def dashboard_metric_names() -> set[str]:
    texts = dashboard_exprs()
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            texts.append(var["definition"])
    return {name for text in texts for name in METRIC.findall(text)}


@functools.cache
def exported_sample_names() -> frozenset[str]:
    """Sample names a fully fed exporter serves: every policy planned and measured, and every
    plan-service hook called once."""
    model = CostModel.load("h100-reference", 4)
    m = Metrics(cp_sizes=(1, 2, 4, 8))
    lengths = np.random.default_rng(0).integers(1, 3000, 40)
    for policy in POLICIES:
        planner = Planner(
            model, world=8, ranks_per_node=4, capacity=512, policy=policy, max_length=4096
        )
        plan = planner.plan(lengths)
        cost = evaluate_plan(plan, model)
        m.observe_step(plan, cost=cost)
        m.observe_measured_step(
            policy=policy,
            step_seconds=cost.step_seconds * 1.1,
            rank_busy_seconds=cost.rank_busy_seconds * 1.1,
            predicted_step_seconds=cost.step_seconds,
        )
        m.observe_late_plan(policy=policy)
        m.set_lookahead_depth(policy=policy, steps=2)
        for reason in FALLBACK_REASONS:
            m.observe_fallback(policy=policy, reason=reason)
    text = m.exposition().decode()
    return frozenset(s.name for f in text_string_to_metric_families(text) for s in f.samples)


# ----------------------------------------------------------------------------- static checks


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource() -> None:
    d = dashboard()
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in d["panels"]).lower()
    for what in (
        "imbalance over time",
        "imbalance distribution",
        "predicted vs measured",
        "plan latency quantiles",
        "cp-size mix",
        "fallback",
        "calibration",
    ):
        assert what in titles, what
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert METRIC.search(t["expr"]), t["expr"]
            assert "rank" not in re.findall(r"[a-z_]+(?==~|=|!=)", t["expr"]), t["expr"]


def test_panels_the_simulator_cannot_fill_say_so() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    marked = []
    for panel in panels:
        names = {n for t in panel.get("targets", []) for n in METRIC.findall(t.get("expr", ""))}
        if names and names <= EMPTY_IN_SIM:
            assert "Empty in the simulator" in panel.get("description", ""), panel["title"]
            marked.append(panel["title"])
    assert len(marked) == 2, marked


def test_every_dashboard_metric_exists_in_the_exporter_output() -> None:
    names = dashboard_metric_names()
    assert len(names) >= 15
    missing = sorted(names - exported_sample_names())
    assert not missing, f"the dashboard queries metrics the exporter does not serve: {missing}"


def test_every_rules_metric_exists_in_the_exporter_output() -> None:
    names = set(METRIC.findall(RULES.read_text()))
    assert len(names) >= 8
    missing = sorted(names - exported_sample_names())
    assert not missing, f"the rules query metrics the exporter does not serve: {missing}"


def test_alerts_cover_imbalance_late_planner_and_cost_model() -> None:
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    assert {"DyncpSustainedImbalance", "DyncpPlannerLate", "DyncpCostModelDrifting"} <= alerts
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    assert alerts <= tested, f"alerts without a promtool unit test: {sorted(alerts - tested)}"


# ----------------------------------------------------------------------------- promtool


def test_promtool_check_rules() -> None:
    promtool = require("promtool")
    proc = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_test_rules() -> None:
    promtool = require("promtool")
    proc = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name],
        cwd=RULES_TEST.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- live Prometheus

PROMETHEUS_YML = REPO / "dashboards" / "prometheus" / "prometheus.yml"


def shipped_config(target: str, *, rules: Path, interval: str) -> str:
    """dashboards/prometheus/prometheus.yml as shipped, but for its target (the simulator's
    port), its intervals and the rule file's path (absolute: the copy lives elsewhere)."""
    text = PROMETHEUS_YML.read_text()
    for old, new in (
        ('"127.0.0.1:9464"', json.dumps(target)),
        ("interval: 5s", f"interval: {interval}"),
        ("  - rules.yml", f"  - {json.dumps(str(rules))}"),
    ):
        assert old in text, f"{PROMETHEUS_YML.name} no longer holds {old!r}"
        text = text.replace(old, new)
    return text


def test_the_shipped_prometheus_config_is_valid(tmp_path: Path) -> None:
    promtool = require("promtool")
    proc = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout + proc.stderr


@dataclass(frozen=True)
class Live:
    api: str
    report: dict[str, Any]

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.api + path, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", (path, body)
        return body["data"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The simulator serving metrics (--hold) and a private Prometheus scraping it every second."""
    prometheus = require("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    report_path = tmp / "report.json"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dyncp.sim",
            *SMALL,
            "--steps",
            str(STEPS),
            "--metrics-port",
            "0",
            "--hold",
            "120",
            "--measurement-noise",
            "0.05",
            "--json",
            str(report_path),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    prom: subprocess.Popen | None = None
    try:
        target = None
        assert sim.stderr is not None
        for line in sim.stderr:  # the replay takes well under a second at this size
            if found := re.search(r"serving metrics on http://([\d.]+:\d+)/metrics", line):
                target = found.group(1)
            if "replay done" in line:
                break
        assert target is not None and sim.poll() is None, "the simulator is not serving metrics"
        config = tmp / "prometheus.yml"
        config.write_text(shipped_config(target, rules=RULES, interval="1s"))
        port = free_port()
        log = (tmp / "prometheus.log").open("w")
        prom = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        api = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert prom.poll() is None, (tmp / "prometheus.log").read_text()
            with urllib.request.urlopen(f"{api}/-/ready", timeout=2) as resp:
                return resp.status == 200

        wait_for("Prometheus to be ready", ready)
        result = Live(api, json.loads(report_path.read_text()))
        # The replay ended before Prometheus started, so every sample holds the final values;
        # wait for two scrapes, so that rate() over them is defined.
        count = 'dyncp_step_imbalance_ratio_count{source="predicted"}'
        wait_for(
            "two scrapes of every policy's final step count",
            lambda: (
                len(result.query(f"count_over_time({count}[1m]) >= 2 and {count} == {STEPS}"))
                == len(POLICIES)
            ),
        )
        yield result
    finally:
        if prom is not None:
            stop(prom)
        stop(sim)


def test_prometheus_scrapes_the_simulators_imbalance(live: Live) -> None:
    rows = live.query(
        'dyncp_step_imbalance_ratio_sum{job="dyncp",source="predicted"}'
        ' / dyncp_step_imbalance_ratio_count{job="dyncp",source="predicted"}'
    )
    got = {row["metric"]["policy"]: float(row["value"][1]) for row in rows}
    expected = {name: p["mean_imbalance"] for name, p in live.report["policies"].items()}
    assert set(got) == set(expected) == set(POLICIES)
    for name, mean in expected.items():
        assert got[name] == pytest.approx(mean, rel=1e-12), name
    last = live.query('dyncp_last_step_imbalance_ratio{source="predicted"}')
    assert {row["metric"]["policy"] for row in last} == set(POLICIES)
    assert all(float(row["value"][1]) >= 1.0 for row in last)


def test_every_dashboard_query_runs_on_prometheus(live: Live) -> None:
    empty = []
    for expr in dashboard_exprs():
        query = expr
        for var, val in GRAFANA_VARS.items():
            query = query.replace(var, val)
        assert "$" not in query, query
        if not live.query(query) and not set(METRIC.findall(expr)) <= EMPTY_IN_SIM:
            empty.append(expr)
    assert not empty, f"dashboard queries with no data from the simulator: {empty}"
    policies = live.get("/api/v1/label/policy/values?match[]=dyncp_step_seconds_count")
    assert set(policies) == set(POLICIES)


def test_rules_load_and_evaluate_on_prometheus(live: Live) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = live.get("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        done = rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules)
        return rules if done else []

    rules = wait_for("every rule to be evaluated", evaluated, timeout=15)
    assert len(rules) == len(re.findall(r"- (record|alert): ", RULES.read_text()))
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    # A recording rule's series appear once an evaluation sees two scrapes.
    padding = wait_for(
        "the padding recording rule's series",
        lambda: live.query("policy:dyncp_padding_tokens:ratio5m"),
        timeout=15,
    )
    assert {row["metric"]["policy"] for row in padding} == set(POLICIES)


SOLVER_TOTAL = "dyncp_solver_status_total"


def test_a_fresh_exporter_serves_every_series_the_dashboard_and_rules_read() -> None:
    """Before any step (and when CP-SAT never runs), every metric the dashboard and the rules
    query is in the exposition of an exporter built as the callers build it, so no panel shows
    "no data": counters and histograms at zero, latest-value gauges at NaN (no step yet)."""
    text = Metrics(cp_sizes=(1, 2, 4, 8)).exposition().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    names = {s.name for s in samples}
    wanted = dashboard_metric_names() | set(METRIC.findall(RULES.read_text()))
    missing = sorted(wanted - names)
    assert not missing, f"absent from a fresh exposition: {missing}"
    by_name: dict[str, list] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    solver = {(s.labels["policy"], s.labels["status"]) for s in by_name[SOLVER_TOTAL]}
    assert solver == {(p, st) for p in DEFAULT_POLICIES for st in SOLVER_STATUSES}
    layouts = {s.labels["layout"] for s in by_name["dyncp_layout_sequences_total"]}
    assert layouts == {"ring1", "ring2", "ring4", "ring8"}
    for name in wanted:
        for s in by_name[name]:
            if name.endswith(("_total", "_count", "_sum", "_bucket")):
                assert s.value == 0, s
            elif name != "dyncp_cost_model_version":  # unlabelled, 0 = the loaded profile
                assert s.value != s.value, s  # NaN: no step observed yet
