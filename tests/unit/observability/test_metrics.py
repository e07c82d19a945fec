"""dyncp.observability.metrics: names and labels, values fed from real plans, validation, the HTTP
exporter, the multi-process collector, and the simulator feeding the metrics."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.observability.metrics import DEFAULT_POLICIES, FALLBACK_REASONS, SOURCES, Metrics
from dyncp.plan import StepPlan, padded_length
from dyncp.planner.planner import POLICIES, Planner
from dyncp.sim.__main__ import main
from dyncp.sim.replay import draw_batches, replay, synthetic_measurement
from dyncp.sim.report import summarise

REPO = Path(__file__).resolve().parents[3]
SMALL = ["--world", "8", "--ranks-per-node", "4", "--capacity", "512", "--max-length", "4096"]
BOUNDED_LABELS = {
    *("policy", "source", "cp_size", "status", "reason", "stage", "outcome", "kind"),
    "layout",  # ring<c> / a2a<u> / a2a<u>xring<r>: bounded by the CP and head sizes
}


@functools.cache
def model() -> CostModel:
    return CostModel.load("h100-reference", 4)


def planner(policy: str) -> Planner:
    return Planner(model(), world=8, ranks_per_node=4, capacity=512, policy=policy, max_length=4096)


@functools.cache
def batch() -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.concatenate([rng.integers(1, 400, 30), [3000, 1500, 700]]).astype(np.int64)


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


# ----------------------------------------------------------------------------- names and labels


def test_names_units_and_labels_follow_prometheus_conventions() -> None:
    m = Metrics(cp_sizes=(1, 2, 4, 8), rank_label=False)
    families = list(m.registry.collect())
    assert families
    for fam in families:
        assert re.fullmatch(r"dyncp_[a-z0-9_]+", fam.name), fam.name
        if fam.type == "counter":  # the exposition appends _total
            assert not fam.name.endswith("_total")
        else:
            # base units; dimensionless counts name what they count
            assert fam.name.endswith(
                ("_seconds", "_ratio", "_lookahead_steps", "_version", "_measurements")
            ), fam.name
        for sample in fam.samples:
            assert set(sample.labels) - {"le"} <= BOUNDED_LABELS, (fam.name, sample.labels)
    names = {fam.name for fam in families}
    assert "dyncp_rank_busy_seconds" not in names  # no rank label by default


def test_each_metrics_object_owns_its_registry() -> None:
    a, b = Metrics(), Metrics()
    assert a.registry is not b.registry
    a.observe_late_plan(policy="dyncp")
    assert value(a, "dyncp_plan_service_late_plans_total", policy="dyncp") == 1
    assert value(b, "dyncp_plan_service_late_plans_total", policy="dyncp") == 0
    default = prometheus_client.REGISTRY
    assert not any(f.name.startswith("dyncp_") for f in default.collect())
    shared = CollectorRegistry()
    Metrics(registry=shared)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Metrics(registry=shared)


def test_default_policies_match_the_planner() -> None:
    assert DEFAULT_POLICIES == POLICIES


def test_series_initialised_at_zero_for_every_policy_and_cp_size() -> None:
    m = Metrics(cp_sizes=(1, 2, 4))
    for policy in POLICIES:
        for source in SOURCES:
            name = "dyncp_step_imbalance_ratio_count"
            assert value(m, name, policy=policy, source=source) == 0
        for reason in FALLBACK_REASONS:
            assert value(m, "dyncp_fallback_plans_total", policy=policy, reason=reason) == 0
        for cp in ("1", "2", "4"):
            assert value(m, "dyncp_sequences_total", policy=policy, cp_size=cp) == 0
        assert value(m, "dyncp_plan_seconds_count", policy=policy) == 0


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("policy", POLICIES)
def test_observe_step_records_the_plans_predictions_and_layout(policy: str) -> None:
    m = Metrics(cp_sizes=(1, 2, 4, 8))
    plan = planner(policy).plan(batch())
    st = plan.stats
    m.observe_step(plan)
    m.observe_step(plan)
    lab = {"policy": policy, "source": "predicted"}
    assert value(m, "dyncp_step_imbalance_ratio_count", **lab) == 2
    assert value(m, "dyncp_step_imbalance_ratio_sum", **lab) == pytest.approx(2 * st["imbalance"])
    assert value(m, "dyncp_last_step_imbalance_ratio", **lab) == st["imbalance"]
    assert value(m, "dyncp_last_step_seconds", **lab) == st["predicted_step_seconds"]
    assert value(m, "dyncp_step_seconds_sum", **lab) == pytest.approx(
        2 * st["predicted_step_seconds"]
    )
    assert value(m, "dyncp_plan_seconds_sum", policy=policy) == pytest.approx(
        2 * st["timings"]["plan_seconds"]
    )
    assert value(m, "dyncp_gap_to_lower_bound_ratio", policy=policy) == st["gap_to_lower_bound"]
    assert value(m, "dyncp_lower_bound_seconds", policy=policy) == st["lower_bound_seconds"]
    # Layout: every sequence, token and micro-batch counted once per observation, at its CP size.
    seqs: dict[int, int] = {}
    toks: dict[int, int] = {}
    pads: dict[int, int] = {}
    mbs: dict[int, int] = {}
    for _, group, mb in plan.microbatches():
        c = group.size
        mbs[c] = mbs.get(c, 0) + 1
        for i in mb.seq_ids:
            s = plan.lengths[i]
            seqs[c] = seqs.get(c, 0) + 1
            toks[c] = toks.get(c, 0) + s
            pads[c] = pads.get(c, 0) + padded_length(s, c) - s
    for c in (1, 2, 4, 8):
        lab = {"policy": policy, "cp_size": str(c)}
        assert value(m, "dyncp_sequences_total", **lab) == 2 * seqs.get(c, 0)
        assert value(m, "dyncp_tokens_total", **lab) == 2 * toks.get(c, 0)
        assert value(m, "dyncp_padding_tokens_total", **lab) == 2 * pads.get(c, 0)
        assert value(m, "dyncp_microbatches_total", **lab) == 2 * mbs.get(c, 0)
    total = sum(value(m, "dyncp_tokens_total", policy=policy, cp_size=str(c)) for c in (1, 2, 4, 8))
    assert total == 2 * int(batch().sum())
    if policy == "static":
        assert sum(pads.values()) > 0  # CP 8 pads to multiples of 16
    status = st.get("solver", {}).get("status")
    if status is not None:
        got = value(m, "dyncp_solver_status_total", policy=policy, status=status.split(":")[0])
        assert got == 2


def test_solver_status_outside_the_known_set_is_counted_as_other() -> None:
    m = Metrics()
    plan = planner("dyncp").plan(batch())
    plan.stats["solver"] = {"status": "SOMETHING_NEW: detail"}
    m.observe_step(plan)
    assert value(m, "dyncp_solver_status_total", policy="dyncp", status="OTHER") == 1
    plan.stats["solver"] = {"status": "OPTIMAL"}
    m.observe_step(plan)
    assert value(m, "dyncp_solver_status_total", policy="dyncp", status="OPTIMAL") == 1


def test_observe_measured_step_imbalance_and_cost_model_error() -> None:
    m = Metrics()
    m.observe_measured_step(
        policy="dyncp",
        step_seconds=2.0,
        rank_busy_seconds=[1.0, 2.0, 1.5, 1.5],
        predicted_step_seconds=2.5,
    )
    lab = {"policy": "dyncp", "source": "measured"}
    assert value(m, "dyncp_last_step_imbalance_ratio", **lab) == pytest.approx(2.0 / 1.5)
    assert value(m, "dyncp_step_imbalance_ratio_count", **lab) == 1
    assert value(m, "dyncp_last_step_seconds", **lab) == 2.0
    assert value(m, "dyncp_last_cost_model_signed_error_ratio", policy="dyncp") == 0.25
    assert value(m, "dyncp_cost_model_relative_error_ratio_sum", policy="dyncp") == 0.25
    m.observe_measured_step(policy="dyncp", step_seconds=2.0, predicted_step_seconds=1.5)
    assert value(m, "dyncp_last_cost_model_signed_error_ratio", policy="dyncp") == -0.25
    assert value(m, "dyncp_cost_model_relative_error_ratio_sum", policy="dyncp") == 0.5
    # Only the step time: no imbalance observation.
    assert value(m, "dyncp_step_imbalance_ratio_count", **lab) == 1
    m.observe_measured_step(policy="static", step_seconds=1.0, imbalance=1.25)
    assert value(m, "dyncp_last_step_imbalance_ratio", policy="static", source="measured") == 1.25
    # Predicted series untouched by measurements.
    assert value(m, "dyncp_step_seconds_count", policy="dyncp", source="predicted") == 0


def test_plan_service_hooks() -> None:
    m = Metrics(policies=("dyncp",))
    m.observe_fallback(policy="dyncp", reason="late")
    m.observe_fallback(policy="dyncp", reason="late")
    m.observe_fallback(policy="dyncp", reason="rejected")
    m.observe_late_plan(policy="dyncp")
    m.set_lookahead_depth(policy="dyncp", steps=3)
    m.set_lookahead_depth(policy="dyncp", steps=1)
    assert value(m, "dyncp_fallback_plans_total", policy="dyncp", reason="late") == 2
    assert value(m, "dyncp_fallback_plans_total", policy="dyncp", reason="rejected") == 1
    assert value(m, "dyncp_fallback_plans_total", policy="dyncp", reason="error") == 0
    assert value(m, "dyncp_plan_service_late_plans_total", policy="dyncp") == 1
    assert value(m, "dyncp_plan_service_lookahead_steps", policy="dyncp") == 1


def test_rank_label_is_opt_in() -> None:
    plan = planner("dyncp").plan(batch())
    cost = evaluate_plan(plan, model())
    off = Metrics()
    off.observe_step(plan, cost=cost)
    assert "dyncp_rank_busy_seconds" not in off.exposition().decode()
    on = Metrics(rank_label=True)
    on.observe_step(plan, cost=cost)
    on.observe_measured_step(policy="dyncp", step_seconds=1.0, rank_busy_seconds=np.arange(8.0))
    for r in range(8):
        got = value(on, "dyncp_rank_busy_seconds", policy="dyncp", source="predicted", rank=str(r))
        assert got == pytest.approx(cost.rank_busy_seconds[r])
        got = value(on, "dyncp_rank_busy_seconds", policy="dyncp", source="measured", rank=str(r))
        assert got == r


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.observe_late_plan(policy="greedy"), "policy 'greedy'.*allowed: static"),
        (lambda m: m.observe_fallback(policy="dyncp", reason="slow"), "reason 'slow'.*late"),
        (lambda m: m.set_lookahead_depth(policy="dyncp", steps=-1), "integer >= 0"),
        (lambda m: m.set_lookahead_depth(policy="dyncp", steps=1.5), "integer >= 0"),
        (lambda m: m.observe_measured_step(policy="dyncp", step_seconds=0), "step_seconds"),
        (
            lambda m: m.observe_measured_step(policy="dyncp", step_seconds=math.nan),
            "step_seconds",
        ),
        (
            lambda m: m.observe_measured_step(
                policy="dyncp", step_seconds=1, rank_busy_seconds=[1.0], imbalance=1.0
            ),
            "not both",
        ),
        (
            lambda m: m.observe_measured_step(
                policy="dyncp", step_seconds=1, rank_busy_seconds=[1.0, -1.0]
            ),
            "rank_busy_seconds",
        ),
        (
            lambda m: m.observe_measured_step(
                policy="dyncp", step_seconds=1, predicted_step_seconds=-2
            ),
            "predicted_step_seconds",
        ),
        (lambda m: m.serve(port=70000), "0..65535"),
    ],
)
def test_bad_inputs_are_refused_with_a_named_reason(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(Metrics())


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Metrics(policies=())
    with pytest.raises(ValueError, match="distinct"):
        Metrics(policies=("a", "a"))
    with pytest.raises(ValueError, match="positive"):
        Metrics(cp_sizes=(0,))
    menu = Metrics(cp_sizes=(1, 3, 6))  # a menu beyond powers of two labels its own sizes
    menu._cp_label(6)
    menu._cp_label(8)
    with pytest.raises(ValueError, match="neither a power of two nor one of"):
        menu._cp_label(5)


def test_observe_step_needs_planner_stats() -> None:
    plan = planner("static").plan(batch())
    bare = StepPlan(plan.topology, plan.lengths, plan.waves, policy="static")
    with pytest.raises(ValueError, match="plan.stats lacks 'imbalance'"):
        Metrics().observe_step(bare)


def test_multiprocess_dir_set_after_import_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="before the process starts"):
        Metrics()


# ----------------------------------------------------------------------------- export


def test_http_exporter_serves_the_registry() -> None:
    m = Metrics()
    m.observe_fallback(policy="megatron", reason="error")
    exporter = m.serve(port=0, addr="127.0.0.1")
    try:
        assert exporter.port > 0
        assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            text = resp.read().decode()
    finally:
        exporter.close()
    assert 'dyncp_fallback_plans_total{policy="megatron",reason="error"} 1.0' in text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert "dyncp_step_imbalance_ratio" in families
    assert not any(name.startswith(("python_", "process_")) for name in families)


WRITER = textwrap.dedent(
    """
    import sys
    from dyncp.observability.metrics import Metrics
    m = Metrics(policies=("dyncp",))
    k = int(sys.argv[1])
    m.observe_late_plan(policy="dyncp")
    m.observe_measured_step(policy="dyncp", step_seconds=float(k), imbalance=1.0 + k / 10)
    m.set_lookahead_depth(policy="dyncp", steps=k)
    """
)
READER = textwrap.dedent(
    """
    from dyncp.observability.metrics import Metrics
    print(Metrics(policies=("dyncp",)).exposition().decode())
    """
)


def test_multiprocess_collector_aggregates_every_writer(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for k in (1, 2, 3):  # one after another, so "most recent" is the last writer
        subprocess.run([sys.executable, "-c", WRITER, str(k)], env=env, check=True, timeout=60)
    assert len(list(tmp_path.glob("*.db"))) >= 3
    out = subprocess.run(
        [sys.executable, "-c", READER], env=env, check=True, timeout=60, capture_output=True
    ).stdout.decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(out)
        for s in fam.samples
    }
    assert samples[("dyncp_plan_service_late_plans_total", (("policy", "dyncp"),))] == 3
    lab = (("policy", "dyncp"), ("source", "measured"))
    assert samples[("dyncp_step_seconds_count", lab)] == 3
    assert samples[("dyncp_step_seconds_sum", lab)] == 6
    assert samples[("dyncp_step_imbalance_ratio_sum", lab)] == pytest.approx(3.6)
    assert samples[("dyncp_plan_service_lookahead_steps", (("policy", "dyncp"),))] == 3


# ----------------------------------------------------------------------------- the simulator


def test_replay_feeds_metrics_that_match_the_report() -> None:
    lengths = np.random.default_rng(0).integers(1, 3000, 400)
    batches = list(draw_batches(lengths, steps=3, seed=1, global_batch_tokens=8 * 512))
    planners = {p: planner(p) for p in POLICIES}
    m = Metrics(cp_sizes=(1, 2, 4, 8))
    seen: list[tuple[int, str]] = []

    def on_plan(step: int, name: str, plan: StepPlan) -> None:
        seen.append((step, name))
        m.observe_step(plan)

    runs, bounds = replay(batches, planners, on_plan=on_plan)
    assert seen == [(s, p) for s in range(3) for p in POLICIES]
    summary = summarise(runs, bounds)
    for name, pol in summary["policies"].items():
        lab = {"policy": name, "source": "predicted"}
        n = value(m, "dyncp_step_imbalance_ratio_count", **lab)
        mean = value(m, "dyncp_step_imbalance_ratio_sum", **lab) / n
        assert n == 3
        assert mean == pytest.approx(pol["mean_imbalance"], rel=1e-12)
        steps = value(m, "dyncp_step_seconds_sum", **lab) / n
        assert steps == pytest.approx(pol["mean_step_seconds"], rel=1e-12)
        hist = {
            cp: value(m, "dyncp_sequences_total", policy=name, cp_size=cp)
            for cp in ("1", "2", "4", "8")
        }
        assert {cp: n for cp, n in hist.items() if n} == pol["cp_histogram"]


@pytest.mark.parametrize("timing", ["barrier", "dataflow"])
def test_synthetic_measurement_without_noise_is_the_prediction(timing: str) -> None:
    plan = planner("megatron").plan(batch())
    cost = evaluate_plan(plan, model(), timing=timing)
    rng = np.random.default_rng(0)
    exact = synthetic_measurement(plan, cost, model(), rng, 0.0)
    # Re-timed as the prediction was (megatron's waves make the two timings differ here).
    assert exact.step_seconds == pytest.approx(cost.step_seconds, rel=1e-12)
    other = "barrier" if timing == "dataflow" else "dataflow"
    assert exact.step_seconds != pytest.approx(
        evaluate_plan(plan, model(), timing=other).step_seconds, rel=1e-9
    )
    np.testing.assert_allclose(exact.rank_busy_seconds, cost.rank_busy_seconds, rtol=1e-12)
    noisy = synthetic_measurement(plan, cost, model(), rng, 0.2)
    assert noisy.step_seconds != pytest.approx(cost.step_seconds, rel=1e-6)
    with pytest.raises(ValueError, match="sigma"):
        synthetic_measurement(plan, cost, model(), rng, -1.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hold"], "--hold needs --metrics-port"),
        (["--step-delay", "0.1"], "--step-delay needs --metrics-port"),
        (["--measurement-noise", "0.1"], "--measurement-noise needs --metrics-port"),
        (["--metrics-port", "70000"], "expected a port 0..65535"),
        (["--metrics-port", "0", "--hold", "-1"], "expected seconds >= 0"),
    ],
)
def test_cli_metrics_flag_errors(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--steps", "1", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_serves_metrics_while_replaying(tmp_path: Path) -> None:
    """--metrics-port 0 picks a free port and prints it; --hold keeps serving after the replay."""
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dyncp.sim",
            *SMALL,
            "--steps",
            "2",
            "--metrics-port",
            "0",
            "--hold",
            "60",
            "--measurement-noise",
            "0.05",
            "--json",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if found := re.search(r"serving metrics on (http://\S+)", line):
                url = found.group(1)
            if "replay done" in line:
                break
        assert url is not None, "the simulator did not print its metrics URL"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report = json.loads(out.read_text())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    for name, pol in report["policies"].items():
        for source in SOURCES:
            lab = (("policy", name), ("source", source))
            assert samples[("dyncp_step_imbalance_ratio_count", lab)] == 2
        lab = (("policy", name), ("source", "predicted"))
        mean = samples[("dyncp_step_imbalance_ratio_sum", lab)] / 2
        assert mean == pytest.approx(pol["mean_imbalance"], rel=1e-12)
        assert samples[("dyncp_cost_model_relative_error_ratio_count", (("policy", name),))] == 2


def test_sampler_hook_records_plans_late_steps_and_fallbacks() -> None:
    """The on_step hook feeds a sampler's steps into the metrics, fallbacks with their reason."""
    from types import SimpleNamespace

    from dyncp.cost_model import CostModel
    from dyncp.planner import Planner

    planner = Planner(
        CostModel.load("h100-reference", ranks_per_node=8),
        world=64,
        ranks_per_node=8,
        capacity=8192,
        cpsat=None,
    )
    metrics = Metrics(cp_sizes=planner.topology.group_sizes)
    hook = metrics.sampler_hook(lookahead=2)
    plan = planner.plan([300, 9000, 70000, 5, 1200])
    hook(plan, SimpleNamespace(source="service", reason=None, ready=True))
    hook(plan, SimpleNamespace(source="fallback", reason="late", ready=False))
    text = metrics.exposition().decode()

    def value(line_start: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(line_start))
        return float(line.rsplit(" ", 1)[1])

    assert value('dyncp_plan_seconds_count{policy="dyncp"}') == 2
    assert value('dyncp_fallback_plans_total{policy="dyncp",reason="late"}') == 1
    assert value('dyncp_plan_service_late_plans_total{policy="dyncp"}') == 1
    assert value('dyncp_plan_service_lookahead_steps{policy="dyncp"}') == 2
