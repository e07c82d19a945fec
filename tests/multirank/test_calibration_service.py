"""Calibration through the plan service: measurements pushed by the trainers reach the service,
its adopted model versions reach every reader, and fallbacks after a model update are priced with
a version every reader agrees on (named in the step's one-shot decision), whatever a hostile
client writes to the model keys."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist

from dyncp.control.model_channel import MeasurementChannel, ModelChannel, ServiceCalibration
from dyncp.control.signing import PlanSigner
from dyncp.cost_model import CostModel, evaluate_plan, load_profile
from dyncp.cost_model.calibration.coefficients import apply_coefficients, profile_coefficients
from dyncp.cost_model.calibration.fit import Measurement
from dyncp.cost_model.calibration.online import ModelVersion, OnlineCalibrator
from dyncp.planner import Planner
from dyncp.sampler import BatchSchedule
from dyncp.service import PlanClient, PlanService, plan_digest, step_key

WORLD, CAPACITY = 4, 1024
PROFILE = load_profile("cpu-gloo")
SECRET = b"0123456789abcdef0123456789abcdef"


def slower_profile():
    model = CostModel(PROFILE, WORLD)
    theta = profile_coefficients(model, []).copy()
    theta[0] *= 1.3
    theta[4] *= 2.0
    return apply_coefficients(PROFILE, theta, PROFILE.overheads.wave_seconds, [], model)


def push_slower_steps(pusher: MeasurementChannel, steps: int, seed: int) -> None:
    """Push ``steps`` steps of 16 micro-batches (CP 1, 2, 4) timed by ``slower_profile``."""
    truth = CostModel(slower_profile(), WORLD)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        mbs = []
        for i in range(16):
            cp = (1, 2, 4)[i % 3]
            lengths = tuple(int(x) for x in rng.integers(20, 600, size=4))
            mbs.append(Measurement(cp, lengths, truth.microbatch_seconds(cp, lengths)))
        pusher.push(step, mbs)


def make_planner() -> Planner:
    return Planner(
        CostModel(PROFILE, WORLD),
        world=WORLD,
        ranks_per_node=WORLD,
        capacity=CAPACITY,
        deterministic=True,
        cpsat=None,
    )


def make_schedule() -> BatchSchedule:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.2, 400).astype(np.int64), 1, WORLD * CAPACITY)
    return BatchSchedule(
        lengths, max_length=WORLD * CAPACITY, seed=0, global_batch_tokens=2 * WORLD * CAPACITY
    )


def clients(store, schedule, n=2):
    return [
        PlanClient(
            store,
            source=schedule,
            planner=make_planner(),
            prefix="job",
            rank=r,
            deadline=0.0,
            secret=SECRET,
            models=ModelChannel(store, "job", signer=PlanSigner(SECRET)),
        )
        for r in range(n)
    ]


def test_fallbacks_after_a_model_update_use_the_named_version_on_every_reader():
    store = dist.HashStore()
    schedule = make_schedule()
    readers = clients(store, schedule)
    models = ModelChannel(store, "job", signer=PlanSigner(SECRET))
    v1 = ModelVersion(1, slower_profile())
    models.publish(v1)
    got = [r.fetch(0, 0) for r in readers]  # no service: reader 0 decides FALLBACK v1
    assert store.get(step_key("job", 0, 0)).endswith(b"FALLBACK v1")
    assert [g.source for g in got] == ["fallback", "fallback"]
    assert plan_digest(got[0].plan) == plan_digest(got[1].plan)
    assert all(g.plan.stats["model_version"] == 1 for g in got)
    v1_model = CostModel(v1.profile, WORLD)
    assert got[0].plan.stats["predicted_step_seconds"] == pytest.approx(
        evaluate_plan(got[0].plan, v1_model, timing="dataflow").step_seconds, rel=1e-12
    )

    # A hostile client points `latest` at garbage: readers cannot read it; the decision names
    # no version and every reader uses the starting model.
    store.set("dyncp/job/model/latest", b"99")  # unsigned
    got = [r.fetch(0, 1) for r in readers]
    assert store.get(step_key("job", 0, 1)).endswith(b"FALLBACK")
    assert plan_digest(got[0].plan) == plan_digest(got[1].plan)
    assert got[0].plan.stats["model_version"] == 0


def test_an_unsigned_model_version_is_refused_by_every_reader():
    store = dist.HashStore()
    readers = clients(store, make_schedule())
    models = ModelChannel(store, "job", signer=PlanSigner(SECRET))
    models.publish(ModelVersion(1, PROFILE))
    store.set("dyncp/job/model/v2", ModelVersion(2, slower_profile()).to_json())  # forged
    store.set(step_key("job", 0, 0), PlanSigner(SECRET).seal(step_key("job", 0, 0), b"FALLBACK v2"))
    got = [r.fetch(0, 0) for r in readers]
    assert plan_digest(got[0].plan) == plan_digest(got[1].plan)
    assert got[0].plan.stats["model_version"] == 0  # the forged v2 was not used
    assert all(r.models.rejected == 1 for r in readers)


@pytest.mark.timeout(60)
def test_service_refits_from_pushed_measurements_and_prices_plans_with_the_new_version():
    store = dist.HashStore()
    schedule = make_schedule()
    signer = PlanSigner(SECRET)
    calibrator = OnlineCalibrator(PROFILE, ranks_per_node=WORLD, refit_every=1, min_measurements=32)
    service = PlanService(
        store,
        source=schedule,
        planner=make_planner(),
        prefix="job",
        lookahead=0,
        secret=SECRET,
        calibration=ServiceCalibration(store, "job", calibrator, signer=signer, interval=0.0),
    )
    reader = clients(store, schedule, n=1)[0]
    reader.deadline = 10.0
    with service:
        first = reader.fetch(0, 0)
        assert first.source == "service" and first.plan.stats["model_version"] == 0
        push_slower_steps(MeasurementChannel(store, "job", signer=signer), 3, seed=1)
        end = time.monotonic() + 20
        while ModelChannel(store, "job", signer=signer).latest() is None:
            assert time.monotonic() < end, (
                f"the service never adopted a refit: refits {calibrator.refits}, measurements "
                f"{calibrator.buffer.seen}, failures {calibrator.failures}, refused "
                f"{calibrator.refused}, adopted {[a for _, a in calibrator.history]}, service "
                f"alive {service.alive}, failure {service.failure!r}"
            )
            time.sleep(0.01)
        later = reader.fetch(0, 2)  # planned after the new version was adopted
    assert later.source == "service" and later.plan.stats["model_version"] == 1
    assert calibrator.current.version == 1 and calibrator.last.error_after < 0.01


@pytest.mark.timeout(120)
def test_serve_command_calibrates_and_saves_the_profile(tmp_path):
    """python -m dyncp.service --calibrate: measurements pushed by a trainer are fitted, the
    version is published (signed with the job's secret) and the profile saved."""
    master = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False
    )
    rng = np.random.default_rng(0)
    np.save(tmp_path / "lengths.npy", np.clip(rng.lognormal(5.5, 1.2, 400), 1, 4000).astype(int))
    saved = tmp_path / "calibrated.json"
    cmd = [
        sys.executable,
        "-m",
        "dyncp.service.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(master.port),
        "--prefix",
        "cal",
        "--dataset",
        str(tmp_path / "lengths.npy"),
        "--world",
        str(WORLD),
        "--ranks-per-node",
        str(WORLD),
        "--capacity",
        str(CAPACITY),
        "--global-batch-tokens",
        str(2 * WORLD * CAPACITY),
        "--profile",
        "cpu-gloo",
        "--time-limit",
        "0.05",
        "--duration",
        "60",
        "--calibrate",
        "--refit-every",
        "1",
        "--save-profile",
        str(saved),
        "--run-id",
        "cal-run",  # required with a secret; measurements and versions are bound to it
    ]
    env = dict(os.environ, DYNCP_PLAN_SECRET=SECRET.decode())
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    signer = PlanSigner(SECRET, run="cal-run")
    try:
        push_slower_steps(MeasurementChannel(master, "cal", signer=signer), 2, seed=2)
        models = ModelChannel(master, "cal", signer=signer)
        end = time.monotonic() + 60
        while models.latest() is None:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < end, "dyncp.service.cli never adopted a refit"
            time.sleep(0.05)
        assert models.get(models.latest()).version >= 1
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "cost model v1" in out or "cost model v2" in out, out
    profile = load_profile(saved)
    # 32 measured, every 5th held out to judge the refit (and never fitted): 26 fitted
    assert any("calibrated from 26 micro-batches" in n for n in profile.provenance.notes)
