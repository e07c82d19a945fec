"""Chaos suite: 4 gloo ranks, one rank misbehaves, every rank ends in bounded time.

One spawn of 4 processes runs the scenarios in turn, each on a fresh process group whose timeout
is T seconds (so a hang costs seconds, not minutes). Properties asserted:

- execute (dataflow: no barrier between waves) and the gradient reduction after it: whatever
  one rank does -- raise in ``step_fn``, hang in it, skip ``execute``, run another plan, stall
  1.1 T inside a ring and resume, get SIGKILLed inside a ring -- every other rank raises within
  2 T, in ``execute`` if one of its groups holds that rank, else at the reduction (``pool=``),
  and the error names that rank alone, never a healthy one (and its exception where it raised
  one); the groups use the job's timeout (T) without being told. In "raise" and "hang" two
  ranks are in a later wave's ring when the failure happens. Forged, garbled and out-of-range
  failure reports written by a Store client are ignored.
- sampler under DataLoader-like prefetch (4 micro-batches pulled ahead of training, ring and
  gradient collectives per step): with ``agree_ahead=0`` the per-step comparison waits for a
  rank whose training waits for this one, and every rank fails within 2 T; with
  ``agree_ahead=5`` training runs through and every sample is trained exactly once.
- sampler over a plan service: values written into the Store by someone else (a forged
  unsigned plan, non-object JSON, 1e999, deep nesting, garbage cursors, an overwrite or a
  deletion after rank 0 read the key) end in a consistent fallback on every rank with
  exactly-once intact, or in a PlanMismatchError on every rank in that very step, naming the
  ranks and both digests.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dyncp.control.agreement import PlanAgreementError, PlanMismatchError
from dyncp.control.signing import PlanSigner
from dyncp.cost_model import CostModel
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave
from dyncp.planner import Planner
from dyncp.runtime import GroupPool, StepFailed, execute, reduce_loss
from dyncp.sampler import BatchSchedule, DynamicCPSampler
from dyncp.service import plan_batch, slice_key, step_key
from dyncp.testing.distributed import CountingStore, start_ranks

WORLD, CAPACITY = 4, 1024
T = 1.5  # the job's process-group timeout in every scenario
SECRET = b"0123456789abcdef-test-secret"
SLACK = 0.75  # seconds for process scheduling on a loaded 2-core machine


# ---------------------------------------------------------------------------------- helpers


@functools.lru_cache
def _model() -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node=WORLD)


def make_planner(**kwargs) -> Planner:
    kwargs.setdefault("cpsat", None)
    return Planner(_model(), world=WORLD, ranks_per_node=WORLD, capacity=CAPACITY, **kwargs)


def make_lengths() -> np.ndarray:
    rng = np.random.default_rng(11)
    return np.clip(rng.lognormal(5.5, 1.2, 120).astype(np.int64), 1, WORLD * CAPACITY)


def make_schedule() -> BatchSchedule:
    return BatchSchedule(
        make_lengths(), max_length=WORLD * CAPACITY, global_batch_tokens=2 * WORLD * CAPACITY
    )


def hand_plan(extra: int = 0) -> StepPlan:
    """A ring of 4, then a ring of 2 beside two single ranks, then two rings of 2."""
    mb = MicroBatch
    waves = (
        Wave((Group(0, 4, (mb((1,)),)),)),
        Wave((Group(0, 2, (mb((3,)),)), Group(2, 1, (mb((0,)),)), Group(3, 1, (mb((2,)),)))),
        Wave((Group(0, 2, (mb((4,)),)), Group(2, 2, (mb((5,)),)))),
    )
    return StepPlan(Topology(WORLD, 2, 256), (37, 150, 9, 64 + extra, 20, 30), waves)


def _release(store: dist.Store) -> None:
    store.add("released", 1)


def _held(store: dist.Store, limit: float) -> None:
    """Block (a hung rank) until every other rank is done with the step, at most ``limit``
    seconds: released by the first one alone, it could report before a slower survivor (on a
    loaded machine) has named it, and be taken for alive."""
    end = time.monotonic() + limit
    while store.add("released", 0) < WORLD - 1 and time.monotonic() < end:
        time.sleep(0.05)


# ---------------------------------------------------------------------------------- execute


def _forge_board(pool: GroupPool) -> None:
    """What any Store client can write at the board's predictable keys before a call: unsigned
    reports blaming rank 1, garbage, a position beyond the axis, and report-counter bumps."""
    for wave in (-1, 0, 1, 2, 3):  # 3: the gradient reduction's slot
        pool.store.set(f"c0/w{wave}/r1", f"raised 0 {time.time():.6f} {time.time():.6f} forged")
        pool.store.set(f"c0/w{wave}/r2", b"\xff\x00 not a report")
        pool.store.set(f"c0/w{wave}/r99", "raised 0 1.0 1.0 position 99")
    pool.store.add("c0/n", 7)


def _hostile_board(pool: GroupPool, stop: threading.Event) -> None:
    """What any Store client can do to the reports while a step fails: poison the old report
    counter, then overwrite and delete, over and over, whatever sits at the keys where reports
    of call 0 used to live (``c0/w<w>/r<p>``), until the scenario ends."""
    pool.store.set("c0/n", "abc")
    keys = [f"c0/w{w}/r{p}" for w in (-1, 0, 1, 2, 3) for p in range(WORLD)]
    i = 0
    while not stop.is_set():
        for key in keys:
            if i % 2:
                pool.store.delete_key(key)
            else:
                pool.store.set(key, b"raised 0 1.0 1.0 overwritten")
        i += 1
        stop.wait(0.002)


def _execute(rank: int, store: dist.Store, fault: str, culprit: int) -> dict:
    pool = GroupPool()  # no timeout given: the job's (T)
    plan = hand_plan(extra=1 if fault == "other-plan" and rank == culprit else 0)
    if fault == "forged-board":
        if rank == 0:
            _forge_board(pool)
        dist.barrier()
    hostile = threading.Event()
    if fault in HOSTILE and rank == 0:
        threading.Thread(target=_hostile_board, args=(pool, hostile), daemon=True).start()

    def step_fn(ctx) -> None:
        if rank == culprit and ctx.step_wave == 0:
            if fault == "raise-hostile":
                raise ValueError("boom while a Store client rewrites the reports")
            if fault == "kill-mid-ring":
                os.kill(os.getpid(), signal.SIGKILL)  # inside the ring of 4, before its collective
            if fault == "stall":
                time.sleep(STALL * T)  # then it resumes and finds its ring peers gone
        if rank == culprit and ctx.step_wave == 1:
            if fault == "raise":
                raise ValueError("boom from rank's step_fn")
            if fault == "hang":
                _held(store, 6 * T)
            if fault == "forged-board":
                raise ValueError("boom beside forged reports blaming rank 1")
        if ctx.cp > 1:
            dist.all_reduce(torch.ones(1), group=ctx.layout.group)

    start = time.monotonic()
    outcome: dict = {"timeout": pool.timeout}
    try:
        if fault == "skip" and rank == culprit:
            _held(store, 6 * T)  # never calls execute for this step
            outcome.update(kind="skipped")
        else:
            execute(plan, pool, step_fn)
            # Dataflow: no barrier between waves; ranks whose groups never touched the failed
            # rank meet it here, at the step's reduction, which names it.
            reduce_loss([torch.zeros(())], pool=pool)
            outcome.update(kind="ok")
    except (StepFailed, PlanMismatchError) as exc:
        outcome.update(kind=type(exc).__name__, message=str(exc), ranks=list(exc.ranks))
    outcome["seconds"] = time.monotonic() - start
    if rank != culprit:
        _release(store)
    hostile.set()
    return outcome


def _scenario_store(tmp: str, name: str) -> dist.Store:
    return dist.FileStore(f"{tmp}/{name}.side", WORLD)


#: "kill-mid-ring" last: rank 2 is gone after it. "forged-board": rank 3 raises while forged
#: reports blame rank 1. In the HOSTILE ones a Store client rewrites and deletes report keys and
#: poisons the old report counter while rank 2 raises or is SIGKILLed.
EXECUTE_FAULTS = [
    "raise",
    "hang",
    "skip",
    "other-plan",
    "stall",
    "forged-board",
    "raise-hostile",
    "kill-mid-ring",
]
HOSTILE = ("raise-hostile", "kill-mid-ring")
CULPRIT = {
    "raise-hostile": 2,
    "raise": 1,
    "hang": 1,
    "skip": 2,
    "other-plan": 3,
    "stall": 1,
    "forged-board": 3,
    "kill-mid-ring": 2,
}
STALL = 1.1  # the stalled rank sleeps this many T inside the ring, then resumes


# ---------------------------------------------------------------------------------- sampler


def _sampler_run(
    rank: int,
    port: int,
    prefix: str,
    wrap_fetch=None,
    wrap_rank: int = 0,
    state: dict | None = None,
    steps_log: bool = False,
    **kwargs,
) -> dict:
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    digests: list[list] = []
    sampler = DynamicCPSampler(  # the plan agreement is on by default, on its own group
        make_lengths(),
        world_size=WORLD,
        rank=rank,
        capacity=CAPACITY,
        planner=kwargs.pop("planner", None) or make_planner(),
        global_batch_tokens=2 * WORLD * CAPACITY,
        store=store,
        prefix=prefix,
        deadline=0.5,
        late_deadline=0.05,
        secret=kwargs.pop("secret", None),
        on_step=_recording(digests, kwargs.pop("on_step", None)),
        **kwargs,
    )
    if wrap_fetch is not None and rank == wrap_rank:
        client = sampler._source.client
        client.fetch = wrap_fetch(client.fetch)
    if state is not None:
        sampler.load_state_dict(state)
    samples, out = [], {}
    by_step: dict[int, list[int]] = {}
    start = time.monotonic()
    try:
        for mb in sampler:
            if mb.meta.rank_in_group == 0:
                samples.extend(mb)
                by_step.setdefault(mb.meta.step, []).extend(int(i) for i in mb)
    except PlanMismatchError as exc:
        out.update(error=str(exc), ranks=list(exc.ranks), step=sampler.counters.steps)
    except Exception as exc:  # any other end: recorded, so that every rank's end is compared
        out.update(error=f"{type(exc).__name__}: {exc}", ranks=None, step=sampler.counters.steps)
    if steps_log:
        out["steps"] = sorted(by_step.items())
        out["state"] = sampler.state_dict()
    out["seconds"] = time.monotonic() - start
    service = sampler._source.service
    if service is not None:
        out["service_alive"] = service.alive
        counters = service.counters
        out["service"] = {
            "bad_cursors": counters.bad_cursors,
            "errors": counters.errors,
            "planned": counters.published + counters.late,
        }
    sampler.close()
    c = sampler.counters
    out["samples"] = [int(i) for i in samples]
    out["digests"] = digests
    out["counters"] = dict(
        steps=c.steps, fallbacks=c.fallbacks, rejected=c.rejected_plans, service=c.service_plans
    )
    return out


def _recording(digests: list, on_step=None):
    """An ``on_step`` that records (step, source, reason, digest) and calls ``on_step``."""

    def record(plan, info) -> None:
        digests.append([info.step, info.source, info.reason, info.digest])
        if on_step is not None:
            on_step(plan, info)

    return record


def _tamper_after_rank0(rank: int, port: int, action: str) -> dict:
    """Rank 0 reads step 2's plan; then a hostile client overwrites (a plain ``set``) or
    deletes the key before the others read it.

    The service plans with the static policy, so its plan differs from the greedy fallback.
    """
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    key = step_key(action, 0, 2)

    def on_step(plan, info) -> None:
        if rank != 0 and info.step == 1:  # the others read step 2 only after the tampering
            store.wait([f"{action}/done"], datetime.timedelta(seconds=30))

    def attack_after(fetch):
        def fetch_then_tamper(epoch: int, step: int):
            fetched = fetch(epoch, step)
            if step == 2:
                if action == "overwrite":
                    store.set(key, b"[]")
                else:
                    store.delete_key(key)
                store.set(f"{action}/done", "1")
            return fetched

        return fetch_then_tamper

    return _sampler_run(
        rank,
        port,
        action,
        secret=SECRET,
        on_step=on_step,
        wrap_fetch=attack_after,
        planner=make_planner(policy="static", max_length=WORLD * CAPACITY),
        slices=False,  # the whole-plan path (the default is slices: bad-slices covers those)
    )


NODE = 2  # ranks per node of the sliced scenario: spans {0, 1} and {2, 3}, one record each
SLICELESS = (2, 3)  # the span whose record of step 1 is deleted before its ranks read it
TIED = (0, 1)  # the span whose record of step 2 is truncated (half the ranks: a tie)
PADDED = (2, 3)  # the span whose record of step 3 is padded


def _node_planner() -> Planner:
    model = CostModel.load("h100-reference", ranks_per_node=NODE)
    return Planner(model, world=WORLD, ranks_per_node=NODE, capacity=CAPACITY, cpsat=None)


def _unusable_log() -> list[str]:
    """The sampler's warnings (where a fallback over unusable slices is said)."""
    import logging

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("dyncp.sampler.sampler").addHandler(handler)
    return messages


def _bad_slices(rank: int, port: int) -> dict:
    """Plans travel as slices (one record per node of NODE ranks), with the job's secret. A
    Store client deletes the record of span SLICELESS of step 1, truncates that of span TIED of
    step 2 and pads that of span PADDED of step 3. Every rank runs the same fallback plan in
    steps 1-3, the slice errors named on every rank, and nobody else is blamed."""
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    prefix = "bad-slices"
    messages = _unusable_log()

    def tamper_first(fetch):
        def fetch_after_tampering(epoch: int, step: int):
            if step in (1, 2, 3):
                key = step_key(prefix, epoch, step)
                store.wait([key], datetime.timedelta(seconds=30))
                span = slice_key(key, {1: SLICELESS, 2: TIED, 3: PADDED}[step][0] // NODE)
                if step == 1:
                    store.delete_key(span)
                elif step == 2:
                    store.set(span, store.get(span)[:-7])
                else:
                    store.set(span, store.get(span) + b" ")
                store.set(f"{prefix}/{step}", "1")
            return fetch(epoch, step)

        return fetch_after_tampering

    def on_step(plan, info) -> None:  # the others read step s + 1 after the tampering
        if info.step in (0, 1, 2) and rank != SLICELESS[0]:
            store.wait([f"{prefix}/{info.step + 1}"], datetime.timedelta(seconds=30))

    out = _sampler_run(
        rank,
        port,
        prefix,
        secret=SECRET,
        slices=True,
        planner=_node_planner(),
        wrap_fetch=tamper_first,
        wrap_rank=SLICELESS[0],
        on_step=on_step,
        steps_log=True,
    )
    out["unusable"] = [m for m in messages if "cannot run its part" in m]
    return out


def _slice_restart(rank: int, port: int) -> dict:
    """Plans travel as slices under a fixed run id. The sampler reads every step of the epoch
    (as a prefetching DataLoader does) while training checkpoints at the end of step 0; the job
    restarts from that checkpoint with the same Store and run id and runs steps 1.. again."""
    kwargs = dict(secret=SECRET, slices=True, run_id="restart-run", steps_log=True)
    first = _sampler_run(rank, port, "slice-restart", **kwargs)
    state = dict(first.pop("state"), step=1, offset=0)  # the checkpoint: the end of step 0
    state.pop("plan", None)
    second = _sampler_run(rank, port, "slice-restart", state=state, **kwargs)
    return {
        "first": [i for step, ids in first["steps"] if step == 0 for i in ids],
        "resumed": second,
        "first_error": first.get("error"),
    }


PREFETCH = 4  # micro-batches a DataLoader (prefetch_factor x num_workers) holds ahead


def _prefetching_training(rank: int, agree_ahead: int) -> dict:
    """A training loop that pulls PREFETCH micro-batches ahead of the one it trains, runs a ring
    collective per micro-batch and a gradient all_reduce per step."""
    pool = GroupPool()
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(5.0, 1.5, 200).astype(np.int64), 1, WORLD * 256)
    planner = Planner(
        _model(), world=WORLD, ranks_per_node=WORLD, capacity=256, deterministic=True, cpsat=None
    )
    sampler = DynamicCPSampler(
        lengths,
        world_size=WORLD,
        rank=rank,
        capacity=256,
        planner=planner,
        global_batch_tokens=2 * WORLD * 256,
        agree_ahead=agree_ahead,
    )
    it, queue, samples = iter(sampler), deque(), []
    out: dict = {"kind": "ok"}
    progress = [time.monotonic()]  # when this rank last got anything done: the wait starts there

    def fill() -> None:
        while len(queue) < PREFETCH:
            try:
                queue.append(next(it))
            except StopIteration:
                return
            progress[0] = time.monotonic()

    try:
        fill()
        while queue:
            mb = queue.popleft()
            fill()
            m = mb.meta
            if m.cp > 1:
                dist.all_reduce(torch.ones(1), group=pool.group(m.group_start, m.group_size))
            if m.rank_in_group == 0:
                samples.extend(mb)
            if m.last_in_step:
                dist.all_reduce(torch.ones(1))  # the gradient reduction
            progress[0] = time.monotonic()
    except (PlanAgreementError, RuntimeError) as exc:
        out.update(kind=type(exc).__name__, message=str(exc).splitlines()[0])
    # Seconds from the last progress to the end: how long a rank waited before it raised.
    out.update(seconds=time.monotonic() - progress[0], samples=[int(i) for i in samples])
    out["num_samples"] = len(lengths)
    return out


def _healthy_counted(rank: int) -> dict:
    """A healthy step in which three ranks wait 0.3 s inside a ring for the fourth, counted at
    the seams: Store requests the pool makes, and collectives on the control group."""
    store = CountingStore(dist.distributed_c10d._get_default_store())
    pool = GroupPool(store=store)
    control: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "barrier")}

    def counting(name):
        def call(*args, **kwargs):
            if kwargs.get("group") is pool.control_group:
                control.append(name)
            return originals[name](*args, **kwargs)

        return call

    def step_fn(ctx) -> None:
        if rank == 3 and ctx.step_wave == 0:
            time.sleep(0.3)  # the others wait for it inside the ring's collective
        if ctx.cp > 1:
            dist.all_reduce(torch.ones(1), group=ctx.layout.group)

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        store.requests = 0
        execute(hand_plan(), pool, step_fn)
        agreed = (list(control), store.requests)
        control.clear()
        execute(hand_plan(), pool, step_fn, agree=False)  # compared already this step
        skipped = (list(control), store.requests)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"agreed": agreed, "skipped": skipped}


ABSENT = 2  # the rank whose training loop never asks its sampler for a micro-batch


def _sampler_absent(rank: int, store: dist.Store) -> dict:
    """Every rank builds its sampler (agreement on by default); rank ABSENT never iterates it:
    the others' agreement on step 0 times out and names it."""
    sampler = DynamicCPSampler(
        make_lengths(),
        world_size=WORLD,
        rank=rank,
        capacity=CAPACITY,
        planner=make_planner(deterministic=True),
        global_batch_tokens=2 * WORLD * CAPACITY,
    )
    out: dict = {"kind": "ok", "agreement": sampler.agreement is not None}
    start = time.monotonic()
    try:
        if rank == ABSENT:
            _held(store, 6 * T)
        else:
            for _ in sampler:
                pass
    except PlanAgreementError as exc:
        out.update(kind=type(exc).__name__, message=str(exc), ranks=list(exc.ranks))
    out["seconds"] = time.monotonic() - start
    if rank != ABSENT:
        _release(store)
    sampler.close()
    return out


# ---------------------------------------------------------------------------------- the spawn


def _chaos(rank: int, tmp: str, port: int) -> None:
    torch.set_num_threads(1)
    path = Path(tmp, f"rank{rank}.json")
    results: dict = {}

    def scenario(name: str, fn, *args, **kwargs) -> None:
        # Line the ranks up first (a loaded machine starts and ends them seconds apart): the
        # process group's rendezvous and connections must fit in its timeout T.
        lineup = dist.FileStore(f"{tmp}/{name}.lineup", WORLD)
        lineup.add("here", 1)
        end = time.monotonic() + 60
        while lineup.add("here", 0) < WORLD and time.monotonic() < end:
            time.sleep(0.01)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/{name}.pg",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=T),
        )
        try:
            results[name] = fn(*args, **kwargs)
        except BaseException:
            results[name] = {"kind": "crash", "message": traceback.format_exc()}
        finally:
            dist.destroy_process_group()
        path.write_text(json.dumps(results))  # kept if a later scenario ends this process

    scenario("forged", _sampler_run, rank, port, "forged", secret=SECRET)
    scenario("garbage", _sampler_run, rank, port, "garbage")
    scenario("overwrite", _tamper_after_rank0, rank, port, "overwrite")
    scenario("delete", _tamper_after_rank0, rank, port, "delete")
    scenario("bad-slices", _bad_slices, rank, port)
    scenario("slice-restart", _slice_restart, rank, port)
    scenario("prefetch-ahead", _prefetching_training, rank, PREFETCH + 1)
    scenario("prefetch-at-boundary", _prefetching_training, rank, 0)
    scenario("sampler-absent", _sampler_absent, rank, _scenario_store(tmp, "sampler-absent"))
    scenario("healthy-counted", _healthy_counted, rank)
    for fault in EXECUTE_FAULTS:
        store = _scenario_store(tmp, fault)
        scenario(fault, _execute, rank, store, fault, CULPRIT[fault])


def _attack(master: dist.TCPStore, stop: threading.Event) -> None:
    """Pre-write forged values at step keys, and garbage cursors for as long as the run lasts."""
    schedule = make_schedule()
    ids, lengths = schedule.batch(0, 1)
    real = plan_batch(make_planner(deterministic=True), ids, lengths).to_json().encode()
    master.set(step_key("forged", 0, 1), real)  # a valid plan of the batch, but unsigned
    other_job = PlanSigner(b"another-job-secret-123")
    master.set(step_key("forged", 0, 2), other_job.seal(step_key("forged", 0, 2), real))
    master.set(step_key("garbage", 0, 1), b"[]")
    master.set(step_key("garbage", 0, 2), b'{"schema_version": 1, "lengths": 1e999}')
    master.set(step_key("garbage", 0, 3), b"[" * 100_000 + b"]" * 100_000)
    master.set(step_key("garbage", 0, 4), b'"x"')
    bad = [b"abc", b"", b"1 2 3", b"-1 0", b"99999999999999999999999 0"]
    i = 0
    while not stop.is_set():
        master.set("dyncp/garbage/cursor", bad[i % len(bad)])
        i += 1
        stop.wait(0.003)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("chaos")
    master = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    stop = threading.Event()
    attacker = threading.Thread(target=_attack, args=(master, stop), daemon=True)
    attacker.start()
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = start_ranks(_chaos, nprocs=WORLD, args=(str(tmp), master.port))
    deadline = time.monotonic() + 120
    try:  # not ctx.join(): it would terminate the others when rank 2 is killed, by design
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                pytest.fail("the chaos ranks did not finish in 120 s")
            time.sleep(0.2)
    finally:
        stop.set()
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]


# ---------------------------------------------------------------------------------- assertions


def _exactly_once(runs: list[dict]) -> None:
    samples = [i for r in runs for i in r["samples"]]  # each micro-batch once, from its first rank
    assert sorted(samples) == list(range(len(make_lengths()))), "exactly-once broken"


@pytest.mark.timeout(180)
def test_forged_and_garbage_plans_fall_back_consistently(chaos: list[dict]) -> None:
    forged = [r["forged"] for r in chaos]
    garbage = [r["garbage"] for r in chaos]
    for runs, rejected in ((forged, 2), (garbage, 4)):
        assert all("error" not in r for r in runs), runs
        _exactly_once(runs)
        assert {r["counters"]["rejected"] for r in runs} == {rejected}
        assert len({json.dumps(r["counters"]) for r in runs}) == 1  # same decisions everywhere
    # The garbage cursors were counted, and the service kept planning through them (whether a
    # reader used a plan in time or fell back depends on the machine's load, not on the cursors).
    assert garbage[0]["service"]["bad_cursors"] > 0
    assert garbage[0]["service_alive"] and garbage[0]["service"]["planned"] > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("action", ["overwrite", "delete"])
def test_tampering_after_rank0_read_raises_in_that_step(chaos: list[dict], action: str) -> None:
    runs = [r[action] for r in chaos]
    for r in runs:
        assert r["ranks"] == [0], r
        assert "epoch 0 step 2" in r["error"] and " vs " in r["error"], r["error"]
        assert r["step"] == 2  # steps 0 and 1 ran; the error came before step 2 yielded
    assert len({r["error"] for r in runs}) == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", [f for f in EXECUTE_FAULTS if f != "forged-board"])
def test_every_rank_raises_in_bounded_time_naming_the_culprit(
    chaos: list[dict], fault: str
) -> None:
    culprit = CULPRIT[fault]
    for rank, r in enumerate(chaos):
        if rank == culprit and fault not in ("raise", "stall", "raise-hostile"):
            continue
        got = r[fault]
        assert got["timeout"] == T  # the job's timeout, not torch's 30 minutes
        expected = "PlanMismatchError" if fault == "other-plan" else "StepFailed"
        assert got["kind"] == expected, got
        assert got["ranks"] == [culprit], got  # the culprit alone: never a healthy rank
        assert got["seconds"] <= 2 * T + SLACK, got
        if fault == "raise":
            assert f"rank {culprit} failed in wave 1: ValueError: boom" in got["message"]
        elif fault == "raise-hostile":
            assert f"rank {culprit} failed in wave 0: ValueError: boom" in got["message"]
        elif fault == "other-plan":
            assert " vs " in got["message"]
        elif fault == "stall":  # it resumed and reported, but after the others' timeout fired
            assert f"rank(s) [{culprit}] arrived after the others had timed out" in got["message"]
        else:  # hang, skip, and a SIGKILL inside a ring, whose ring peers see it at once
            assert f"rank(s) [{culprit}] stopped responding" in got["message"], got


@pytest.mark.timeout(180)
def test_forged_board_records_are_ignored(chaos: list[dict]) -> None:
    """Unsigned reports blaming rank 1, garbage and a position beyond the axis, written at the
    board's keys before the call, with the report counter bumped; then rank 3 raises in wave 1.
    Every rank names rank 3: its ring peer in wave 2, and ranks 0 and 1 at the reduction."""
    for r in (r["forged-board"] for r in chaos):
        assert r["kind"] == "StepFailed" and r["ranks"] == [3], r
        assert "rank 3 failed in wave 1: ValueError: boom beside forged" in r["message"], r
        assert r["seconds"] <= 2 * T + SLACK, r


def _same_end(runs: list[dict]) -> None:
    """Every rank ran the same plan in every step (same sources and digests), or ended with
    the same error."""
    assert len({json.dumps(r["digests"]) for r in runs}) == 1, [r["digests"] for r in runs]
    assert len({r.get("error") for r in runs}) == 1, [r.get("error") for r in runs]


@pytest.mark.timeout(180)
def test_a_bad_slice_makes_every_rank_fall_back_alike_naming_it(chaos: list[dict]) -> None:
    """Finding 4 (a deleted, truncated or padded slice) and 5 (a tie: half the ranks' slices
    forged): every rank runs the same fallback plan in that step, no sample is lost, the slice
    error names exactly the ranks whose slices were bad, on every rank."""
    runs = [r["bad-slices"] for r in chaos]
    assert all(r.get("error") is None for r in runs), runs
    _same_end(runs)
    _exactly_once(runs)
    by_step = {s: (src, why) for s, src, why, _ in runs[0]["digests"]}
    assert by_step[1] == by_step[2] == by_step[3] == ("fallback", "rejected"), by_step
    for r in runs:
        said = r["unusable"]
        assert len(said) == 3, said
        for message, span, why in zip(
            said, (SLICELESS, TIED, PADDED), ("missing", "malformed", "malformed")
        ):
            assert f"{len(span)} cannot run its part (rank {span[0]}: " in message, said
            assert all(f"rank {p}: its slice is {why}" in message for p in span), said
            others = [p for p in range(WORLD) if p not in span]
            assert not any(f"rank {p}:" in message for p in others), said


@pytest.mark.timeout(180)
def test_a_restart_with_slices_resumes_from_its_checkpoint(chaos: list[dict]) -> None:
    """Finding 1: every slice was read before the checkpoint (end of step 0) was taken; the
    restarted job runs steps 1.. on the same plans on every rank and trains each sample once."""
    runs = [r["slice-restart"] for r in chaos]
    assert all(r["first_error"] is None for r in runs), runs
    resumed = [r["resumed"] for r in runs]
    assert all(r.get("error") is None for r in resumed), resumed
    _same_end(resumed)
    assert resumed[0]["digests"][0][0] == 1  # it resumed at step 1
    samples = [i for r in runs for i in r["first"]] + [i for r in resumed for i in r["samples"]]
    assert sorted(samples) == list(range(len(make_lengths()))), "exactly-once broken"


@pytest.mark.timeout(180)
def test_prefetching_needs_agree_ahead_and_never_hangs(chaos: list[dict]) -> None:
    ahead = [r["prefetch-ahead"] for r in chaos]
    assert all(r["kind"] == "ok" for r in ahead), ahead
    samples = sorted(i for r in ahead for i in r["samples"])
    assert samples == list(range(ahead[0]["num_samples"]))  # exactly once
    at_boundary = [r["prefetch-at-boundary"] for r in chaos]
    assert all(r["kind"] != "ok" for r in at_boundary), at_boundary  # the wait is real...
    assert all(r["seconds"] <= 2 * T + SLACK for r in at_boundary), at_boundary  # ...bounded
    assert any(r["kind"] == "PlanAgreementError" for r in at_boundary), at_boundary


@pytest.mark.timeout(180)
def test_a_healthy_step_makes_one_agreement_and_no_store_request(chaos: list[dict]) -> None:
    """Dataflow: no status exchange between waves, no synchronisation after the last, no Store
    polling while ranks wait: one all_reduce on the control group per step, none with
    ``agree=False``, and not one Store request."""
    for r in chaos:
        got = r["healthy-counted"]
        assert got.get("kind") != "crash", got
        assert got["agreed"] == [["all_reduce"], 0], got
        assert got["skipped"] == [[], 0], got


@pytest.mark.timeout(180)
def test_sampler_agreement_is_on_by_default_and_names_an_absent_rank(chaos: list[dict]) -> None:
    runs = [r["sampler-absent"] for r in chaos]
    assert all(r["agreement"] for r in runs), runs
    for rank, r in enumerate(runs):
        if rank == ABSENT:
            continue
        assert r["kind"] == "PlanAgreementError", r
        assert r["ranks"] == [ABSENT], r
        assert f"rank(s) [{ABSENT}] stopped responding" in r["message"], r
        assert r["seconds"] <= 2 * T + SLACK, r
