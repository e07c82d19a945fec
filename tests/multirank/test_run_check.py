"""The plan service's run, checked at start: 2 gloo ranks of samplers over a real TCPStore.

Properties asserted: with a secret, readers whose run the service does not serve (another
explicit run id, a service bound to no run or ranks bound to none, a service without the secret
or with another one, no service at all) stop before their first step with one
``ServiceRunError`` whose message is the same on every rank and names the mismatch, instead of
falling back at every step; readers started before their service, even with an earlier run's
announcement still in the Store, wait for it and then run every step on its plans; the
announcement holds neither the run id nor the secret.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from dyncp.control.signing import SECRET_ENV, SECRET_FILE_ENV, PlanSigner
from dyncp.cost_model import CostModel
from dyncp.planner import Planner
from dyncp.sampler import BatchSchedule, DynamicCPSampler
from dyncp.service import PlanService
from dyncp.service.protocol import run_key
from dyncp.service.run_check import RUN_OK, ServiceRunError, announcement, verdict
from dyncp.testing.distributed import run_gloo

WORLD, CAPACITY = 2, 1024
SECRET = b"a-per-job-secret-of-32-bytes...."
OTHER_SECRET = b"another-jobs-secret-of-32-bytes."
WAIT = 4.0  # seconds the readers wait for the service at start (service_wait)
LATE = 1.5  # seconds after the readers start that the late service starts
TOKENS = 2 * WORLD * CAPACITY  # per global batch


@functools.lru_cache
def _model() -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node=WORLD)


def _planner() -> Planner:
    return Planner(_model(), world=WORLD, ranks_per_node=WORLD, capacity=CAPACITY, cpsat=None)


def _lengths() -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.clip(rng.lognormal(5.5, 1.2, 60).astype(np.int64), 1, WORLD * CAPACITY)


#: scenario -> (the readers' run_id, what the test process serves at the scenario's prefix)
SCENARIOS = {
    "same-run": ("run-B", "service run-B"),
    "other-run": ("run-B", "service run-A"),
    "service-unbound": ("run-B", "service"),
    "readers-unbound": ("", "service run-A"),
    "unsigned-service": ("run-B", "unsigned run-B"),
    "other-secret": ("run-B", "other-secret run-B"),
    "no-service": ("run-B", "nothing"),
    "late-service": ("run-B", "late run-B, earlier run-A"),
    "cli-other-run": ("run-B", "python -m dyncp.service --run-id run-A"),
}
#: What the one line on every rank says (None: no error, every step on the service's plans).
EXPECTED = {
    "same-run": None,
    "other-run": "serves another run than this rank's (run_id 'run-B')",
    "service-unbound": "is bound to no run, this rank to run_id 'run-B'",
    "readers-unbound": "is bound to a run, this rank to none",
    "unsigned-service": "has no secret, this rank has one",
    "other-secret": "is not a run announcement signed with this job's secret",
    "no-service": "no plan service announced itself at dyncp/no-service/run within 4 s",
    "late-service": None,
    "cli-other-run": "serves another run than this rank's (run_id 'run-B')",
}


def _readers(rank: int, world: int, port: int) -> dict:
    """Every scenario in turn, each on a sampler of its own (the agreement on, by default)."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    out = {}
    for name, (run_id, _) in SCENARIOS.items():
        store.set(f"ready/{name}/{rank}", b"1")  # the late service starts LATE s after this
        sampler = DynamicCPSampler(
            _lengths(),
            world_size=world,
            rank=rank,
            capacity=CAPACITY,
            planner=_planner(),
            global_batch_tokens=2 * world * CAPACITY,
            store=store,
            prefix=name,
            serve=False,
            secret=SECRET,
            run_id=run_id,
            service_wait=WAIT,
            deadline=WAIT,
        )
        try:
            list(sampler)
            c = sampler.counters
            out[name] = {"steps": c.steps, "service": c.service_plans, "fallbacks": c.fallbacks}
        except ServiceRunError as exc:
            out[name] = {"error": str(exc), "steps": sampler.counters.steps}
        finally:
            sampler.close()
    return out


def _service(store: dist.Store, prefix: str, *, secret: bytes | None, run_id: str) -> PlanService:
    return PlanService(
        dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=30)),
        source=BatchSchedule(_lengths(), max_length=WORLD * CAPACITY, global_batch_tokens=TOKENS),
        planner=_planner(),
        prefix=prefix,
        secret=secret,
        run_id=run_id,
        budget=None,
    )


def _serve_cli(port: int, tmp: Path, env: dict) -> subprocess.Popen:
    np.save(tmp / "lengths.npy", _lengths())
    args = ["--host", "127.0.0.1", "--port", str(port), "--prefix", "cli-other-run"]
    args += ["--dataset", str(tmp / "lengths.npy"), "--world", str(WORLD)]
    args += ["--ranks-per-node", str(WORLD), "--capacity", str(CAPACITY)]
    args += ["--global-batch-tokens", str(2 * WORLD * CAPACITY), "--run-id", "run-A"]
    args += ["--duration", "100"]
    cmd = [sys.executable, "-m", "dyncp.service.cli", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


@pytest.mark.timeout(240)
def test_a_service_of_another_run_is_one_error_at_start_on_every_rank(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("DYNCP_RUN_ID", raising=False)
    master = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False
    )
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.warns(UserWarning, match="UNAUTHENTICATED"):
        unsigned = _service(master, "unsigned-service", secret=None, run_id="run-B")
    services = [
        _service(master, "same-run", secret=SECRET, run_id="run-B"),
        _service(master, "other-run", secret=SECRET, run_id="run-A"),
        _service(master, "service-unbound", secret=SECRET, run_id=""),
        _service(master, "readers-unbound", secret=SECRET, run_id="run-A"),
        unsigned,
        _service(master, "other-secret", secret=OTHER_SECRET, run_id="run-B"),
    ]
    # An earlier run's service announced itself at the late service's prefix and is gone.
    earlier = _service(master, "late-service", secret=SECRET, run_id="run-A")
    earlier.announce()
    late = _service(master, "late-service", secret=SECRET, run_id="run-B")

    def start_late() -> None:
        master.wait(["ready/late-service/0"], timedelta(seconds=200))
        time.sleep(LATE)
        late.start()

    cli = _serve_cli(master.port, tmp_path, {**os.environ, SECRET_ENV: SECRET.decode()})
    for service in services:
        service.start()
    starter = threading.Thread(target=start_late, daemon=True)
    starter.start()
    try:
        results = run_gloo(_readers, world=WORLD, args=(master.port,), timeout=200)
    finally:
        for service in [*services, late]:
            service.stop()
        cli.terminate()
        cli.communicate(timeout=60)
    for name, expected in EXPECTED.items():
        per_rank = [r[name] for r in results]
        if expected is None:  # every step on the service's plans, no fallback
            assert all(r.get("error") is None for r in per_rank), (name, per_rank)
            assert all(r["steps"] == r["service"] > 0 for r in per_rank), (name, per_rank)
            continue
        errors = [r.get("error") for r in per_rank]
        assert errors[0] is not None and expected in errors[0], (name, per_rank)
        assert errors == [errors[0]] * WORLD, (name, errors)  # the same line on every rank
        assert "\n" not in errors[0] and all(r["steps"] == 0 for r in per_rank), (name, per_rank)


def test_the_announcement_holds_neither_run_id_nor_secret() -> None:
    key = run_key("job")
    signer = PlanSigner(SECRET, run="run-id-0123456789")
    record = announcement(signer, key)
    assert b"run-id-0123456789" not in record and SECRET not in record
    assert verdict(signer, key, record) == RUN_OK
    # Forged: the right shape without the secret's MAC, or another run's tag re-sealed.
    assert verdict(signer, key, record.replace(record[18:26], b"00000000")) != RUN_OK
    other = announcement(PlanSigner(SECRET, run="run-id-other"), key)
    assert verdict(signer, key, other) != RUN_OK
    assert verdict(signer, key, None) != RUN_OK
    assert verdict(signer, run_key("another-job"), record) != RUN_OK  # bound to its key
