"""Whole-step calibration in the training loop on 2 gloo ranks: every rank adopts the same model
versions at the same steps, each step is predicted before it is learnt from, and time a step
spends outside its micro-batches is learnt as its fixed part."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_calibration_runtime import CFG, fast_profile, tiny_planner, train_step

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.step_parts import step_parts
from dyncp.planner import VersionedPlanner
from dyncp.runtime import GroupPool, execute
from dyncp.runtime.whole_step import WholeStepCalibration
from dyncp.testing import TinyDecoder
from dyncp.testing.distributed import run_gloo

#: Seconds each step sleeps after its micro-batches (the optimizer's stand-in): a lower bound
#: on what it spends outside them, however loaded the machine.
OUTSIDE = 0.05


def _worker(rank: int, world: int) -> dict:
    pool = GroupPool()
    profile = fast_profile()
    calib = WholeStepCalibration(pool, profile, ranks_per_node=world)
    planner = VersionedPlanner(tiny_planner(profile, world), calib.current)
    model = TinyDecoder(CFG)
    rng = np.random.default_rng(0)
    out: dict = {"versions": [], "before": [], "predicted": []}
    for step in range(8):
        lengths = [int(x) for x in rng.integers(8, 300, size=10)]
        plan = planner.plan(lengths)
        start = time.perf_counter()
        report = execute(plan, pool, train_step(model, lengths, seed=step))
        time.sleep(OUTSIDE)
        wall = time.perf_counter() - start
        # What the step is predicted at before it is learnt from: the current version's parts.
        planned = calib.current.model(world)
        seconds = evaluate_plan(plan, planned).step_seconds
        before = step_parts(plan, planned, planned_seconds=seconds).total + calib.fixed.fixed
        # Every rank's busiest busy time is the same figure (here: the largest of the two).
        seen = calib.step(plan, report, step_seconds=wall, busiest_seconds=report.busy_seconds)
        if seen.new_version is not None:
            planner = VersionedPlanner.rebuild(planner, seen.new_version)
        out["versions"].append(calib.current.digest)
        out["before"].append(before)
        out["predicted"].append(seen.predicted_seconds)
    out["fixed"] = calib.fixed.fixed
    out["summary"] = calib.summary()
    return out


@pytest.mark.timeout(180)
def test_whole_step_calibration_on_every_rank() -> None:
    a, b = run_gloo(_worker, world=2, timeout=150)
    assert a["versions"] == b["versions"]  # the same model version at every step on every rank
    assert len(set(a["versions"])) >= 2  # the fast profile was refitted
    assert a["predicted"] == pytest.approx(a["before"], rel=1e-9)  # predicted before learnt
    # The sleep is outside micro-batches: at least that much becomes the fixed part.
    assert a["fixed"] >= 0.8 * OUTSIDE
    assert "calibration: model v" in a["summary"] and "per-step part" in a["summary"]
