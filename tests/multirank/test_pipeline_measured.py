"""Measurement and calibration of pipelined steps on 4 gloo processes (PP 2 x DP-CP 2), end to end.

The real planner plans batches under a profile 20x too fast (``scaled_profile(cpu-gloo, 0.05)``);
``execute_pipeline`` runs them with the profile's tiny decoder in fp32; ``pipeline_measurement``
reads the gathered timelines; ``calibrate_pipeline`` refits on the even steps and is judged on
the odd ones. Asserted: the measurements describe exactly the plans' groups and operations
(structure, causality of every hand-off on the machine's one clock), and calibration brings the
held-out steps from 10x off or worse to within 2.2x on average (log error; the figures are
``bench/pipeline_measured.py``'s). No wall-clock figure is asserted: the 20x start is wrong
on any machine at least as slow as the profile's, and a loaded machine only widens its error.
"""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import pipelined_plans

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.calibration.level import scaled_profile
from dyncp.cost_model.calibration.pipeline import calibrate_pipeline, predict_step
from dyncp.plan.pipeline import BACKWARD, FORWARD
from dyncp.testing import measured_steps
from dyncp.testing.distributed import run_gloo

CONFIG = {"vocab": 256, "dim": 64, "heads": 4, "kv_heads": 2, "layers": 2, "ffn": 128}
WARMUP, STEPS = 1, 8


def _plans(profile):
    model = CostModel(profile, 2)
    return pipelined_plans(model, n=WARMUP + STEPS, seed=0, size=8, capacity=256, max_length=512)


def _check_structure(plan, m, reports) -> None:
    p, w, nq = plan.pipeline.stages, plan.topology.world, plan.pipeline.model_stages
    groups = [(j, g) for j, wave in enumerate(plan.waves) for g in wave.groups]
    assert [(x.cp, x.lengths) for x in m.microbatches] == [
        (g.size, tuple(plan.lengths[i] for i in g.microbatches[0].seq_ids)) for _, g in groups
    ]
    busy = np.zeros((len(plan.waves), w), dtype=bool)
    for j, g in groups:
        busy[j, g.start : g.start + g.size] = True
        for table in (m.forward, m.backward):  # one value per group and stage, > 0
            block = table[j, g.start : g.start + g.size]
            assert (block > 0).all() and (block == block[0]).all()
    assert (m.forward[~busy] == 0).all() and (m.backward[~busy] == 0).all()
    assert m.busy.shape == (p, w) and (m.busy <= m.step_seconds).all()
    assert 0 < m.bubble_fraction < 1
    # every hand-off arrives after it was posted (one clock for the machine's processes)
    ops = {
        (o.kind, o.slot, o.chunk * p + r.stage, r.column): (r, o) for r in reports for o in r.ops
    }
    for (kind, j, q, c), (r, o) in ops.items():
        sender = q - 1 if kind == FORWARD else q + 1
        if kind == BACKWARD and q == nq - 1 or kind == FORWARD and q == 0:
            assert o.ready == o.start  # receives nothing
            continue
        src, so = ops[(kind, j, sender, c)]
        assert r.origin + o.ready > src.origin + so.sent
        assert o.start <= o.ready <= o.end and so.ready <= so.sent <= so.end
    assert m.hops and all(h.seconds > 0 for h in m.hops)


@pytest.mark.timeout(60)
def test_measured_steps_calibrate_the_pipelined_prediction_on_held_out_steps() -> None:
    wrong = scaled_profile(load_profile("cpu-gloo"), 0.05, ranks_per_node=2)
    plans = _plans(wrong)
    measured, reports = run_gloo(
        measured_steps, world=4, args=([x.to_json() for x in plans], 2, CONFIG), timeout=50
    )[0]
    plans, measured, reports = plans[WARMUP:], measured[WARMUP:], reports[WARMUP:]
    for plan, m, rep in zip(plans, measured, reports):
        _check_structure(plan, m, rep)
    cal = calibrate_pipeline(wrong, measured[0::2], model_stages=2, ranks_per_node=2)
    before, after = CostModel(wrong, 2), CostModel(cal.profile, 2)
    held = list(zip(plans, measured))[1::2]

    def error(model, p2p=None) -> float:  # mean |log(predicted / measured)| of the step
        return float(
            np.mean(
                [
                    abs(np.log(predict_step(p, model, p2p).step_seconds / m.step_seconds))
                    for p, m in held
                ]
            )  # fmt: skip
        )

    err_before, err_after = error(before), error(after, cal.p2p)
    print(f"held-out mean |log(pred/meas)|: before {err_before:.3f}, after {err_after:.3f}")
    assert err_before > np.log(10), err_before  # 20x too fast: off by 10x at least
    # a robust margin on a shared machine (load swings between steps): within 2.2x of the
    # measured step on average where the start is off by 10x or more
    assert err_after < min(err_before / 3, np.log(2.2)), (err_before, err_after)
