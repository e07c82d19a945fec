"""DynamicCPSampler in one process: batches, exactly-once, resume, collate, DataLoader workers.

Every rank of a world is simulated by its own sampler (local planning with a deterministic
planner, memoised so that W samplers cost one plan per step). The properties asserted:
each sample of an epoch lands in exactly one micro-batch, yielded once by every rank of its group
and by no other; a run saved at a random point and restored equals the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import defaultdict

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dyncp.cost_model import CostModel
from dyncp.plan import padded_length
from dyncp.planner import Planner
from dyncp.ring_attention.sharding import zigzag_unshard
from dyncp.sampler import (
    BatchSchedule,
    DynamicCPSampler,
    MicroBatchIndices,
    PackedMicroBatch,
    PlannedItems,
    ZigzagCollate,
)

CAPACITY = 1024


@functools.lru_cache
def _model(ranks_per_node: int) -> CostModel:
    return CostModel.load("h100-reference", ranks_per_node=ranks_per_node)


class MemoPlanner(Planner):
    """A deterministic planner that plans each distinct batch once (W simulated ranks share it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._memo: dict[bytes, object] = {}
        self.calls = 0

    def plan(self, lengths, **options):
        key = np.asarray(lengths, dtype=np.int64).tobytes()
        if key not in self._memo:
            self.calls += 1
            self._memo[key] = super().plan(lengths, **options)
        plan = self._memo[key]
        return dataclasses.replace(plan, stats=dict(plan.stats))


def make_planner(world: int, *, policy: str = "dyncp") -> MemoPlanner:
    rpn = min(world, 4)
    return MemoPlanner(
        _model(rpn),
        world=world,
        ranks_per_node=rpn,
        capacity=CAPACITY,
        policy=policy,
        deterministic=True,
        cpsat=None,
    )


def make_lengths(n: int, seed: int, longest: int = 4000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.2, n).astype(np.int64), 1, longest)


def make_samplers(lengths, world: int, planner=None, **kwargs) -> list[DynamicCPSampler]:
    planner = planner or make_planner(world)
    if "global_batch_size" not in kwargs:
        kwargs.setdefault("global_batch_tokens", 2 * world * CAPACITY)
    kwargs.setdefault("lookahead", 0)
    return [
        DynamicCPSampler(
            lengths, world_size=world, rank=r, capacity=CAPACITY, planner=planner, **kwargs
        )
        for r in range(world)
    ]


def _key(mb: MicroBatchIndices) -> tuple:
    m = mb.meta
    return (m.epoch, m.step, m.wave, m.group_start, m.microbatch)


def assert_exactly_once(per_rank: list[list[MicroBatchIndices]], expected: set[int]) -> None:
    """Each sample in one micro-batch, yielded once by each rank of its group and no other."""
    where: dict[int, set] = defaultdict(set)
    ranks: dict[tuple, list[int]] = defaultdict(list)
    groups: dict[tuple, range] = {}
    for rank, mbs in enumerate(per_rank):
        for mb in mbs:
            m = mb.meta
            assert list(mb) == list(m.sample_indices)
            if m.is_empty:
                continue
            assert m.rank_in_group == rank - m.group_start
            ranks[_key(mb)].append(rank)
            groups[_key(mb)] = m.group_ranks
            for i in mb:
                where[i].add(_key(mb))
    assert set(where) == expected
    assert all(len(keys) == 1 for keys in where.values()), "a sample in two micro-batches"
    for key, rs in ranks.items():
        assert sorted(rs) == list(groups[key]), f"micro-batch {key} yielded by ranks {rs}"


def run_epoch(samplers: list[DynamicCPSampler], epoch: int = 0) -> list[list[MicroBatchIndices]]:
    out = []
    for s in samplers:
        s.set_epoch(epoch)
        out.append(list(s))
    return out


# ------------------------------------------------------------------------------ schedule


@pytest.mark.parametrize("by", ["tokens", "size"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_schedule_partitions_each_epoch(by: str, drop_last: bool) -> None:
    lengths = make_lengths(500, seed=3)
    kw = {"global_batch_tokens": 20000} if by == "tokens" else {"global_batch_size": 37}
    sched = BatchSchedule(lengths, max_length=10**6, seed=5, drop_last=drop_last, **kw)
    again = BatchSchedule(lengths, max_length=10**6, seed=5, drop_last=drop_last, **kw)
    orders = []
    for epoch in range(2):
        n = sched.num_steps(epoch)
        batches = [sched.batch(epoch, s)[0] for s in range(n)]
        assert all(
            (a == b).all() for a, b in zip(batches, (again.batch(epoch, s)[0] for s in range(n)))
        )
        got = np.concatenate(batches + [sched.dropped(epoch)])
        assert sorted(got.tolist()) == list(range(len(lengths)))  # a partition of the dataset
        for b in batches[:-1] if not drop_last else batches:
            tokens = lengths[b]
            if by == "tokens":
                assert tokens.sum() >= 20000 > tokens[:-1].sum()
            else:
                assert len(b) == 37
        dropped = sched.dropped(epoch)
        if not drop_last:
            assert len(dropped) == 0
        elif by == "tokens":
            assert 0 < lengths[dropped].sum() < 20000  # the partial last batch
        else:
            assert len(dropped) == 500 % 37
        orders.append(got)
    assert not (orders[0] == orders[1]).all(), "epochs must be reshuffled"


def test_schedule_overlong_options() -> None:
    lengths = np.array([10, 5000, 20, 7000, 30])
    with pytest.raises(ValueError, match=r"2 samples are longer than 4096.*1 \(5000 tokens\)"):
        BatchSchedule(lengths, max_length=4096, global_batch_size=2)
    skip = BatchSchedule(lengths, max_length=4096, overlong="skip", global_batch_size=10)
    assert skip.skipped.tolist() == [1, 3] and sorted(skip.batch(0, 0)[0]) == [0, 2, 4]
    cut = BatchSchedule(lengths, max_length=4096, overlong="truncate", global_batch_size=10)
    assert cut.truncated.tolist() == [1, 3] and cut.lengths.max() == 4096
    with pytest.raises(ValueError, match="overlong="):
        BatchSchedule(lengths, max_length=4096, overlong="split", global_batch_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        BatchSchedule(lengths, max_length=4096)


# ------------------------------------------------------------------------------ exactly once


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_sample_exactly_once_per_epoch(world: int, seed: int) -> None:
    lengths = make_lengths(300, seed=seed, longest=min(6000, world * CAPACITY))
    samplers = make_samplers(lengths, world, seed=seed)
    for epoch in range(2 if world == 4 else 1):
        per_rank = run_epoch(samplers, epoch)
        assert_exactly_once(per_rank, set(range(len(lengths))))
        # Every rank ends every step: each step's last micro-batch is flagged, on every rank.
        steps = samplers[0].num_steps
        for mbs in per_rank:
            assert [mb.meta.step for mb in mbs if mb.meta.last_in_step] == list(range(steps))
    assert all(s.counters.steps == steps * (2 if world == 4 else 1) for s in samplers)


def test_drop_last_and_skip_are_reported() -> None:
    lengths = make_lengths(200, seed=4, longest=4096)
    lengths[[3, 50]] = 100000  # longer than the 4 * 1024 tokens the largest group holds
    samplers = make_samplers(lengths, 4, overlong="skip", global_batch_size=24, drop_last=True)
    per_rank = run_epoch(samplers)
    dropped = samplers[0].dropped
    assert len(dropped) == (200 - 2) % 24
    assert_exactly_once(per_rank, set(range(200)) - {3, 50} - set(dropped.tolist()))
    c = samplers[0].counters
    assert (c.skipped_samples, c.dropped_samples) == (2, len(dropped))
    with pytest.raises(ValueError, match=r"longer than 4096 tokens.*3 \(100000 tokens\)"):
        make_samplers(lengths, 4)


def test_options_are_checked() -> None:
    lengths = make_lengths(50, seed=0)
    planner = make_planner(4)
    with pytest.raises(ValueError, match="world_size=8"):
        DynamicCPSampler(
            lengths, world_size=8, rank=0, capacity=CAPACITY, planner=planner, global_batch_size=8
        )
    with pytest.raises(ValueError, match="rank must be"):
        DynamicCPSampler(
            lengths, world_size=4, rank=4, capacity=CAPACITY, planner=planner, global_batch_size=8
        )
    free = Planner(_model(4), world=4, ranks_per_node=4, capacity=CAPACITY)
    with pytest.raises(ValueError, match="deterministic"):
        DynamicCPSampler(
            lengths, world_size=4, rank=0, capacity=CAPACITY, planner=free, global_batch_size=8
        )
    sampler = make_samplers(lengths, 4, global_batch_size=8)[0]
    with pytest.raises(TypeError, match="num_steps"):
        len(sampler)


def test_signed_plans_from_a_standalone_service_need_a_run_id(monkeypatch) -> None:
    """With a secret and no rank serving, a run id the service cannot know cannot be drawn:
    the sampler refuses to start without one (it would fall back at every step, or accept an
    earlier run's records), in one line naming the option."""
    import torch.distributed as dist

    monkeypatch.delenv("DYNCP_RUN_ID", raising=False)
    lengths = make_lengths(50, seed=0, longest=CAPACITY)
    planner = make_planner(1)
    options = dict(world_size=1, rank=0, capacity=CAPACITY, planner=planner, global_batch_size=8)
    store = dist.HashStore()
    with pytest.raises(ValueError, match=r"no run_id is set: give run_id= \(or \$DYNCP_RUN_ID\)"):
        DynamicCPSampler(lengths, store=store, serve=False, secret=b"s" * 32, **options)
    DynamicCPSampler(lengths, store=store, serve=False, secret=b"s" * 32, run_id="r1", **options)


def test_lookahead_thread_gives_the_same_plans_and_hook_sees_each_step() -> None:
    lengths = make_lengths(200, seed=6)
    seen = []
    ahead = make_samplers(lengths, 4, lookahead=2, on_step=lambda p, i: seen.append(i))[1]
    direct = make_samplers(lengths, 4, lookahead=0)[1]
    with ahead:
        got = list(ahead)
    assert [(list(a), a.meta) for a in got] == [(list(b), b.meta) for b in direct]
    assert [i.step for i in seen] == list(range(ahead.num_steps))
    assert all(i.source == "local" for i in seen)
    assert ahead.counters.local_plans == ahead.num_steps


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("seed", range(4))
def test_resume_at_a_random_point_equals_the_uninterrupted_run(seed: int) -> None:
    rnd = random.Random(seed)
    world = rnd.choice([2, 4, 8])
    lengths = make_lengths(250, seed=seed, longest=world * CAPACITY)
    planner = make_planner(world)
    full = [run_epoch(make_samplers(lengths, world, planner, seed=seed), e) for e in (0, 1)]
    per_rank_full = [full[0][r] + full[1][r] for r in range(world)]
    # All ranks checkpoint at the same step; each is at its own random offset within it.
    save_epoch = rnd.choice([0, 1])
    save_step = rnd.randrange(make_samplers(lengths, world, planner)[0].schedule.num_steps(0))
    resumed = []
    for r, sampler in enumerate(make_samplers(lengths, world, planner, seed=seed)):
        count = sum(1 for mb in full[save_epoch][r] if mb.meta.step == save_step)
        offset = rnd.randrange(count)
        cut = sum(1 for mb in full[save_epoch][r] if mb.meta.step < save_step) + offset
        before = []
        for epoch in range(save_epoch + 1):
            sampler.set_epoch(epoch)
            it = iter(sampler)
            before += [next(it) for _ in range(cut)] if epoch == save_epoch else list(it)
        state = sampler.state_dict()
        assert (state["epoch"], state["step"], state["offset"]) == (save_epoch, save_step, offset)
        fresh = make_samplers(lengths, world, make_planner(world), seed=seed)[r]
        fresh.load_state_dict(state)
        after = []
        for epoch in range(save_epoch, 2):
            fresh.set_epoch(epoch)
            after += list(fresh)
        resumed.append(before + after)
    for r in range(world):
        assert [(list(a), a.meta) for a in resumed[r]] == [
            (list(b), b.meta) for b in per_rank_full[r]
        ]


def test_mid_step_resume_keeps_exactly_once_when_later_plans_change() -> None:
    """A restored mid-step state carries its step's plan: later steps may be planned
    differently (another planner) and no sample is lost or repeated."""
    world, lengths = 4, make_lengths(300, seed=9)
    samplers = make_samplers(lengths, world)
    step = samplers[0].num_steps // 2
    per_rank = []
    for r, sampler in enumerate(samplers):
        it = iter(sampler)
        got = []
        while not got or got[-1].meta.step < step:
            got.append(next(it))
        state = sampler.state_dict()
        assert state["step"] == step and ("plan" in state) == (state["offset"] > 0)
        other = make_samplers(lengths, world, make_planner(world, policy="megatron"))[r]
        other.load_state_dict(state)
        per_rank.append(got + list(other))
        if state["offset"]:
            assert other.counters.restored_plans == 1
    assert_exactly_once(per_rank, set(range(len(lengths))))


def test_state_mismatch_is_refused() -> None:
    lengths = make_lengths(100, seed=1, longest=2 * CAPACITY)
    a, b = make_samplers(lengths, 2, seed=1)
    it = iter(a)
    first = next(it)
    state = a.state_dict()
    other = make_samplers(lengths, 2, seed=2)[0]
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        other.load_state_dict(state)
    if not first.meta.last_in_step:
        with pytest.raises(ValueError, match="mid-step by rank 0"):
            b.load_state_dict(state)


# ------------------------------------------------------------------------------ collate


def test_collate_shards_reassemble_each_sequence() -> None:
    world = 4
    lengths = make_lengths(120, seed=2)
    lengths[:3] = [3000, 2500, 1800]  # a few need rings
    tokens = [torch.randint(1, 50000, (int(n),)) for n in lengths]
    collate = ZigzagCollate()
    samplers = make_samplers(
        lengths, world, shuffle=False, global_batch_tokens=3 * world * CAPACITY
    )
    shards = defaultdict(dict)
    for sampler in samplers:
        dataset = sampler.wrap(tokens)
        for mb in sampler:
            packed = collate(dataset.__getitems__(mb))
            shards[_key(mb)][mb.meta.rank_in_group] = (packed, mb.meta)
    cps = set()
    for parts in shards.values():
        meta = parts[0][1]
        cp, seqlens = meta.cp, list(meta.seqlens)
        cps.add(cp)
        assert sorted(parts) == list(range(cp))
        want = torch.cat([tokens[i] for i in meta.sample_indices])
        got = zigzag_unshard([parts[k][0].input_ids for k in range(cp)], seqlens=seqlens)
        assert torch.equal(got, want)
        labels = zigzag_unshard([parts[k][0].labels for k in range(cp)], seqlens=seqlens)
        ends = np.cumsum(seqlens) - 1
        assert (labels[ends] == -100).all()
        keep = np.setdiff1d(np.arange(len(want)), ends)
        assert torch.equal(labels[keep], want[keep + 1])
        padded = [padded_length(s, cp) for s in seqlens]
        p0 = parts[0][0]
        assert p0.cu_seqlens_padded.tolist() == [0, *np.cumsum(padded).tolist()]
        assert p0.cu_seqlens_local.tolist() == [0, *(np.cumsum(padded) // cp).tolist()]
        assert p0.cu_seqlens_padded.dtype == torch.int32
        for k in range(cp):
            part = parts[k][0]
            assert len(part.input_ids) == len(part.position_ids) == sum(padded) // cp
            real = part.labels != -100
            assert (
                part.position_ids[real]
                < torch.tensor(seqlens).repeat_interleave(torch.tensor(padded) // cp)[real]
            ).all()
    assert max(cps) > 1, "the test needs micro-batches on rings"


def test_collate_checks_lengths_and_truncates_only_truncated_samples() -> None:
    lengths = np.array([100, 9000, 50, 60])
    tokens = [torch.arange(int(n)) for n in lengths]
    sampler = make_samplers(lengths, 2, overlong="truncate", global_batch_size=4)[0]
    dataset, collate = sampler.wrap(tokens), sampler.collate
    for mb in sampler:
        packed = collate(dataset.__getitems__(mb))
        assert (
            len(packed.input_ids)
            == sum(padded_length(s, mb.meta.cp) for s in mb.meta.seqlens) // mb.meta.cp
        )
    bad = sampler.wrap([torch.arange(int(n) + 1) for n in lengths])
    mb = next(mb for mb in sampler if len(mb.meta.truncated) < len(mb))
    with pytest.raises(ValueError, match=r"sample \d+: dataset item has shape"):
        collate(bad.__getitems__(mb))
    with pytest.raises(TypeError, match="MicroBatchIndices"):
        dataset.__getitems__([0, 1])


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, lengths) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(int(i))
        return {"input_ids": torch.randint(1, 1000, (int(self.lengths[i]),), generator=g)}


def test_dataloader_with_two_workers_and_resume_from_consumed_batch() -> None:
    world, rank = 4, 1
    lengths = make_lengths(200, seed=8)
    dataset = TokenDataset(lengths)
    planner = make_planner(world)

    def loader(sampler: DynamicCPSampler) -> DataLoader:
        return DataLoader(
            sampler.wrap(dataset),
            batch_sampler=sampler,
            collate_fn=ZigzagCollate(key="input_ids"),
            num_workers=2,
            prefetch_factor=4,
        )

    direct = make_samplers(lengths, world, planner, lookahead=2)[rank]
    want = [(list(mb), mb.meta) for mb in direct]
    sampler = make_samplers(lengths, world, planner, lookahead=2)[rank]
    got, state = [], None
    for batch in loader(sampler):
        assert isinstance(batch, PackedMicroBatch)
        got.append(batch)
        if len(got) == len(want) // 2:
            state = sampler.state_dict(consumed=batch.meta)
            assert sampler.state_dict() != state  # the workers had prefetched further
            break
    fresh = make_samplers(lengths, world, planner, lookahead=2)[rank]
    fresh.load_state_dict(state)
    got += list(loader(fresh))
    assert [(list(b.meta.sample_indices), b.meta) for b in got] == want
    one = got[0]
    items = [dataset[i]["input_ids"] for i in one.meta.sample_indices]
    ref = ZigzagCollate()(PlannedItems(items, one.meta))
    assert torch.equal(one.input_ids, ref.input_ids)
