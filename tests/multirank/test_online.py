"""OnlinePlanner: exactly-once over submitted ids, one plan on every rank, clear input errors."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.control.agreement import PlanMismatchError
from dyncp.cost_model import CostModel
from dyncp.planner import Planner
from dyncp.sampler import OnlinePlanner, OnlinePlanningError, RolloutBatch
from dyncp.testing.distributed import run_gloo

CAPACITY = 1024


@functools.lru_cache
def _model(ranks_per_node: int) -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node=ranks_per_node)


def _planner(world: int, *, deterministic: bool = True, **kwargs) -> Planner:
    rpn = min(world, 4)
    return Planner(
        _model(rpn),
        world=world,
        ranks_per_node=rpn,
        capacity=CAPACITY,
        deterministic=deterministic,
        cpsat=None,
        **kwargs,
    )


def _coverage(steps_by_rank: list) -> list[int]:
    """Every submitted id as often as some group trained it (counted once per group)."""
    out = []
    for step in steps_by_rank:
        for mb in step.microbatches:
            if mb.meta.rank_in_group == 0:
                out.extend(mb.meta.sample_indices)
    return out


@settings(max_examples=25, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4, 8]),
    ids=st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=40, unique=True),
    data=st.data(),
)
def test_every_submitted_id_is_trained_exactly_once(world: int, ids: list[int], data) -> None:
    planner = _planner(world)
    longest = planner.topology.max_length()
    lengths = data.draw(st.lists(st.integers(1, longest), min_size=len(ids), max_size=len(ids)))
    steps = []
    for rank in range(world):
        with OnlinePlanner(planner, rank=rank) as online:
            steps.append(online.submit(ids, lengths).result(timeout=60))
    assert sorted(_coverage(steps)) == sorted(ids)
    assert len({s.digest for s in steps}) == 1
    held = [
        {
            (b.meta.wave, b.meta.group_start, b.meta.microbatch): b.meta.sample_indices
            for b in s.microbatches
        }
        for s in steps
    ]
    for s, mine in zip(steps, held):  # a group's members hold the same micro-batches
        for (wave, start, m), samples in mine.items():
            if wave >= 0:
                assert held[start][(wave, start, m)] == samples
        for mb in s.microbatches:
            assert list(mb) == list(mb.meta.sample_indices)
            assert mb.meta.seqlens == tuple(lengths[ids.index(i)] for i in mb)
        assert s.microbatches[-1].meta.last_in_step


@pytest.mark.parametrize(
    ("ids", "lengths", "message"),
    [
        ([1, 2, 2, 3, 3], [5, 5, 5, 5, 5], r"2 ids are submitted more than once \(2, 3\)"),
        ([1, 2, 3], [5, 0, -4], r"2 sequences .*at least 1 token.*2 \(0 tokens\), 3 \(-4 tokens\)"),
        ([7, 8], [5, 10**6], r"1 sequences .*at most 4096.*8 \(1000000 tokens\).*cap the gen"),
        ([1, 2], [5], "2 ids but 1 lengths"),
        ([], [], "at least one sequence"),
        ([1.5, 2.0], [3, 4], "ids must be a 1-D sequence of integers"),
        ([[1, 2]], [[3, 4]], "ids must be a 1-D sequence of integers"),
    ],
)
def test_bad_batches_get_a_clear_error(ids, lengths, message) -> None:
    with OnlinePlanner(_planner(4), rank=0) as online, pytest.raises(ValueError, match=message):
        online.submit(ids, lengths)
    with pytest.raises(ValueError, match=message):
        RolloutBatch.of(ids, lengths, 4096)


def test_several_ranks_planning_alone_need_a_deterministic_planner() -> None:
    with pytest.raises(ValueError, match="must be deterministic"):
        OnlinePlanner(_planner(2, deterministic=False), rank=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world=2\)"):
        OnlinePlanner(_planner(2), rank=2)


class _GatedPlanner(Planner):
    """Plans only once the test opens the gate (shows that submit does not wait for planning)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def plan(self, lengths, **options):
        assert self.gate.wait(30)
        return super().plan(lengths, **options)


def test_submit_returns_before_the_plan_exists_and_steps_keep_their_order() -> None:
    planner = _GatedPlanner(_model(1), world=1, ranks_per_node=1, capacity=CAPACITY, cpsat=None)
    with OnlinePlanner(planner, rank=0) as online:
        first = online.submit([10, 11], [100, 200])
        second = online.submit([12], [300])
        assert not first.done() and not second.done()
        with pytest.raises(TimeoutError):
            first.result(timeout=0.2)
        planner.gate.set()
        a, b = first.result(timeout=30), second.result(timeout=30)
    assert (a.step, b.step) == (0, 1)
    assert sorted(_coverage([a])) == [10, 11] and _coverage([b]) == [12]
    assert not a.ready and a.wait_seconds > 0


# ------------------------------------------------------------------------------ gloo ranks


def _broadcast_worker(rank: int, world: int, batches: list, odd_rank: int | None) -> list:
    group = dist.new_group(backend="gloo")
    planner = _planner(world, deterministic=False, time_limit=0.05)  # anytime: differs per run
    out = []
    with OnlinePlanner(planner, rank=rank, group=group) as online:
        pending = [online.submit(*b) for b in batches[:2]]  # two steps in flight
        for k in range(len(batches)):
            if k + 2 < len(batches):
                ids, lengths = batches[k + 2]
                if rank == odd_rank and k + 2 == len(batches) - 1:
                    lengths = [n + 1 for n in lengths]  # this rank got another batch
                pending.append(online.submit(ids, lengths))
            try:
                step = pending[k].result(timeout=60)
            except PlanMismatchError as exc:
                out.append(("mismatch", exc.ranks))
                continue
            out.append((step.digest, step.plan.to_json(), _coverage([step])))
    return out


def _batches(n: int, seed: int, longest: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        size = int(rng.integers(5, 30))
        ids = (1000 * k + rng.permutation(size)).tolist()
        out.append((ids, np.clip(rng.lognormal(6, 1.2, size), 1, longest).astype(int).tolist()))
    return out


@pytest.mark.timeout(120)
def test_four_ranks_run_the_roots_plan_and_train_each_id_once() -> None:
    batches = _batches(4, seed=3, longest=4 * CAPACITY)
    results = run_gloo(_broadcast_worker, world=4, args=(batches, None), timeout=100, pg_timeout=20)
    for k, (ids, _) in enumerate(batches):
        digests = {r[k][0] for r in results}
        assert len(digests) == 1 and len({r[k][1] for r in results}) == 1
        assert sorted(c for r in results for c in r[k][2]) == sorted(ids)


@pytest.mark.timeout(120)
def test_a_rank_with_another_batch_makes_every_rank_raise() -> None:
    batches = _batches(3, seed=4, longest=2 * CAPACITY - 1)
    results = run_gloo(_broadcast_worker, world=2, args=(batches, 1), timeout=100, pg_timeout=20)
    for r in results:  # two ranks, two plans: no majority, so no rank is named
        assert r[-1] == ("mismatch", ())
        assert all(step[0] != "mismatch" for step in r[:-1])


class _FailingPlanner(Planner):
    def plan(self, lengths, **options):
        raise RuntimeError("solver exploded")


def _failing_root_worker(rank: int, world: int) -> str:
    group = dist.new_group(backend="gloo")
    cls = _FailingPlanner if rank == 0 else Planner
    planner = cls(_model(2), world=2, ranks_per_node=2, capacity=CAPACITY, cpsat=None)
    with OnlinePlanner(planner, rank=rank, group=group) as online:
        try:
            online.submit([1, 2], [10, 20]).result(timeout=60)
        except OnlinePlanningError as exc:
            return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_a_root_that_cannot_plan_fails_the_step_on_every_rank() -> None:
    results = run_gloo(_failing_root_worker, world=2, timeout=100, pg_timeout=20)
    for message in results:
        assert "root rank 0 could not plan: RuntimeError: solver exploded" in message
