"""Tests for StepPlan.validate() rule by rule, traversal, random valid plans, head splits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_builders import TOPO, group, raises_rule, valid_plan, wave, with_waves

from dyncp.plan import (
    Group,
    MicroBatch,
    PlanError,
    StepPlan,
    Topology,
    Wave,
    plan_digest,
)

# ------------------------------------------------------------------------------------ traversal


def test_microbatches_traversal_order() -> None:
    plan = valid_plan()
    order = [(w, g.start, g.size, m.seq_ids) for w, g, m in plan.microbatches()]
    assert order == [
        (0, 0, 4, (0,)),
        (0, 4, 1, (1,)),
        (0, 4, 1, (2, 3, 4)),
        (0, 6, 2, (5,)),
        (1, 0, 8, (6, 7)),
    ]


def test_cp_of_sequences() -> None:
    plan = valid_plan()
    assert plan.cp_of_sequences() == {0: 4, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 8, 7: 8}
    empty = StepPlan(topology=TOPO, lengths=(), waves=())
    assert empty.cp_of_sequences() == {}
    assert list(empty.microbatches()) == []


def test_group_ranks() -> None:
    assert group(4, 4, (0,)).ranks == range(4, 8)
    assert list(group(3, 1, (0,)).ranks) == [3]


# ------------------------------------------------------------------------------------ validate


def test_valid_plan_passes() -> None:
    valid_plan().validate()


def test_empty_batch_without_waves_is_valid() -> None:
    StepPlan(topology=TOPO, lengths=(), waves=()).validate()


def test_same_ranks_in_different_waves_is_fine() -> None:
    plan = with_waves(
        valid_plan(),
        wave(group(0, 4, (0,)), group(4, 4, (1, 2, 3, 4))),
        wave(group(0, 4, (5,)), group(4, 4, (7,))),  # the same ranks again
        wave(group(0, 8, (6,))),
    )
    plan.validate()


def test_idle_ranks_are_allowed() -> None:
    plan = StepPlan(topology=TOPO, lengths=(10,), waves=(wave(group(6, 1, (0,))),))
    plan.validate()


def test_rule_lengths() -> None:
    plan = with_waves(
        valid_plan(),
        *valid_plan().waves,
        lengths=(4000, 0, 100, 200, 300, -5, 7000, 50),
    )
    err = raises_rule(plan, "lengths")
    assert err.ids == (1, 5)
    assert "[1, 5]" in str(err)


def test_rule_sample_ids() -> None:
    plan = valid_plan()
    plan.sample_ids = (1, 2, 3)
    err = raises_rule(plan, "sample-ids")
    assert "3 sample ids for 8 sequences" in str(err)


def test_rule_exactly_once_missing() -> None:
    plan = valid_plan()
    plan.waves = (plan.waves[0], wave(group(0, 8, (6,))))  # 7 is never scheduled
    err = raises_rule(plan, "exactly-once")
    assert err.ids == (7,)
    assert "never scheduled" in str(err) and "[7]" in str(err)


def test_rule_exactly_once_duplicate() -> None:
    plan = valid_plan()
    plan.waves = (*plan.waves, wave(group(0, 1, (2,))))
    err = raises_rule(plan, "exactly-once")
    assert err.ids == (2,)
    assert "twice" in str(err) and "[2]" in str(err)


def test_rule_exactly_once_duplicate_within_one_microbatch() -> None:
    plan = StepPlan(topology=TOPO, lengths=(10, 20), waves=(wave(group(0, 1, (0, 1, 1))),))
    err = raises_rule(plan, "exactly-once")
    assert err.ids == (1,)


@pytest.mark.parametrize("bad_id", [8, 100, -1])
def test_rule_exactly_once_unknown_id(bad_id: int) -> None:
    plan = valid_plan()
    plan.waves = (*plan.waves, wave(group(0, 1, (bad_id,))))
    err = raises_rule(plan, "exactly-once")
    assert err.ids == (bad_id,)
    assert str(bad_id) in str(err) and "unknown" in str(err)


def test_rule_exactly_once_no_waves() -> None:
    plan = valid_plan()
    plan.waves = ()
    err = raises_rule(plan, "exactly-once")
    assert err.ids == tuple(range(8))
    assert "no waves" in str(err)


def test_rule_empty_wave() -> None:
    plan = valid_plan()
    plan.waves = (plan.waves[0], Wave(()), plan.waves[1])
    err = raises_rule(plan, "empty-wave")
    assert err.ids == (1,)
    assert "wave 1" in str(err)


@pytest.mark.parametrize("size", [3, 16, 0])
def test_rule_group_size(size: int) -> None:
    plan = valid_plan()
    plan.waves = (plan.waves[0], wave(group(0, size, (6, 7))))
    err = raises_rule(plan, "group-size")
    assert err.ids == (0,)
    assert f"size {size}" in str(err)


def test_rule_group_size_not_in_explicit_sizes() -> None:
    topo = Topology(world=8, ranks_per_node=8, capacity=1000, group_sizes=(1, 4, 8))
    plan = StepPlan(topology=topo, lengths=(10,), waves=(wave(group(2, 2, (0,))),))
    err = raises_rule(plan, "group-size")
    assert err.ids == (2,)


@pytest.mark.parametrize(("start", "size"), [(2, 4), (1, 2), (6, 4), (-2, 2), (8, 1), (8, 8)])
def test_rule_group_alignment(start: int, size: int) -> None:
    plan = StepPlan(topology=TOPO, lengths=(10,), waves=(wave(group(start, size, (0,))),))
    err = raises_rule(plan, "group-alignment")
    assert err.ids == (start,)
    assert f"starts at rank {start}" in str(err)


def test_rule_wave_disjoint() -> None:
    plan = valid_plan()
    plan.waves = (
        wave(group(0, 4, (0,)), group(2, 2, (5,)), group(4, 1, (1,), (2, 3, 4))),
        plan.waves[1],
    )
    err = raises_rule(plan, "wave-disjoint")
    assert err.ids == (2, 3)
    assert "[2, 3]" in str(err)


def test_rule_wave_disjoint_same_group_twice() -> None:
    plan = StepPlan(
        topology=TOPO, lengths=(10, 20), waves=(wave(group(4, 2, (0,)), group(4, 2, (1,))),)
    )
    err = raises_rule(plan, "wave-disjoint")
    assert err.ids == (4, 5)


def test_rule_empty_group() -> None:
    plan = valid_plan()
    plan.waves = (
        wave(group(0, 4, (0,)), group(4, 1, (1,), (2, 3, 4)), Group(6, 2, ())),
        wave(group(0, 8, (5, 6, 7))),
    )
    plan.lengths = (4000, 900, 100, 200, 300, 150, 6500, 50)
    err = raises_rule(plan, "empty-group")
    assert err.ids == (6,)
    assert "rank 6" in str(err)


def test_rule_empty_microbatch() -> None:
    plan = valid_plan()
    plan.waves = (
        wave(group(0, 4, (0,)), group(4, 1, (1,), (), (2, 3, 4)), group(6, 2, (5,))),
        plan.waves[1],
    )
    err = raises_rule(plan, "empty-microbatch")
    assert "group at rank 4" in str(err) and "micro-batch 1" in str(err)


def test_rule_min_cp() -> None:
    plan = valid_plan()
    # sequence 0 (4000 tokens) needs cp = 4; put it on a group of 2.
    plan.waves = (
        wave(group(0, 2, (0,)), group(4, 1, (1,), (2, 3, 4)), group(6, 2, (5,))),
        plan.waves[1],
    )
    err = raises_rule(plan, "min-cp")
    assert err.ids == (0,)
    assert "{0: 4}" in str(err)


def test_rule_min_cp_sequence_no_group_holds() -> None:
    plan = StepPlan(topology=TOPO, lengths=(10, 8001), waves=(wave(group(0, 8, (0, 1))),))
    err = raises_rule(plan, "min-cp")
    assert err.ids == (1,)
    assert "{1: None}" in str(err)


def test_rule_capacity_pack_of_short_sequences() -> None:
    # each of 600 and 500 fits alone at cp = 1, together they need 1100 > 1000.
    plan = StepPlan(topology=TOPO, lengths=(600, 500, 5), waves=(wave(group(3, 1, (0, 2, 1))),))
    assert TOPO.fits([600], 1) and TOPO.fits([500], 1)
    err = raises_rule(plan, "capacity")
    assert err.ids == (0, 2, 1)
    assert "1105" in str(err) and "capacity 1000" in str(err)


def test_rule_capacity_raw_sum_fits_but_padded_sum_does_not() -> None:
    topo = Topology(world=4, ranks_per_node=4, capacity=8)
    lengths = (5, 5, 5)
    # raw: 15 tokens over 2 ranks = 7.5 <= 8; zigzag-padded: 3 * 8 / 2 = 12 > 8.
    assert sum(lengths) <= 2 * topo.capacity
    plan = StepPlan(topology=topo, lengths=lengths, waves=(wave(group(2, 2, (0, 1, 2))),))
    err = raises_rule(plan, "capacity")
    assert err.ids == (0, 1, 2)
    assert "12 padded tokens" in str(err)
    # two of them fit: 16 / 2 = 8.
    ok = StepPlan(
        topology=topo, lengths=lengths, waves=(wave(group(2, 2, (0, 1)), group(0, 2, (2,))),)
    )
    ok.validate()


def test_capacity_exactly_full_is_valid() -> None:
    plan = StepPlan(
        topology=TOPO,
        lengths=(400, 600, 7980, 10),
        waves=(
            wave(group(0, 1, (0, 1))),  # 400 + 600 = capacity at cp = 1
            wave(group(0, 8, (2, 3))),  # (7984 + 16) / 8 = capacity at cp = 8
        ),
    )
    assert TOPO.memory_tokens([7980, 10], 8) == 1000
    plan.validate()


@pytest.mark.parametrize(
    ("cp", "lengths", "tokens"),
    [(1, (600, 401), 1001), (8, (7980, 10, 1), 1002), (2, (1000, 1000, 1), 1002)],
)
def test_capacity_one_token_over_is_refused(cp: int, lengths: tuple, tokens: int) -> None:
    plan = StepPlan(
        topology=TOPO, lengths=lengths, waves=(wave(group(0, cp, tuple(range(len(lengths))))),)
    )
    err = raises_rule(plan, "capacity")
    assert f"{tokens} padded tokens per rank exceed capacity 1000" in str(err)
    assert err.ids == tuple(range(len(lengths)))


# ------------------------------------------------------------------------------------ random plans


def _aligned_partition(draw, start: int, size: int, sizes: tuple[int, ...]) -> list:
    if size == 1 or (size in sizes and draw(st.booleans())):
        return [(start, size)]
    half = size // 2
    return _aligned_partition(draw, start, half, sizes) + _aligned_partition(
        draw, start + half, half, sizes
    )


@st.composite
def random_valid_plans(draw) -> StepPlan:
    world = 1 << draw(st.integers(0, 4))
    capacity = draw(st.integers(2, 2000))
    topo = Topology(
        world=world, ranks_per_node=draw(st.sampled_from([1, 2, 4, 8])), capacity=capacity
    )
    n = draw(st.integers(0, 25))
    lengths = tuple(draw(st.integers(1, topo.max_length())) for _ in range(n))
    # a CP size for each sequence, at least its minimum
    by_cp: dict[int, list[int]] = {}
    for i, s in enumerate(lengths):
        need = topo.min_cp(s)
        assert need is not None
        cp = draw(st.sampled_from([c for c in topo.group_sizes if c >= need]))
        by_cp.setdefault(cp, []).append(i)
    # pack each CP bucket in a random order, opening a new micro-batch when one is full
    mbs: list[tuple[int, list[int]]] = []
    for cp, ids in by_cp.items():
        ids = draw(st.permutations(ids))
        current: list[int] = []
        for i in ids:
            trial = [lengths[j] for j in current] + [lengths[i]]
            if current and (not topo.fits(trial, cp) or draw(st.booleans())):
                mbs.append((cp, current))
                current = []
            current.append(i)
        if current:
            mbs.append((cp, current))
    mbs = list(draw(st.permutations(mbs)))
    # waves: random aligned partitions; each group takes some micro-batches of its size
    waves: list[Wave] = []
    while mbs:
        groups = []
        for start, size in _aligned_partition(draw, 0, world, topo.group_sizes):
            mine = [m for m in mbs if m[0] == size]
            take = mine[: draw(st.integers(0, len(mine)))]
            for m in take:
                mbs.remove(m)
            if take:
                groups.append(Group(start, size, tuple(MicroBatch(tuple(m[1])) for m in take)))
        if not groups:
            cp, ids = mbs.pop(0)
            start = draw(st.integers(0, world // cp - 1)) * cp
            groups.append(Group(start, cp, (MicroBatch(tuple(ids)),)))
        waves.append(Wave(tuple(groups)))
    sample_ids = draw(st.none() | st.just(tuple(range(100, 100 + n))))
    return StepPlan(
        topology=topo,
        lengths=lengths,
        waves=tuple(waves),
        policy=draw(st.sampled_from(["", "greedy", "static-cp"])),
        sample_ids=sample_ids,
        stats={"seed": draw(st.integers(0, 10)), "gap": draw(st.floats(0, 1))},
    )


@settings(max_examples=150, deadline=None)
@given(random_valid_plans())
def test_random_valid_plans_validate_and_round_trip(plan: StepPlan) -> None:
    plan.validate()
    back = StepPlan.from_json(plan.to_json())
    assert back == plan
    back.validate()
    assert StepPlan.from_dict(plan.to_dict()) == plan
    cps = plan.cp_of_sequences()
    assert sorted(cps) == list(range(len(plan.lengths)))
    for i, cp in cps.items():
        assert cp >= plan.topology.min_cp(plan.lengths[i])
    seen = [i for _, _, m in plan.microbatches() for i in m.seq_ids]
    assert sorted(seen) == list(range(len(plan.lengths)))


@settings(max_examples=100, deadline=None)
@given(random_valid_plans(), st.data())
def test_random_plans_break_when_a_sequence_is_dropped_or_repeated(
    plan: StepPlan, data: st.DataObject
) -> None:
    if not plan.lengths:
        return
    w = data.draw(st.integers(0, len(plan.waves) - 1))
    g = data.draw(st.integers(0, len(plan.waves[w].groups) - 1))
    grp = plan.waves[w].groups[g]
    victim = grp.microbatches[0].seq_ids[0]
    # repeat the victim in an extra wave on a group big enough to hold it alone
    cp = plan.topology.min_cp(plan.lengths[victim])
    repeated = StepPlan(
        topology=plan.topology,
        lengths=plan.lengths,
        waves=(*plan.waves, Wave((Group(0, cp, (MicroBatch((victim,)),)),))),
    )
    err = raises_rule(repeated, "exactly-once")
    assert err.ids == (victim,)
    # drop the victim
    first = grp.microbatches[0].seq_ids[1:]
    mbs = ((MicroBatch(first),) if first else ()) + grp.microbatches[1:]
    groups = list(plan.waves[w].groups)
    if mbs:
        groups[g] = Group(grp.start, grp.size, mbs)
    else:
        del groups[g]
    waves = list(plan.waves)
    if groups:
        waves[w] = Wave(tuple(groups))
    else:
        del waves[w]
    dropped = StepPlan(topology=plan.topology, lengths=plan.lengths, waves=tuple(waves))
    err = raises_rule(dropped, "exactly-once")
    assert err.ids == (victim,)


# ------------------------------------------------------------------------------------ head splits

HEADS = Topology(
    world=8, ranks_per_node=8, capacity=1000, head_sizes=(1, 2, 4), query_heads=8, kv_heads=2
)


def split_plan(heads: tuple[int, int, int]) -> StepPlan:
    """Three groups (sizes 4, 2, 2) with the given head splits, one sequence each."""
    waves = (
        Wave(
            (
                Group(0, 4, (MicroBatch((0,)),), heads[0]),
                Group(4, 2, (MicroBatch((1,)),), heads[1]),
                Group(6, 2, (MicroBatch((2,)),), heads[2]),
            )
        ),
    )
    return StepPlan(topology=HEADS, lengths=(3000, 1500, 1200), waves=waves)


def test_head_splits_validate_and_round_trip() -> None:
    plan = split_plan((2, 2, 1))
    plan.validate()
    back = StepPlan.from_json(plan.to_json())
    assert back.waves == plan.waves and back.topology == plan.topology
    assert [g.heads for g in back.waves[0].groups] == [2, 2, 1]
    assert [g.layout_name for g in back.waves[0].groups] == ["a2a2xring2", "a2a2", "ring2"]
    assert plan_digest(back) == plan_digest(plan)
    # The split is part of what executes: another split is another digest.
    assert plan_digest(split_plan((4, 2, 1))) != plan_digest(plan)


@pytest.mark.parametrize(
    ("heads", "message"),
    [((8, 1, 1), "splits heads 8 ways"), ((3, 1, 1), "splits heads 3 ways"),
     ((1, 4, 1), "size 2\\) splits heads 4 ways")],
)  # fmt: skip
def test_head_split_rule(heads: tuple[int, int, int], message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        split_plan(heads).validate()
    assert info.value.rule == "head-split"


def test_rings_only_topology_refuses_any_split() -> None:
    plan = split_plan((2, 1, 1))
    plan.topology = TOPO if TOPO.world == 8 else Topology(8, 8, 1000)
    with pytest.raises(PlanError, match="allowed head sizes dividing 4 are \\[1\\]"):
        plan.validate()
