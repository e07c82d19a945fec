"""Online calibration with plans read as slices, on 4 gloo ranks (two nodes of two: two records).

Each rank holds only its slice; every rank runs it (``execute``), checks its own timings against
it, and position 0 pushes the step's measurements (``StoreMeasurements``) to the calibrating
plan service on rank 0. Asserted: the measurements pushed are exactly the step's micro-batches
(every rank's groups, each once), the service observes every step and refuses none, and every
rank ran the same published plan (no fallback) in every step.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch.distributed as dist

from dyncp.control.model_channel import MeasurementChannel
from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.calibration import OnlineCalibrator
from dyncp.plan import PlanSlice
from dyncp.planner import Planner
from dyncp.runtime import GroupPool, execute
from dyncp.runtime.measure import StoreMeasurements
from dyncp.sampler import DynamicCPSampler
from dyncp.testing.distributed import run_gloo

WORLD, NODE, CAPACITY = 4, 2, 256
PROFILE = load_profile("cpu-gloo")


def _planner() -> Planner:
    model = CostModel(PROFILE, NODE)
    return Planner(model, world=WORLD, ranks_per_node=NODE, capacity=CAPACITY, cpsat=None)


def _worker(rank: int, world: int) -> dict:
    store = dist.distributed_c10d._get_default_store()
    pool = GroupPool()
    rng = np.random.default_rng(4)
    lengths = np.clip(rng.lognormal(4.5, 1.0, 160).astype(np.int64), 1, WORLD * CAPACITY)
    calibrator = OnlineCalibrator(PROFILE, ranks_per_node=NODE, refit_every=1, min_gain=0.0)
    channel = MeasurementChannel(store, "cal-slices")
    pushed: list[list[tuple[int, tuple[int, ...]]]] = []
    push = channel.push
    channel.push = lambda step, mbs, waves=(): (  # type: ignore[method-assign]
        pushed.append(sorted((m.cp, m.lengths) for m in mbs)),
        push(step, mbs, waves),
    )
    measurements = StoreMeasurements(pool, channel)
    mine: list[list] = []
    sources: list[tuple[str, int]] = []

    def on_step(plan, info) -> None:  # collective, in step order on every rank
        assert isinstance(plan, PlanSlice), type(plan)
        sources.append((info.source, info.digest))
        report = execute(plan, pool, lambda ctx: time.sleep(2e-6 * sum(ctx.seqlens)))
        mine.append(
            [
                (w, g.start, k, g.size, tuple(plan.lengths[i] for i in mb.seq_ids))
                for w, wave in enumerate(plan.waves)
                for g in wave.groups
                for k, mb in enumerate(g.microbatches)
            ]
        )
        measurements.step(info.step, plan, report)

    sampler = DynamicCPSampler(
        lengths, planner=_planner(), world_size=WORLD, rank=rank, capacity=CAPACITY,
        global_batch_tokens=2 * WORLD * CAPACITY, store=store, prefix="cal-slices",
        calibrate=calibrator, slices=True, deadline=5.0, on_step=on_step,
    )  # fmt: skip
    for _ in sampler:
        pass
    steps = sampler.num_steps
    out = {"sources": sources, "mine": mine, "pushed": pushed, "steps": steps}
    if rank == 0:  # the service drains between plans: wait until it has seen every step
        end = time.monotonic() + 30
        while calibrator.steps < steps and time.monotonic() < end:
            time.sleep(0.05)
        out.update(
            observed=calibrator.steps, refused=calibrator.refused, rejected=calibrator.rejected
        )
    sampler.close()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_calibration_with_slices_measures_every_groups_micro_batches() -> None:
    runs = run_gloo(_worker, world=WORLD, timeout=150, pg_timeout=30)
    steps = runs[0]["steps"]
    assert steps >= 3
    assert len({str(r["sources"]) for r in runs}) == 1  # the same plan on every rank
    assert all(source == "service" for source, _ in runs[0]["sources"]), runs[0]["sources"]
    pushed = runs[0]["pushed"]
    assert len(pushed) == steps
    for s in range(steps):
        groups = {entry for r in runs for entry in r["mine"][s]}  # each group once
        expected = sorted((size, lens) for _, _, _, size, lens in groups)
        assert [tuple(x) for x in pushed[s]] == expected, s
        assert any(size > 1 for size, _ in expected) and len({w for w, *_ in groups}) >= 1
    assert runs[0]["observed"] == steps
    assert runs[0]["refused"] == runs[0]["rejected"] == 0
