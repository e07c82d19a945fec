"""Plan slices: each rank's part of a plan, committed to by a header's Merkle root.

Properties asserted: the slices together are the plan (every group on each of its ranks, every
sequence once); a rank's micro-batches from its slice are those from the whole plan; a slice
that is not its position's slice of the header's plan (edited, truncated, another position's,
another plan's) is refused; a reader of a published sliced plan never decodes, hashes or
validates the whole plan; a rank whose slice is gone cannot run the step (SliceUnavailable).
"""

from __future__ import annotations

import functools
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist

import dyncp.plan.contract as plan_module
import dyncp.service as service_module
from dyncp.cost_model import CostModel
from dyncp.plan import PlanError, PlanSlice, StepPlan
from dyncp.plan.slice import (
    HASH_BYTES,
    SliceHeader,
    open_slice,
    own_slice,
    record_index,
    slice_plan,
    slice_span,
)
from dyncp.planner import Planner
from dyncp.sampler import BatchSchedule
from dyncp.sampler.microbatches import rank_microbatches
from dyncp.service import PlanClient, PlanService, SliceUnavailable, plan_batch, slice_key, step_key

WORLD, CAPACITY = 8, 1024
NODE = 2  # ranks per node: four spans of two positions, one record each


@functools.lru_cache
def _model() -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node=NODE)


def make_planner() -> Planner:
    return Planner(
        _model(), world=WORLD, ranks_per_node=NODE, capacity=CAPACITY, deterministic=True,
        cpsat=None,
    )  # fmt: skip


def make_schedule() -> BatchSchedule:
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(5.5, 1.4, 400).astype(np.int64), 1, WORLD * CAPACITY)
    return BatchSchedule(
        lengths, max_length=WORLD * CAPACITY, global_batch_tokens=2 * WORLD * CAPACITY
    )


@functools.lru_cache
def a_plan() -> StepPlan:
    schedule = make_schedule()
    plan = plan_batch(make_planner(), *schedule.batch(0, 1))
    assert len({g.size for w in plan.waves for g in w.groups}) > 1  # rings and single ranks
    return plan


def test_the_slices_together_are_the_plan() -> None:
    plan = a_plan()
    header, records = slice_plan(plan)
    assert (header.waves, header.sequences) == (len(plan.waves), len(plan.lengths))
    assert header.labels == sum(s - 1 for s in plan.lengths)
    assert len(records) == WORLD // NODE == WORLD // slice_span(plan.topology)
    seen: dict[int, set] = {}
    for p in range(WORLD):
        mine = open_slice(header, records[record_index(plan.topology, p)], p)
        assert len(mine.waves) == len(plan.waves)
        for w, wave in enumerate(mine.waves):
            expected = [g for g in plan.waves[w].groups if g.start <= p < g.start + g.size]
            assert list(wave.groups) == expected
            for g in wave.groups:
                for mb in g.microbatches:
                    for i in mb.seq_ids:
                        seen.setdefault(i, set()).add((w, g.start))
                        assert mine.lengths[i] == plan.lengths[i]
                        assert mine.sample_ids[i] == plan.sample_ids[i]
    assert sorted(seen) == list(range(len(plan.lengths)))
    assert all(len(v) == 1 for v in seen.values())  # each sequence in one group


def test_micro_batches_from_a_slice_are_those_from_the_plan() -> None:
    plan = a_plan()
    for p in range(WORLD):
        whole = rank_microbatches(plan, rank=p, epoch=0, step=1, digest=7)
        sliced = rank_microbatches(own_slice(plan, p), rank=p, epoch=0, step=1, digest=7)
        assert [(list(a), a.meta) for a in whole] == [(list(b), b.meta) for b in sliced]


def _tampered(record: bytes) -> bytes:
    edited = bytearray(record)
    edited[-3] ^= 0x01  # a digit of the content
    return bytes(edited)


@pytest.mark.parametrize(
    "attack",
    ["edited", "truncated", "other position", "other plan", "wrong position", "empty"],
)
def test_a_slice_that_is_not_its_positions_slice_is_refused(attack: str) -> None:
    plan = a_plan()
    header, records = slice_plan(plan)
    other = plan_batch(make_planner(), *make_schedule().batch(0, 2))
    _, other_records = slice_plan(other)
    record, position = {
        "edited": (_tampered(records[1]), 3),
        "truncated": (records[1][:HASH_BYTES], 3),
        "other position": (records[2], 3),  # another span's record (positions 4 and 5)
        "other plan": (other_records[1], 3),
        "wrong position": (records[1], WORLD),
        "empty": (b"", 3),
    }[attack]
    with pytest.raises(PlanError) as info:
        open_slice(header, record, position)
    assert info.value.rule == "slice"


@pytest.mark.parametrize(
    "raw",
    [b"", b"[]", b'{"dyncp_slices": 2}', b'{"dyncp_slices": 1, "root": "zz"}', b"\xff" * 10],
)
def test_garbage_headers_are_plan_errors(raw: bytes) -> None:
    with pytest.raises(PlanError):
        SliceHeader.from_json(raw)
    header, _ = slice_plan(a_plan())
    assert SliceHeader.from_json(header.to_json()) == header


@pytest.fixture
def master():
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)


def _reader(master, rank: int, prefix: str = "sl") -> PlanClient:
    store = dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))
    return PlanClient(
        store, source=make_schedule(), planner=make_planner(), prefix=prefix, rank=rank,
        deadline=5.0, slices=True,
    )  # fmt: skip


def test_a_reader_of_slices_never_touches_the_whole_plan(master, monkeypatch) -> None:
    service = PlanService(
        master, source=make_schedule(), planner=make_planner(), prefix="sl", slices=True
    )
    assert service.publish(0, 1)
    sizes = [len(master.get(slice_key(step_key("sl", 0, 1), k))) for k in range(WORLD // NODE)]

    def forbidden(*args, **kwargs):
        raise AssertionError("a reader of slices touched the whole plan")

    expected = own_slice(a_plan(), 5)
    monkeypatch.setattr(StepPlan, "validate", forbidden)
    monkeypatch.setattr(StepPlan, "from_json", forbidden)
    monkeypatch.setattr(plan_module, "plan_digest", forbidden)
    monkeypatch.setattr(service_module, "plan_digest", forbidden)
    got = _reader(master, 5).fetch(0, 1)
    assert got.source == "service" and got.plan.position == 5
    assert got.plan.waves == expected.waves and got.plan.digest == expected.digest
    assert master.check([slice_key(step_key("sl", 0, 1), 2)])  # kept (keep_steps): restarts
    assert max(sizes) < len(a_plan().to_json())


def test_a_missing_slice_makes_its_rank_unable_to_run(master) -> None:
    service = PlanService(
        master, source=make_schedule(), planner=make_planner(), prefix="sl-missing", slices=True
    )
    assert service.publish(0, 1)
    master.delete_key(slice_key(step_key("sl-missing", 0, 1), 1))  # positions 2 and 3
    header = SliceHeader.from_json(master.get(step_key("sl-missing", 0, 1)))
    with pytest.raises(SliceUnavailable) as info:
        _reader(master, 2, "sl-missing").fetch(0, 1)
    assert info.value.digest == header.digest and "rank 2" in str(info.value)
    assert info.value.missing
    assert (
        _reader(master, 1, "sl-missing").fetch(0, 1).source == "service"
    )  # the others hold theirs


def _sampler(master, prefix: str, *, serve: bool = True):
    from dyncp.sampler import DynamicCPSampler

    store = dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=30))
    schedule = make_schedule()
    sampler = DynamicCPSampler(
        schedule.lengths, world_size=WORLD, rank=0, capacity=CAPACITY, planner=make_planner(),
        global_batch_tokens=2 * WORLD * CAPACITY, store=store, prefix=prefix, serve=False,
        deadline=10.0, slices=True,
    )  # fmt: skip
    if not serve:
        return sampler, None
    service = PlanService(
        store, source=sampler.schedule, planner=make_planner(), prefix=prefix, slices=True
    )
    return sampler, service.start()


def test_a_sampler_of_slices_resumes_mid_step_exactly(master) -> None:
    """Rank 0 of 8 reads slices from a service; stopped in the middle of a step, saved and
    resumed in a new sampler, it yields exactly the micro-batches an uninterrupted run does."""
    sampler, service = _sampler(master, "whole")
    whole = [(mb.meta.step, mb.meta.position, list(mb)) for mb in sampler]
    sampler.close()
    service.stop()
    assert sampler.counters.fallbacks == 0 and sampler.counters.steps == sampler.num_steps
    cut = next(i for i, (_, position, _) in enumerate(whole) if position == 1)  # mid-step
    first, service = _sampler(master, "part")
    it = iter(first)
    got = [next(it) for _ in range(cut)]
    state = first.state_dict()
    assert state["plan_kind"] == "slice" and state["offset"] == 1
    first.close()
    resumed, _ = _sampler(master, "part", serve=False)  # the service of "part" still serves
    resumed.load_state_dict(state)
    got += list(resumed)
    resumed.close()
    service.stop()
    assert [(mb.meta.step, mb.meta.position, list(mb)) for mb in got] == whole


def test_all_records_of_a_4096_rank_plan_stay_within_twice_its_json() -> None:
    """Finding 8: the records of a dyncp-policy plan of 4,096 ranks (2 x N x 8,192 tokens of the
    bundled Wikipedia sample, as ``bench/control_plane_bench.py --offline --policy dyncp``)
    and its header total at most 2x the plan's JSON (one record per rank: 3.6x)."""
    from dyncp.data import load_lengths, resolve_dataset

    world = 4096
    raw = load_lengths(resolve_dataset("wikipedia"))
    tokens = 2 * world * 8192
    picked = np.minimum(raw[np.random.default_rng(0).integers(0, len(raw), tokens // 75)], 65536)
    lengths = picked[: int(np.searchsorted(np.cumsum(picked), tokens)) + 1]
    model = CostModel.load("h100-reference", ranks_per_node=8)
    planner = Planner(model, world=world, ranks_per_node=8, capacity=8192, cpsat=None)
    plan = planner.plan(lengths)
    header, records = slice_plan(plan)
    stored = sum(len(r) for r in records) + len(header.to_json())
    assert stored <= 2 * len(plan.to_json()), stored / len(plan.to_json())
    assert len(records) == world // 8
    for p in (0, 1234, world - 1):  # and each rank still reads its part only
        mine = open_slice(header, records[record_index(plan.topology, p)], p)
        assert all(g.start <= p < g.start + g.size for w in mine.waves for g in w.groups)


def test_a_reader_of_slices_makes_two_store_requests_a_step() -> None:
    """Finding 9 with slices: in steady state (old records being deleted) a reader checks for the
    header and its span's record and reads both (2 requests); the first position of a span also
    deletes the span's record ``keep_steps`` back (3). Before: 5 (4 reads, 1 deletion) each."""
    from dyncp.testing.distributed import CountingStore

    base = dist.HashStore()
    service = PlanService(base, source=make_schedule(), planner=make_planner(), prefix="req",
                          slices=True, lookahead=0)  # fmt: skip
    readers = {
        r: PlanClient(CountingStore(base), source=make_schedule(), planner=make_planner(),
                      prefix="req", rank=r, slices=True, keep_steps=2)
        for r in (1, 2)
    }  # fmt: skip
    counts = {1: [], 2: []}
    for step in range(6):
        assert service.publish(0, step)
        for r, reader in readers.items():
            before = reader.store.requests
            assert reader.fetch(0, step).source == "service"
            counts[r].append(reader.store.requests - before)
    assert counts[1][3:] == [2, 2, 2] and counts[2][3:] == [3, 3, 3], counts


def test_a_reader_of_the_other_form_says_so(master, caplog) -> None:
    """A service and its readers that resolved ``slices`` differently: each step is rejected
    with a line saying which side publishes what (it said "schema_version None")."""
    service = PlanService(
        master, source=make_schedule(), planner=make_planner(), prefix="forms", slices=True
    )
    assert service.publish(0, 1)
    reader = PlanClient(master, source=make_schedule(), planner=make_planner(), prefix="forms",
                        rank=1, deadline=5.0, slices=False)  # fmt: skip
    got = reader.fetch(0, 1)
    assert (got.source, got.reason) == ("fallback", "rejected")
    assert "the service publishes slices and this reader reads whole plans" in caplog.text
    # A reader left at "auto" (the sampler's default) runs whichever form the service publishes.
    whole = PlanService(master, source=make_schedule(), planner=make_planner(), prefix="forms-w")
    assert whole.publish(0, 1)
    for prefix, kind in (("forms", PlanSlice), ("forms-w", StepPlan)):
        auto = PlanClient(master, source=make_schedule(), planner=make_planner(), prefix=prefix,
                          rank=1, deadline=5.0, slices="auto")  # fmt: skip
        got = auto.fetch(0, 1)
        assert got.source == "service" and isinstance(got.plan, kind), (prefix, got)
