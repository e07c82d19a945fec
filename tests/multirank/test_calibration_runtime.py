"""Calibration in the training loop on 2 gloo ranks: the measurements the runtime gathers match
the plan, a refit reaches every rank at the same step, and after it every rank still plans and
runs the same plan (same digest) with the new model version."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dyncp.cost_model import CostModel, Profile, load_profile
from dyncp.cost_model.calibration import ModelVersion, OnlineCalibrator
from dyncp.cost_model.calibration.level import scaled_profile
from dyncp.planner import Planner, VersionedPlanner
from dyncp.runtime import GroupPool, execute
from dyncp.runtime.measure import CollectiveCalibration, gather_reports, step_measurements
from dyncp.service import plan_digest
from dyncp.testing import TinyConfig, TinyDecoder, microbatch_loss
from dyncp.testing.distributed import run_gloo

CFG = TinyConfig(vocab=64, dim=32, heads=2, kv_heads=1, layers=1, ffn=64)


def train_step(model: TinyDecoder, lengths, seed: int):
    """A step_fn: forward + backward of seeded random tokens of ``lengths`` (same on all ranks)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, CFG.vocab, (int(s),), generator=gen) for s in lengths]

    def step_fn(ctx) -> None:
        microbatch_loss(model, ctx, torch.cat([tokens[i] for i in ctx.seq_ids])).backward()

    return step_fn


def tiny_planner(profile: Profile, world: int) -> Planner:
    """The deterministic planner of these tests: one node of ``world`` ranks, 256 tokens each."""
    return Planner(
        CostModel(profile, world),
        world=world,
        ranks_per_node=world,
        capacity=256,
        deterministic=True,
        cpsat=None,
    )


def _worker(rank: int, world: int) -> dict:
    pool = GroupPool()
    profile = fast_profile()
    base = tiny_planner(profile, world)
    calibrator = OnlineCalibrator(
        profile, ranks_per_node=world, refit_every=1, min_measurements=8, min_gain=0.0
    )
    loop = CollectiveCalibration(pool, calibrator)
    planner = VersionedPlanner(base, ModelVersion(0, profile))
    torch.manual_seed(0)
    model = TinyDecoder(CFG)
    rng = np.random.default_rng(0)
    out = {"digests": [], "versions": [], "measured": []}
    for step in range(6):
        lengths = [int(x) for x in rng.integers(8, 300, size=10)]
        plan = planner.plan(lengths)
        report = execute(plan, pool, train_step(model, lengths, seed=step))
        if step == 0:  # the gathered measurements describe exactly the plan's micro-batches
            reports = gather_reports(report, pool)
            if reports is not None:
                mbs, waves = step_measurements(plan, reports)
                planned = sorted(
                    (g.size, tuple(plan.lengths[i] for i in mb.seq_ids))
                    for _, g, mb in plan.microbatches()
                )
                assert sorted((m.cp, m.lengths) for m in mbs) == planned
                assert len(waves) == len(plan.waves)
                assert all(w.seconds >= w.busy_seconds > 0 for w in waves)
                out["measured"] = [m.seconds for m in mbs]
        new = loop.step(plan, report)
        if new is not None:
            planner = VersionedPlanner.rebuild(planner, new)
        out["digests"].append(plan_digest(plan))
        out["versions"].append((plan.stats["model_version"], loop.current.digest))
    return out


@pytest.mark.timeout(180)
def test_every_rank_switches_model_at_the_same_step_and_runs_one_plan():
    a, b = run_gloo(_worker, world=2, timeout=150)
    assert a["digests"] == b["digests"]
    assert a["versions"] == b["versions"]
    assert max(v for v, _ in a["versions"]) >= 1  # a refit was adopted and used
    assert a["measured"] and all(s > 0 for s in a["measured"])


def fast_profile() -> Profile:
    """cpu-gloo with every time divided by 20: predictions 20x faster than any machine of this
    kind runs (a busy or slower machine only widens the gap), so the first refit on measured
    steps beats it on held-out ones and a version is adopted, whatever the machine's speed. A
    start that is too *slow* would not do: on a machine slower than the profile's, it can be
    close to the truth, and a refit from a few noisy steps is then rightly not adopted."""
    return scaled_profile(load_profile("cpu-gloo"), 0.05, ranks_per_node=2)


def _store_worker(rank: int, world: int) -> dict:
    """The plan-service path: rank 0 serves and calibrates, every rank reads plans from a
    TCPStore and pushes its measurements through it."""
    from datetime import timedelta

    import torch.distributed as dist

    from dyncp.control.model_channel import MeasurementChannel, ModelChannel, ServiceCalibration
    from dyncp.control.signing import PlanSigner
    from dyncp.runtime.measure import StoreMeasurements
    from dyncp.sampler import BatchSchedule
    from dyncp.service import PlanClient, PlanService

    secret = b"calibration-test-secret-0123456789"
    port = [None]
    master = None
    if rank == 0:
        master = dist.TCPStore(
            "127.0.0.1", 0, world, True, timedelta(seconds=30), wait_for_workers=False
        )
        port[0] = master.port
    dist.broadcast_object_list(port, src=0)
    store = master or dist.TCPStore("127.0.0.1", port[0], world, False, timedelta(seconds=30))
    pool = GroupPool()
    profile = fast_profile()
    planner = Planner(
        CostModel(profile, world),
        world=world,
        ranks_per_node=world,
        capacity=256,
        deterministic=True,
        cpsat=None,
    )
    rng = np.random.default_rng(0)
    schedule = BatchSchedule(
        rng.integers(8, 400, size=400),
        max_length=world * 256,
        seed=0,
        shuffle=True,
        global_batch_tokens=2 * world * 256,
    )
    signer = PlanSigner(secret)
    client = PlanClient(
        store,
        source=schedule,
        planner=planner,
        prefix="cal",
        rank=rank,
        deadline=30.0,
        secret=secret,
        models=ModelChannel(store, "cal", signer=signer),
    )
    service = None
    if rank == 0:
        calibrator = OnlineCalibrator(
            profile,
            ranks_per_node=world,
            refit_every=1,
            min_measurements=8,
            min_gain=0.0,
            holdout_every=2,
        )
        service = PlanService(
            store,
            source=schedule,
            planner=planner,
            prefix="cal",
            lookahead=0,
            secret=secret,
            calibration=ServiceCalibration(store, "cal", calibrator, signer=signer, interval=0.0),
        ).start()
    pusher = StoreMeasurements(pool, MeasurementChannel(store, "cal", signer=signer))
    torch.manual_seed(0)
    model = TinyDecoder(CFG)
    out = {"digests": [], "versions": []}
    for step in range(8):
        fetched = client.fetch(0, step)
        plan = fetched.plan
        report = execute(plan, pool, train_step(model, plan.lengths, seed=step))
        pusher.step(step, plan, report)
        if rank == 0 and step == 3:  # let the service drain and refit before planning on
            end = time.monotonic() + 30
            while ModelChannel(store, "cal", signer=signer).latest() is None:
                assert time.monotonic() < end, (
                    f"no refit adopted: refits {calibrator.refits}, measurements "
                    f"{calibrator.buffer.seen}, failures {calibrator.failures}, refused "
                    f"{calibrator.refused}, adopted {[a for _, a in calibrator.history]}, "
                    f"service alive {service.alive}, failure {service.failure!r}"
                )
                time.sleep(0.01)
        dist.barrier()
        out["digests"].append(plan_digest(plan))
        out["versions"].append((fetched.source, plan.stats.get("model_version")))
    if service is not None:
        service.stop()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_service_path_calibrates_from_pushed_measurements_with_one_plan_per_step():
    a, b = run_gloo(_store_worker, world=2, timeout=150)
    assert a["digests"] == b["digests"]
    assert a["versions"] == b["versions"]
    assert all(src == "service" for src, _ in a["versions"])
    assert a["versions"][0][1] == 0 and a["versions"][-1][1] >= 1
