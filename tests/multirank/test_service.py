"""The plan service and its readers over a real TCPStore; 4 gloo ranks in spawned processes.

Properties asserted: readers use the published plans; whatever the service does (absent, stopped,
late, wrong), every reader of a step ends with the same plan, falls back within its deadline
(no hang) and counts why; plan digests compared over a gloo group name the rank that differs;
``python -m dyncp.service`` serves a reader from another process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from dyncp.control.signing import (
    FALLBACK,
    SECRET_ENV,
    SECRET_FILE_ENV,
    PlanSigner,
    UnauthenticatedPlansWarning,
    is_fallback,
)
from dyncp.cost_model import CostModel
from dyncp.plan import PlanError, PlanSlice
from dyncp.planner import Planner
from dyncp.sampler import BatchSchedule, DynamicCPSampler
from dyncp.service import (
    PlanClient,
    PlanMismatchError,
    PlanService,
    fallback_planner,
    plan_batch,
    plan_digest,
    step_key,
)
from dyncp.service.cli import main as serve_main
from dyncp.testing.distributed import start_ranks

WORLD, CAPACITY = 4, 1024
HANG_SECONDS = 60
SECRET = b"a-per-job-secret-of-32-bytes...."


@functools.lru_cache
def _model() -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node=WORLD)


def make_planner(**kwargs) -> Planner:
    kwargs.setdefault("cpsat", None)
    return Planner(_model(), world=WORLD, ranks_per_node=WORLD, capacity=CAPACITY, **kwargs)


class DelayedPlanner(Planner):
    """Sleeps ``delays[call % len(delays)]`` seconds before each plan (a slow solver)."""

    def __init__(self, delays: list[float]) -> None:
        super().__init__(_model(), world=WORLD, ranks_per_node=WORLD, capacity=CAPACITY, cpsat=None)
        self.delays, self.calls = delays, 0

    def plan(self, lengths, **options):
        time.sleep(self.delays[self.calls % len(self.delays)])
        self.calls += 1
        return super().plan(lengths, **options)


def make_lengths(n: int = 160, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.2, n).astype(np.int64), 1, WORLD * CAPACITY)


def make_schedule(lengths: np.ndarray, seed: int = 0) -> BatchSchedule:
    return BatchSchedule(
        lengths, max_length=WORLD * CAPACITY, seed=seed, global_batch_tokens=2 * WORLD * CAPACITY
    )


@pytest.fixture
def master():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield store


def client(master) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))


def read_all(reader: PlanClient, steps: int, pause: float = 0.0) -> list:
    out = []
    for step in range(steps):
        fetched = reader.fetch(0, step)
        plan = fetched.plan
        digest = plan.digest if isinstance(plan, PlanSlice) else plan_digest(plan)
        out.append((digest, fetched.source, fetched.reason, fetched.ready))
        time.sleep(pause)
    return out


def read_one(reader: PlanClient, step: int) -> tuple:
    fetched = reader.fetch(0, step)
    return plan_digest(fetched.plan), fetched.source, fetched.reason, fetched.ready


def wait_for_key(master, key: str) -> None:
    """Until ``key`` is in the store; fails after ``HANG_SECONDS`` (never hangs)."""
    stop = time.monotonic() + HANG_SECONDS
    while not master.check([key]):
        assert time.monotonic() < stop, f"{key} not published within {HANG_SECONDS} s"
        time.sleep(0.01)


# ------------------------------------------------------------------------------ one process


def test_readers_use_published_plans_and_old_keys_are_deleted(master) -> None:
    """Load-independent: the planners are deterministic (a wall-clock one plans differently on
    a loaded machine), and the reader, rather than sleeping a fixed time, waits (at most
    ``HANG_SECONDS``) until the service has published the next step unasked -- which only
    lookahead does -- so every plan after the first is there when asked."""
    schedule = make_schedule(make_lengths())
    steps = schedule.num_steps(0)
    with PlanService(
        client(master),
        source=schedule,
        planner=make_planner(deterministic=True),
        prefix="p",
        lookahead=2,
    ):
        reader = PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(deterministic=True),
            prefix="p",
            rank=0,
            deadline=HANG_SECONDS,
            keep_steps=2,
        )
        got = []
        for step in range(steps):
            got.append(read_one(reader, step))
            if step + 1 < steps:
                wait_for_key(master, step_key("p", 0, step + 1))
    assert [g[1] for g in got] == ["service"] * steps
    assert all(g[3] for g in got[1:]), "with lookahead the plans after the first are ready"
    for step, (digest, *_) in enumerate(got):
        ids, lengths = schedule.batch(0, step)
        assert digest == plan_digest(plan_batch(make_planner(deterministic=True), ids, lengths))
    live = [s for s in range(steps) if master.check([step_key("p", 0, s)])]
    assert live == list(range(steps - 2, steps)), "rank 0 deletes keys keep_steps behind it"


def test_without_a_service_every_reader_falls_back_to_the_same_plan(master) -> None:
    schedule = make_schedule(make_lengths(seed=1))
    steps = schedule.num_steps(0)
    results: dict[int, list] = {}
    waits: dict[int, list[float]] = {}

    def run(rank: int) -> None:
        reader = PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix="none",
            rank=rank,
            deadline=0.3,
            late_deadline=0.01,
        )
        waits[rank] = []
        poll = reader._poll

        def recorded(key: str, seconds: float) -> bytes | None:
            waits[rank].append(seconds)
            return poll(key, seconds)

        reader._poll = recorded
        results[rank] = read_all(reader, steps)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_SECONDS)
    assert sorted(results) == [0, 1, 2]
    assert results[0] == results[1] == results[2]
    assert {(g[1], g[2]) for g in results[0]} == {("fallback", "late")}
    # One full deadline, then the short one: a stopped service never stalls the loop. Counted
    # from the waits each reader asked for (a wall clock under load would measure the machine).
    for rank, asked in waits.items():
        assert asked and set(asked[1:]) <= {0.01}, (rank, asked)
    greedy = fallback_planner(make_planner(deterministic=False))
    assert results[0][0][0] == plan_digest(plan_batch(greedy, *schedule.batch(0, 0)))


def test_a_late_service_never_makes_readers_diverge(master) -> None:
    """Plans come just before, around and well after the deadline; readers start their waits at
    different times. Every step must end with one plan on every reader."""
    schedule = make_schedule(make_lengths(240, seed=2))
    steps = schedule.num_steps(0)
    planner = DelayedPlanner([0.0, 0.15, 0.5])
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        reader = PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix="late",
            rank=rank,
            deadline=0.15,
            late_deadline=0.15,
        )
        results[rank] = read_all(reader, steps, pause=0.01 * rank)

    service = PlanService(
        client(master), source=schedule, planner=planner, prefix="late", lookahead=0
    )
    with service:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_SECONDS)
    assert sorted(results) == [0, 1, 2, 3]
    for step in range(steps):
        assert len({results[r][step][0] for r in range(4)}) == 1, f"step {step} diverged"
        assert len({results[r][step][1] for r in range(4)}) == 1
    sources = {g[1] for g in results[0]}
    assert sources == {"service", "fallback"}, sources
    assert service.counters.late >= 1
    assert service.counters.published == sum(g[1] == "service" for g in results[0])


def test_a_plan_for_another_batch_is_rejected_and_counted(master) -> None:
    lengths = make_lengths(seed=3)
    schedule = make_schedule(lengths)
    store = client(master)
    wrong = plan_batch(make_planner(), *schedule.batch(0, 1)).to_json()
    store.compare_set(step_key("bad", 0, 0), "", wrong)  # step 1's plan under step 0's key
    store.compare_set(step_key("bad", 0, 1), "", "{not json")
    sampler = DynamicCPSampler(
        lengths,
        world_size=WORLD,
        rank=1,
        capacity=CAPACITY,
        planner=make_planner(),
        global_batch_tokens=2 * WORLD * CAPACITY,
        store=store,
        prefix="bad",
        deadline=0.05,
    )
    infos = []
    sampler.on_step = lambda plan, info: infos.append(info)
    list(sampler)
    assert [(i.source, i.reason) for i in infos[:2]] == [("fallback", "rejected")] * 2
    assert sampler.counters.rejected_plans == 2
    assert sampler.counters.fallbacks == sampler.counters.steps  # no service: all fall back


def test_samplers_in_store_mode_share_the_service_plans(master) -> None:
    lengths = make_lengths(200, seed=4)
    samplers = [
        DynamicCPSampler(
            lengths,
            world_size=WORLD,
            rank=r,
            capacity=CAPACITY,
            planner=make_planner(),
            global_batch_tokens=2 * WORLD * CAPACITY,
            store=client(master),
            prefix="mode",
            deadline=10.0,
        )
        for r in range(WORLD)
    ]
    per_rank = [list(s) for s in samplers]  # rank 0 runs the service; the others read its keys
    samplers[0].close()
    assert all(s.counters.service_plans == s.num_steps for s in samplers)
    where = defaultdict(set)
    for rank, mbs in enumerate(per_rank):
        for mb in mbs:
            m = mb.meta
            where[(m.step, m.wave, m.group_start, m.microbatch)].add(rank)
            assert rank in m.group_ranks
    samples = [i for mbs in per_rank for mb in mbs if mb.meta.rank_in_group == 0 for i in mb]
    assert sorted(samples) == list(range(len(lengths)))
    assert all(ranks == set(range(k[2], k[2] + len(ranks))) for k, ranks in where.items())


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("flag", "slices"), [(["--slices", "off"], False), (["--slices"], True), ([], True)]
)
def test_serve_command_runs_the_service_standalone(
    master, tmp_path: Path, flag: list[str], slices: bool
) -> None:
    """With --slices the readers of slices get the service's plans (they rejected every step);
    the default (auto) publishes slices at this world, as the readers' default reads them."""
    lengths = make_lengths(seed=5)
    np.save(tmp_path / "lengths.npy", lengths)
    cmd = [
        sys.executable,
        "-m",
        "dyncp.service.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(master.port),
        "--prefix",
        "cli",
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
        "--time-limit",
        "0.05",
        "--duration",
        str(HANG_SECONDS),
        *flag,
        *(["--prefix", f"cli-slices{len(flag)}"] if slices else []),
    ]
    prefix = f"cli-slices{len(flag)}" if slices else "cli"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        schedule = make_schedule(lengths)
        reader = PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix=prefix,
            rank=0,
            deadline=HANG_SECONDS / 2,
            slices=slices,
        )
        got = read_all(reader, schedule.num_steps(0))
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=HANG_SECONDS)
    assert [g[1] for g in got] == ["service"] * len(got), out
    assert proc.returncode == 0 and "published=" in out, out


# ------------------------------------------------------------------------------ 4 gloo ranks


def _phase(sampler: DynamicCPSampler, rank: int, stop_at: int | None = None, service=None) -> dict:
    rng = np.random.default_rng(rank)
    infos, mbs = [], []
    sampler.on_step = lambda plan, info: infos.append(info)
    for mb in sampler:
        m = mb.meta
        mbs.append([m.step, m.wave, m.group_start, m.microbatch, m.rank_in_group, list(mb)])
        time.sleep(float(rng.uniform(0, 0.004)))  # ranks run at their own pace
        if service is not None and m.step == stop_at and m.last_in_step:
            service.stop()  # the service dies mid-epoch
    sampler.close()
    return dict(
        steps=[[i.step, str(i.digest), i.source] for i in infos],
        microbatches=mbs,
        counters=dataclasses.asdict(sampler.counters),
    )


def _worker(rank: int, port: int, tmp: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=HANG_SECONDS))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=HANG_SECONDS),
    )
    group = dist.new_group(backend="gloo")
    lengths = make_lengths(300, seed=7)
    common = dict(
        world_size=WORLD,
        rank=rank,
        capacity=CAPACITY,
        global_batch_tokens=2 * WORLD * CAPACITY,
        group=group,
    )
    out = {}
    try:
        # A: rank 0 runs the service (a planner that is not deterministic: only it decides).
        out["service"] = _phase(
            DynamicCPSampler(lengths, planner=make_planner(), store=store, prefix="a", **common),
            rank,
        )
        # B: nobody serves: every rank falls back, quickly, to the same plans.
        out["no_service"] = _phase(
            DynamicCPSampler(
                lengths,
                planner=make_planner(),
                store=store,
                prefix="b",
                serve=False,
                deadline=0.2,
                late_deadline=0.01,
                **common,
            ),
            rank,
        )
        # C: the service stops after step 2 (rank 0 stops it while the others are elsewhere).
        sampler = DynamicCPSampler(
            lengths,
            planner=make_planner(),
            store=store,
            prefix="c",
            serve=False,
            deadline=0.5,
            late_deadline=0.01,
            lookahead=1,
            **common,
        )
        service = None
        if rank == 0:
            schedule = sampler.schedule
            service = PlanService(  # in the readers' form (slices by default)
                store, source=schedule, planner=make_planner(), prefix="c", slices=sampler.slices
            )
            service.start()
        out["stopped"] = _phase(sampler, rank, stop_at=2, service=service)
        # E: slices: each rank reads the header and its own slice (rank 0 serves them) ...
        out["slices"] = _phase(
            DynamicCPSampler(
                lengths, planner=make_planner(), store=store, prefix="s", slices=True, **common
            ),
            rank,
        )
        # ... and, with nobody serving, computes its slice of the same fallback plan.
        out["slices_fallback"] = _phase(
            DynamicCPSampler(
                lengths,
                planner=make_planner(),
                store=store,
                prefix="sf",
                serve=False,
                deadline=0.2,
                late_deadline=0.01,
                slices=True,
                **common,
            ),
            rank,
        )
        # D: rank 3 was given another seed: the digest check names it (one step, so that no
        # comparison is left outstanding when the error stops the ranks).
        common["global_batch_tokens"] = int(lengths.sum())
        sampler = DynamicCPSampler(
            lengths, planner=make_planner(deterministic=True), seed=int(rank == 3), **common
        )
        try:
            _phase(sampler, rank)
        except PlanMismatchError as exc:
            out["mismatch"] = dict(ranks=list(exc.ranks), message=str(exc))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.timeout(210)
def test_four_gloo_ranks_execute_identical_plans(
    master, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 4 ranks importing torch on a small machine
    ctx = start_ranks(_worker, nprocs=WORLD, args=(master.port, str(tmp_path)))
    deadline = time.monotonic() + 3 * HANG_SECONDS
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"gloo ranks did not finish in {3 * HANG_SECONDS} s")
    res = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(WORLD)]
    lengths = make_lengths(300, seed=7)
    for phase in ("service", "no_service", "stopped", "slices", "slices_fallback"):
        steps = [r[phase]["steps"] for r in res]
        assert all(s == steps[0] for s in steps), f"{phase}: ranks executed different plans"
        where = defaultdict(set)
        for rank, r in enumerate(res):
            for step, wave, start, m, index, ids in r[phase]["microbatches"]:
                assert index == rank - start
                for i in ids:
                    where[i].add((step, wave, start, m))
        assert sorted(where) == list(range(len(lengths))), phase
        assert all(len(v) == 1 for v in where.values()), f"{phase}: a sample in two micro-batches"
    sources = {
        phase: [s[2] for s in res[0][phase]["steps"]] for phase in res[0] if phase != "mismatch"
    }
    assert set(sources["service"]) == set(sources["slices"]) == {"service"}
    assert set(sources["no_service"]) == set(sources["slices_fallback"]) == {"fallback"}
    # The same fallback plans, whole or sliced: the same micro-batches on every rank.
    for r in res:
        assert r["slices_fallback"]["microbatches"] == r["no_service"]["microbatches"]
    assert "service" in sources["stopped"] and sources["stopped"][-1] == "fallback"
    for r in res:
        assert r["mismatch"]["ranks"] == [3], r["mismatch"]
        assert "ranks [3] executed a different plan" in r["mismatch"]["message"]


# ------------------------------------------------------------------------------ hostile Store


def test_bad_cursors_are_counted_and_the_service_keeps_serving(master) -> None:
    schedule = make_schedule(make_lengths())
    service = PlanService(
        client(master), source=schedule, planner=make_planner(), prefix="cur", secret=SECRET
    )
    key = service.signer.private_key("dyncp/cur/cursor")  # the key rank 0 writes, here
    with service:
        for bad in (b"abc", b"", b"1 2 3", b"-1 0", b"0 x", b"9" * 40 + b" 0"):
            master.set(key, bad)
            time.sleep(0.02)
        assert service.alive and service.counters.bad_cursors >= 1
        reader = PlanClient(client(master), **_signed_reader(schedule, "cur", HANG_SECONDS / 2))
        got = read_all(reader, 3)
    assert [g[1] for g in got] == ["service"] * 3
    assert service.counters.errors == service.counters.bad_cursors > 0
    assert "bad cursor" in service.counters.last_error


def test_signed_channel_rejects_unsigned_and_foreign_records(master) -> None:
    schedule = make_schedule(make_lengths())
    ids, lengths = schedule.batch(0, 0)
    plan = plan_batch(make_planner(policy="static", max_length=WORLD * CAPACITY), ids, lengths)
    body = plan.to_json().encode()
    real = plan_batch(make_planner(), *schedule.batch(0, 3)).to_json().encode()
    foreign = PlanSigner(b"another-secret-of-16+bytes")
    own = PlanSigner(SECRET)
    records = {
        0: body,  # unsigned
        1: foreign.seal(step_key("sig", 0, 1), body),  # another job's secret
        2: own.seal(step_key("sig", 0, 0), body),  # replayed from another key
        3: own.seal(step_key("sig", 0, 3), real),  # the real thing
    }
    for step, record in records.items():
        master.set(step_key("sig", 0, step), record)
    reader = PlanClient(
        client(master),
        source=schedule,
        planner=make_planner(),
        prefix="sig",
        rank=0,
        deadline=0.0,
        secret=SECRET,
    )
    got = [reader.fetch(0, s) for s in range(4)]
    assert [(f.source, f.reason) for f in got] == [("fallback", "rejected")] * 3 + [
        ("service", None)
    ]
    fallback = fallback_planner(make_planner())
    assert plan_digest(got[0].plan) == plan_digest(plan_batch(fallback, ids, lengths))


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_forged_cursor_far_ahead_costs_no_step(master, secret: bytes | None) -> None:
    """A Store client writes the cursor "0 60" while the readers are at step 3: the service
    follows its one writer (reader rank 0) back at the next step -- or, with a secret, never
    follows the unsigned value at all -- so no step falls back."""
    schedule = make_schedule(make_lengths(400))
    assert schedule.num_steps(0) > 10
    with PlanService(
        client(master), source=schedule, planner=make_planner(), prefix="jump", secret=secret
    ) as service:
        reader = PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix="jump",
            rank=0,
            deadline=HANG_SECONDS / 4,
            secret=secret,
        )
        got = read_all(reader, 4)
        master.set("dyncp/jump/cursor", b"0 60")
        time.sleep(0.1)  # the service reads it (and, without a secret, plans steps 60..62)
        got += [read_all_from(reader, step) for step in range(4, 10)]
    assert [g[1] for g in got] == ["service"] * 10, got
    # What the service does with the forged value itself, without racing its thread for it:
    before = service._read_cursor()
    master.set("dyncp/jump/cursor", b"0 60")
    if secret is None:
        assert service._read_cursor() == (0, 60)  # followed until rank 0 writes again
    else:  # the cursor lives at a key the forger cannot name: the value is never read
        assert service._read_cursor() == before and service.counters.bad_cursors == 0
        key = service.signer.private_key("dyncp/jump/cursor")
        master.set(key, b"0 60")  # unsigned, at the right key: refused
        assert service._read_cursor() == before and service.counters.bad_cursors == 1


def _signed_reader(schedule, prefix: str, deadline: float = HANG_SECONDS / 4) -> dict:
    """The options of a signed reader rank 0 of ``prefix``."""
    return dict(
        source=schedule,
        planner=make_planner(),
        prefix=prefix,
        rank=0,
        deadline=deadline,
        secret=SECRET,
    )


def test_a_cursor_rewritten_every_10_ms_costs_no_step_with_a_secret(master) -> None:
    """A client writes "abc" at the cursor every 10 ms while the readers run 10 steps: with a
    secret rank 0's cursor is at a key the client cannot name, so the service follows it."""
    schedule = make_schedule(make_lengths(400))
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.wait(0.01):
            master.set("dyncp/abc/cursor", b"abc")

    attacker = threading.Thread(target=rewrite, daemon=True)
    with PlanService(
        client(master), source=schedule, planner=make_planner(), prefix="abc", secret=SECRET
    ):
        attacker.start()
        reader = PlanClient(client(master), **_signed_reader(schedule, "abc"))
        try:
            got = [read_all_from(reader, step) for step in range(10)]
        finally:
            stop.set()
            attacker.join()
    assert [g[1] for g in got] == ["service"] * 10, got


def read_all_from(reader: PlanClient, step: int) -> tuple:
    fetched = reader.fetch(0, step)
    return plan_digest(fetched.plan), fetched.source, fetched.reason, fetched.ready


def test_an_empty_value_is_no_decision(master) -> None:
    """b"" written at a step key before anything else: compare_set(key, "", v) cannot tell it
    from an absent key, so it is no decision -- the first reader's fallback replaces it, and a
    plan published after that is late, never read by a second reader."""
    schedule = make_schedule(make_lengths())
    master.set(step_key("empty", 0, 0), b"")
    readers = [
        PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix="empty",
            rank=rank,
            deadline=0.0,
        )
        for rank in (0, 1)
    ]
    first = readers[0].fetch(0, 0)
    service = PlanService(
        client(master),
        source=schedule,
        planner=make_planner(policy="static", max_length=WORLD * CAPACITY),
        prefix="empty",
    )
    assert service.publish(0, 0) is False  # the register already holds the fallback
    second = readers[1].fetch(0, 0)
    assert (first.source, second.source) == ("fallback", "fallback")
    assert plan_digest(first.plan) == plan_digest(second.plan)
    assert service.counters.late == 1


def test_records_are_bound_to_their_run(master) -> None:
    """The same job (secret, prefix, keys) run twice: a signed record of the first run, replayed
    in the second, does not verify there (rejected, counted, the same fallback everywhere)."""
    schedule = make_schedule(make_lengths())
    key = step_key("runs", 0, 0)
    body = plan_batch(make_planner(), *schedule.batch(0, 0)).to_json().encode()
    earlier = PlanSigner(SECRET, run="run-1")
    master.set(key, earlier.seal(key, FALLBACK))  # what the earlier run's reader wrote
    with pytest.raises(PlanError, match="wrong signature"):
        PlanSigner(SECRET, run="run-2").open(key, earlier.seal(key, body))
    assert PlanSigner(SECRET, run="run-1").open(key, earlier.seal(key, body)) == body

    def reader(run: str) -> PlanClient:
        return PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix="runs",
            rank=1,
            deadline=0.0,
            secret=SECRET,
            run_id=run,
        )

    replayed = reader("run-2").fetch(0, 0)
    assert (replayed.source, replayed.reason) == ("fallback", "rejected")
    assert reader("run-1").fetch(0, 0).reason == "late"  # in its own run it was a decision


def test_oversized_records_are_refused_with_or_without_a_secret(master, monkeypatch) -> None:
    import dyncp.control.signing as plan_auth

    schedule = make_schedule(make_lengths())
    body = plan_batch(make_planner(), *schedule.batch(0, 0)).to_json().encode()
    monkeypatch.setattr(plan_auth, "MAX_RECORD_BYTES", len(body) - 1)
    for secret in (None, SECRET):
        key = step_key(f"big{secret is None}", 0, 0)
        master.set(key, PlanSigner(secret).seal(key, body))
        reader = PlanClient(
            client(master),
            source=schedule,
            planner=make_planner(),
            prefix=f"big{secret is None}",
            rank=1,
            deadline=0.0,
            secret=secret,
        )
        got = reader.fetch(0, 0)
        assert (got.source, got.reason) == ("fallback", "rejected")
        with pytest.raises(PlanError, match="bytes"):
            PlanSigner(secret).open(key, PlanSigner(secret).seal(key, body))


def test_a_bad_cursor_rewritten_every_few_ms_logs_one_line(master, caplog) -> None:
    schedule = make_schedule(make_lengths())
    with (
        caplog.at_level("WARNING", logger="dyncp.service"),
        PlanService(
            client(master), source=schedule, planner=make_planner(), prefix="noisy", secret=None
        ) as service,
    ):
        for _ in range(100):
            master.set("dyncp/noisy/cursor", b"abc")
            time.sleep(0.005)
        time.sleep(0.05)
    assert service.alive is False and service.counters.bad_cursors >= 10
    lines = [r for r in caplog.records if "ignoring cursor" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


@pytest.mark.timeout(150)
def test_without_a_secret_the_channel_warns_once(monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with pytest.warns(UnauthenticatedPlansWarning, match="UNAUTHENTICATED"):
        assert not PlanSigner.from_env().authenticated
    # In a process (default warning filters): once, however many readers and services start.
    code = "from dyncp.control.signing import PlanSigner\nfor _ in range(3): PlanSigner.from_env()"
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 0 and run.stderr.count("UNAUTHENTICATED") == 1, run.stderr
    env[SECRET_ENV] = SECRET.decode()
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 0 and "UNAUTHENTICATED" not in run.stderr, run.stderr


def test_secret_from_a_file_and_too_short_secrets(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    signer = PlanSigner.from_env()
    assert signer.open("k", PlanSigner(SECRET).seal("k", b"x")) == b"x"
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the plan secret"):
        PlanSigner.from_env()
    with pytest.raises(ValueError, match="at least 16"):
        PlanSigner(b"short")


def test_fallback_records_may_carry_a_signed_suffix() -> None:
    own = PlanSigner(SECRET)
    record = own.seal("k", FALLBACK + b" v3")
    assert is_fallback(own.open("k", record)) and own.open("k", record).endswith(b" v3")
    with pytest.raises(PlanError, match="wrong signature"):
        own.open("k", record.replace(b"v3", b"v4"))


# ------------------------------------------------------------------------------ serve CLI


def _serve(*args: str) -> list[str]:
    base = ["--host", "127.0.0.1", "--world", str(WORLD), "--ranks-per-node", str(WORLD)]
    base += ["--capacity", str(CAPACITY), "--global-batch-size", "8"]
    return [*base, *args]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--dataset", "/nonexistent/x.npy"], "no such file"),
        (["--profile", "no-such-profile"], "profile"),
        (["--lookahead", "-1"], "--lookahead"),
        (["--time-limit", "0"], "--time-limit"),
        (["--world", "12", "--ranks-per-node", "8"], "whole number of nodes"),
        (["--port", "1", "--connect-timeout", "0.5"], "cannot reach the job's TCPStore"),
        (["--port", "70000"], "--port: expected an integer in [1, 65535]"),
        (["--connect-timeout", "1e308"], "--connect-timeout: expected seconds > 0 and at most"),
        (["--time-limit", "inf"], "--time-limit"),
        (["--budget-share", "1.5"], "StepBudget.share must be in (0, 1], got 1.5"),
        (["--budget-cap", "0.05"], "StepBudget.cap (0.05) must be >= floor (0.1)"),
    ],
)
def test_serve_startup_errors_are_one_line(
    args: list[str], expected: str, tmp_path: Path, capsys
) -> None:
    np.save(tmp_path / "lengths.npy", make_lengths())
    dataset = ["--dataset", str(tmp_path / "lengths.npy")]
    full = _serve(*dataset, "--port", "9", "--connect-timeout", "0.5", *args)
    try:
        status = serve_main(full)
    except SystemExit as exc:  # an option error, from argparse
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("dyncp.service.cli: error: "), err
    assert expected in err[0], err


def test_serve_with_a_secret_needs_a_run_id(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DYNCP_PLAN_SECRET", SECRET.decode())
    monkeypatch.delenv("DYNCP_RUN_ID", raising=False)
    np.save(tmp_path / "lengths.npy", make_lengths())
    status = serve_main(_serve("--dataset", str(tmp_path / "lengths.npy"), "--port", "9"))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "plans are signed but no --run-id (or $DYNCP_RUN_ID) is given" in err[0], err


def test_serve_overlong_sample_is_one_line(tmp_path: Path, capsys) -> None:
    np.save(tmp_path / "lengths.npy", np.array([5, WORLD * CAPACITY * 2]))
    status = serve_main(_serve("--dataset", str(tmp_path / "lengths.npy"), "--port", "9"))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "longer than" in err[0], err


@pytest.mark.timeout(120)
def test_serve_exits_nonzero_when_its_store_dies(tmp_path: Path) -> None:
    """One line on stderr, nothing else (torch's client logs a dozen lines when its Store dies;
    signed, so that no unauthenticated-channel warning is printed at start)."""
    np.save(tmp_path / "lengths.npy", make_lengths())
    env = {**os.environ, "DYNCP_PLAN_SECRET": SECRET.decode(), "DYNCP_RUN_ID": "run-1"}
    store_proc = subprocess.Popen(
        [sys.executable, "-c", _MASTER], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(store_proc.stdout.readline())
        args = _serve("--dataset", str(tmp_path / "lengths.npy"), "--port", str(port))
        serve = subprocess.Popen(
            [sys.executable, "-m", "dyncp.service.cli", *args, "--connect-timeout", "5"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert "dyncp.service.cli:" in serve.stdout.readline()  # serving
        store_proc.kill()
        store_proc.wait()
        _, err = serve.communicate(timeout=HANG_SECONDS)
    finally:
        store_proc.kill()
    assert serve.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error: stopped serving" in lines[0], err


_MASTER = """
import datetime, time, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                  wait_for_workers=False)
print(s.port, flush=True)
time.sleep(120)
"""


def _silent_port() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers (not a TCPStore)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()[1]


def _serve_process(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    np.save(tmp_path / "lengths.npy", make_lengths())
    args = _serve("--dataset", str(tmp_path / "lengths.npy"), "--port", str(port), *extra)
    return subprocess.Popen(
        [sys.executable, "-m", "dyncp.service.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("silent", [True, False])
def test_serve_gives_up_on_a_store_that_never_answers_in_one_line(
    tmp_path: Path, silent: bool
) -> None:
    """A port that accepts and never answers, or one where nothing listens: exit 2 within the
    connect timeout, and stderr is one line (torch's connection warnings held back)."""
    sock, port = _silent_port() if silent else (None, 1)
    try:
        serve = _serve_process(tmp_path, port, "--connect-timeout", "1")
        _, err = serve.communicate(timeout=HANG_SECONDS)
    finally:
        if sock is not None:
            sock.close()
    assert serve.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dyncp.service.cli: error: cannot reach"), err
    if silent:
        assert "does not answer like a TCPStore" in lines[0]


@pytest.mark.timeout(120)
def test_serve_stops_on_sigint_while_connecting(tmp_path: Path) -> None:
    sock, port = _silent_port()
    try:
        serve = _serve_process(tmp_path, port, "--connect-timeout", "600")
        sock.settimeout(HANG_SECONDS)
        conn, _ = sock.accept()  # serve is connecting now
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=HANG_SECONDS / 2)
        conn.close()
    finally:
        sock.close()
    assert serve.returncode == 130, err
    assert err.strip().splitlines() == ["dyncp.service.cli: interrupted before serving"], err
