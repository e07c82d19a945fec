"""Tests for dyncp.plan: Topology, padding, StepPlan.validate() rule by rule, JSON round trip."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.plan import (
    SCHEMA_VERSION,
    Group,
    MicroBatch,
    PlanError,
    StepPlan,
    Topology,
    Wave,
    padded_length,
    plan_digest,
)

# ------------------------------------------------------------------------------------ helpers


def mb(*ids: int) -> MicroBatch:
    return MicroBatch(tuple(ids))


def group(start: int, size: int, *mbs: tuple[int, ...]) -> Group:
    return Group(start, size, tuple(MicroBatch(tuple(m)) for m in mbs))


def wave(*groups: Group) -> Wave:
    return Wave(tuple(groups))


def ref_padded(length: int, cp: int) -> int:
    """Independent padding rule: a multiple of 2*cp when cp > 1, unchanged at cp = 1."""
    if cp == 1:
        return length
    return math.ceil(length / (2 * cp)) * 2 * cp


TOPO = Topology(world=8, ranks_per_node=4, capacity=1000)


def valid_plan() -> StepPlan:
    """A hand-built plan exercising several waves, sizes, packs and idle ranks."""
    lengths = (4000, 900, 100, 200, 300, 1500, 7000, 50)
    waves = (
        wave(
            group(0, 4, (0,)),  # 4000 at cp=4: exactly 4 * capacity
            group(4, 1, (1,), (2, 3, 4)),  # 100 + 200 + 300 <= 1000
            group(6, 2, (5,)),  # 1500 -> padded 1500 / 2 = 750
        ),
        wave(group(0, 8, (6, 7))),  # 7000 + pad(50, 8) = 7008 + 64 -> 884 per rank
    )
    return StepPlan(
        topology=TOPO,
        lengths=lengths,
        waves=waves,
        policy="hand",
        sample_ids=(10, 11, 12, 13, 14, 15, 16, 17),
        stats={"predicted_seconds": 1.25, "solver": {"status": "OPTIMAL", "waves": [1, 2]}},
    )


def with_waves(plan: StepPlan, *waves: Wave, lengths: tuple[int, ...] | None = None) -> StepPlan:
    return StepPlan(
        topology=plan.topology,
        lengths=plan.lengths if lengths is None else lengths,
        waves=tuple(waves),
        policy=plan.policy,
    )


def raises_rule(plan: StepPlan, rule: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        plan.validate()
    assert info.value.rule == rule, str(info.value)
    assert str(info.value).startswith(f"[{rule}]")
    assert isinstance(info.value, ValueError)
    return info.value


# ------------------------------------------------------------------------------------ padding


@pytest.mark.parametrize(
    ("length", "cp", "expected"),
    [
        (1, 1, 1),
        (7, 1, 7),
        (1, 2, 4),
        (4, 2, 4),
        (5, 2, 8),
        (16, 8, 16),
        (17, 8, 32),
        (1000, 4, 1000),
        (1001, 4, 1008),
    ],
)
def test_padded_length_examples(length: int, cp: int, expected: int) -> None:
    assert padded_length(length, cp) == expected


@given(st.integers(1, 10**7), st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
def test_padded_length_is_smallest_multiple(length: int, cp: int) -> None:
    p = padded_length(length, cp)
    assert p == ref_padded(length, cp)
    if cp == 1:
        assert p == length
    else:
        assert p % (2 * cp) == 0
        assert length <= p < length + 2 * cp


# ------------------------------------------------------------------------------------ Topology


@pytest.mark.parametrize(
    ("world", "expected"),
    [(1, (1,)), (2, (1, 2)), (8, (1, 2, 4, 8)), (64, (1, 2, 4, 8, 16, 32, 64))],
)
def test_default_group_sizes_are_powers_of_two_up_to_world(world: int, expected: tuple) -> None:
    topo = Topology(world=world, ranks_per_node=8, capacity=16)
    assert topo.group_sizes == expected
    assert topo.max_group_size == world


def test_default_group_sizes_for_world_not_power_of_two() -> None:
    topo = Topology(world=24, ranks_per_node=8, capacity=16)
    assert topo.group_sizes == (1, 2, 4, 8)


def test_explicit_group_sizes_are_sorted_and_deduplicated() -> None:
    topo = Topology(world=16, ranks_per_node=8, capacity=16, group_sizes=(8, 2, 8, 1))
    assert topo.group_sizes == (1, 2, 8)
    assert topo.max_group_size == 8


@pytest.mark.parametrize("field", ["world", "ranks_per_node", "capacity"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True, "8", None])
def test_topology_rejects_bad_integers(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"world": 8, "ranks_per_node": 8, "capacity": 100}
    kwargs[field] = value
    with pytest.raises(ValueError, match=rf"Topology\.{field}\b"):
        Topology(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world", "rpn", "sizes", "bad"),
    [
        (6, 2, (1, 3), 3),  # larger than a domain of 2, not whole domains
        (12, 4, (1, 6), 6),
        (4, 2, (1, 8), 8),  # larger than world
        (24, 6, (1, 16), 16),  # straddles domains of 6
        (8, 2, (0, 2), 0),
        (8, 2, (-2, 2), -2),
    ],
)
def test_topology_rejects_bad_group_sizes(world: int, rpn: int, sizes: tuple, bad: int) -> None:
    with pytest.raises(ValueError, match=r"Topology\.group_sizes") as info:
        Topology(world=world, ranks_per_node=rpn, capacity=100, group_sizes=sizes)
    assert f"[{bad}]" in str(info.value)


def test_fits_and_min_cp_boundaries() -> None:
    topo = Topology(world=8, ranks_per_node=8, capacity=1000)
    # cp = 1: no padding, exactly capacity fits, one more does not.
    assert topo.memory_tokens([1000], 1) == 1000
    assert topo.fits([1000], 1)
    assert not topo.fits([1001], 1)
    assert topo.min_cp(1000) == 1
    assert topo.min_cp(1001) == 2
    # cp = 4: 4000 is a multiple of 8, so exactly 4 * capacity fits; 4001 pads to 4008.
    assert topo.memory_tokens([4000], 4) == 1000
    assert topo.fits([4000], 4)
    assert topo.memory_tokens([4001], 4) == 1002
    assert not topo.fits([4001], 4)
    assert topo.min_cp(4000) == 4
    assert topo.min_cp(4001) == 8
    # the largest group: exactly 8 * capacity fits, one more fits nowhere.
    assert topo.max_length() == 8000
    assert topo.min_cp(8000) == 8
    assert topo.min_cp(8001) is None
    assert topo.min_cp(1) == 1


def test_length_equal_to_cp_times_capacity_can_fail_through_padding() -> None:
    # capacity 1001, cp 2: 2002 is not a multiple of 4 and pads to 2004 > 2 * 1001.
    topo = Topology(world=2, ranks_per_node=2, capacity=1001)
    assert not topo.fits([2002], 2)
    assert topo.fits([2000], 2)
    assert topo.memory_tokens([2002], 2) == 1002
    assert topo.max_length() == 2000
    assert topo.min_cp(2000) == 2
    assert topo.min_cp(2001) is None


def test_min_cp_respects_explicit_group_sizes() -> None:
    topo = Topology(world=8, ranks_per_node=8, capacity=100, group_sizes=(2, 8))
    assert topo.min_cp(1) == 2  # size 1 is not allowed
    assert topo.min_cp(200) == 2
    assert topo.min_cp(201) == 8  # 4 would do, but is not allowed
    assert topo.max_length() == 800


def test_memory_tokens_of_a_pack_pads_each_sequence() -> None:
    topo = Topology(world=4, ranks_per_node=4, capacity=8)
    # raw 15 tokens (7.5 per rank) but each 5 pads to 8: 24 / 2 = 12 per rank.
    assert topo.memory_tokens([5, 5, 5], 2) == 12
    assert not topo.fits([5, 5, 5], 2)
    assert topo.fits([5, 5], 2)
    assert topo.memory_tokens([], 4) == 0


@settings(max_examples=300, deadline=None)
@given(
    world_exp=st.integers(0, 6),
    capacity=st.integers(2, 5000),
    lengths=st.lists(st.integers(1, 50_000), min_size=1, max_size=6),
    data=st.data(),
)
def test_topology_agrees_with_padding_rule(
    world_exp: int, capacity: int, lengths: list[int], data: st.DataObject
) -> None:
    world = 1 << world_exp
    topo = Topology(world=world, ranks_per_node=8, capacity=capacity)
    cp = data.draw(st.sampled_from(topo.group_sizes))
    tokens = math.ceil(sum(ref_padded(s, cp) for s in lengths) / cp)
    assert topo.memory_tokens(lengths, cp) == tokens
    assert topo.fits(lengths, cp) == (tokens <= capacity)
    for s in lengths:
        need = topo.min_cp(s)
        fitting = [c for c in topo.group_sizes if ref_padded(s, c) <= c * capacity]
        assert need == (fitting[0] if fitting else None)
        # min_cp is None exactly when the sequence is longer than max_length().
        assert (need is None) == (s > topo.max_length())
        if need is not None:
            assert topo.fits([s], need)
    longest = topo.max_length()
    assert topo.min_cp(longest) is not None
    assert topo.min_cp(longest + 1) is None


def test_max_length_with_capacity_one() -> None:
    topo = Topology(world=2, ranks_per_node=2, capacity=1)
    assert topo.min_cp(1) == 1
    assert topo.max_length() == 1


def test_topology_to_dict() -> None:
    topo = Topology(world=16, ranks_per_node=8, capacity=4096, group_sizes=(1, 4, 16))
    assert topo.to_dict() == {
        "world": 16,
        "ranks_per_node": 8,
        "capacity": 4096,
        "group_sizes": [1, 4, 16],
        "head_sizes": [1],
        "query_heads": 0,
        "kv_heads": 0,
        "placement": "domain",
    }
    assert Topology(**topo.to_dict()) == topo


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


# ------------------------------------------------------------------------------------ JSON


def test_json_round_trip_preserves_everything() -> None:
    plan = valid_plan()
    text = plan.to_json()
    back = StepPlan.from_json(text)
    assert back == plan
    assert back.stats == plan.stats
    assert back.sample_ids == plan.sample_ids
    assert back.policy == "hand"
    assert back.topology == plan.topology
    back.validate()
    assert back.to_json() == text
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION


def test_dict_round_trip_and_types() -> None:
    plan = valid_plan()
    data = plan.to_dict()
    back = StepPlan.from_dict(json.loads(json.dumps(data)))
    assert back == plan
    assert isinstance(back.lengths, tuple) and isinstance(back.waves, tuple)
    assert isinstance(back.waves[0].groups[0].microbatches[0].seq_ids, tuple)
    assert data["waves"][0][1] == {
        "start": 4,
        "size": 1,
        "heads": 1,
        "microbatches": [[1], [2, 3, 4]],
    }


def test_round_trip_without_sample_ids() -> None:
    plan = valid_plan()
    plan.sample_ids = None
    plan.stats = {}
    plan.policy = ""
    back = StepPlan.from_json(plan.to_json())
    assert back == plan
    assert back.sample_ids is None


def test_optional_fields_default() -> None:
    data = valid_plan().to_dict()
    for key in ("policy", "sample_ids", "stats"):
        del data[key]
    back = StepPlan.from_dict(data)
    assert back.policy == "" and back.sample_ids is None and back.stats == {}
    assert back.waves == valid_plan().waves


@pytest.mark.parametrize("version", [None, 0, 4, "1", True])
def test_bad_schema_version(version: object) -> None:
    data = valid_plan().to_dict()
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    with pytest.raises(ValueError, match="schema_version"):
        StepPlan.from_dict(data)


@pytest.mark.parametrize("key", ["topology", "lengths", "waves"])
def test_missing_top_level_field(key: str) -> None:
    data = valid_plan().to_dict()
    del data[key]
    with pytest.raises(ValueError, match=f"missing field '{key}'"):
        StepPlan.from_json(json.dumps(data))


@pytest.mark.parametrize("key", ["start", "size", "microbatches"])
def test_missing_group_field(key: str) -> None:
    data = valid_plan().to_dict()
    del data["waves"][0][0][key]
    with pytest.raises(ValueError, match=f"missing field '{key}'"):
        StepPlan.from_dict(data)


@pytest.mark.parametrize("key", ["world", "capacity"])
def test_missing_topology_field(key: str) -> None:
    data = valid_plan().to_dict()
    del data["topology"][key]
    with pytest.raises(ValueError, match=key):
        StepPlan.from_dict(data)


def test_invalid_topology_in_json_names_field() -> None:
    data = valid_plan().to_dict()
    data["topology"]["capacity"] = 0
    with pytest.raises(ValueError, match=r"Topology\.capacity"):
        StepPlan.from_dict(data)


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


# ------------------------------------------------------------------------------ total decoding

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _decode(text: str | bytes) -> StepPlan | None:
    """StepPlan, or None for a PlanError; any other exception fails the test."""
    try:
        plan = StepPlan.from_json(text)
    except PlanError as exc:
        assert exc.rule == "decode"
        return None
    with contextlib.suppress(PlanError):
        plan.validate()  # a decoded plan is checkable without crashing
    return plan


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return copy


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_any_json_value_decodes_to_a_plan_or_a_plan_error(value: object) -> None:
    _decode(json.dumps(value))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_any_bytes_decode_to_a_plan_or_a_plan_error(data: bytes) -> None:
    _decode(data)


PLAN_PATHS = _paths(valid_plan().to_dict())


@settings(max_examples=400, deadline=None)
@given(path=st.sampled_from(PLAN_PATHS), new=json_values)
def test_wrong_types_at_every_field_give_a_plan_error(path: tuple, new: object) -> None:
    _decode(json.dumps(_replace(valid_plan().to_dict(), path, new)))


def _at(value: object, path: tuple) -> object:
    for key in path:
        value = value[key]  # type: ignore[index]
    return value


@pytest.mark.parametrize("path", PLAN_PATHS[1:], ids=lambda p: "/".join(map(str, p)))
@pytest.mark.parametrize("new", ["x", None, 1.5, True, -1, 2**64, [], {}], ids=repr)
def test_each_field_rejects_each_wrong_kind(path: tuple, new: object) -> None:
    data = valid_plan().to_dict()
    plan = _decode(json.dumps(_replace(data, path, new)))
    free = (
        (path[0] == "stats" and (len(path) > 1 or new == {}))  # informational, any object
        or (path == ("policy",) and isinstance(new, str))
        or (path == ("sample_ids",) and new is None)
        or (new == [] and isinstance(_at(data, path), list))  # empty lists: validate() judges
    )
    assert (plan is not None) == free, (path, new)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"x"',
        "null",
        "1e999",
        "-1e999",
        "NaN",
        "Infinity",
        "1" * 5000,
        "[" * 100_000 + "]" * 100_000,
        '{"schema_version": 1, "topology": ' + "[" * 50 + "]" * 50 + "}",
        "{" * 50_000,
        b"\xff\xfe\x00garbage",
        "",
    ],
    ids=lambda t: repr(t[:20]),
)
def test_hostile_texts_are_plan_errors(text: str | bytes) -> None:
    with pytest.raises(PlanError, match=r"^\[decode\]"):
        StepPlan.from_json(text)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lengths", [10**30], "lengths"),
        ("lengths", [True], "lengths"),
        ("lengths", "abc", "lengths"),
        ("sample_ids", [1.0] * 8, "sample_ids"),
        ("policy", 3, "policy"),
        ("stats", [], "stats"),
        ("waves", {}, "waves"),
    ],
)
def test_field_errors_name_the_field(field: str, value: object, message: str) -> None:
    data = valid_plan().to_dict()
    data[field] = value
    with pytest.raises(PlanError, match=message):
        StepPlan.from_json(json.dumps(data))


def test_huge_number_literal_in_a_field_names_the_field() -> None:
    text = valid_plan().to_json().replace('"lengths": [4000,', '"lengths": [1e999,')
    assert "1e999" in text
    with pytest.raises(PlanError, match=r"lengths\[\] must be an integer"):
        StepPlan.from_json(text)


def test_deep_stats_are_refused() -> None:
    data = valid_plan().to_dict()
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    data["stats"] = {"x": deep}
    with pytest.raises(PlanError, match="nests deeper"):
        StepPlan.from_json(json.dumps(data))


def test_world_must_be_whole_nodes() -> None:
    with pytest.raises(ValueError, match="whole number of nodes"):
        Topology(world=12, ranks_per_node=8, capacity=16)
    assert Topology(world=4, ranks_per_node=8, capacity=16).world == 4  # one node, partly used
    assert Topology(world=24, ranks_per_node=8, capacity=16).world == 24


# ------------------------------------------------------------------------------ digest


def test_digest_covers_what_executes_and_ignores_stats() -> None:
    from dyncp.plan import plan_digest

    base = valid_plan()
    digest = plan_digest(base)
    assert plan_digest(StepPlan.from_json(base.to_json())) == digest
    assert plan_digest(dataclasses.replace(base, stats={"x": 1}, policy="other")) == digest
    variants = [
        dataclasses.replace(base, sample_ids=None),
        dataclasses.replace(base, lengths=(*base.lengths[:-1], 51)),
        dataclasses.replace(base, topology=Topology(world=8, ranks_per_node=8, capacity=1000)),
        dataclasses.replace(base, waves=base.waves[::-1]),
        # the same ids, split differently into micro-batches
        dataclasses.replace(
            base,
            waves=(
                wave(group(0, 4, (0,)), group(4, 1, (1, 2), (3, 4)), group(6, 2, (5,))),
                base.waves[1],
            ),
        ),
    ]
    digests = {plan_digest(v) for v in variants}
    assert digest not in digests and len(digests) == len(variants)


def test_digest_refuses_values_beyond_int64() -> None:
    from dyncp.plan import plan_digest

    with pytest.raises(PlanError, match="int64"):
        plan_digest(dataclasses.replace(valid_plan(), lengths=(2**70,) * 8))


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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_sizes": (1, 2)}, "query_heads and kv_heads must be given"),
        ({"head_sizes": (1, 3), "query_heads": 6, "kv_heads": 3}, "split no allowed group"),
        ({"head_sizes": (16,), "query_heads": 16, "kv_heads": 16}, "largest group size 8"),
        ({"head_sizes": (4,), "query_heads": 6, "kv_heads": 2}, "do not fit the heads"),
        ({"head_sizes": (4,), "query_heads": 12, "kv_heads": 6}, "do not fit the heads"),
        ({"head_sizes": (2,), "query_heads": 8, "kv_heads": 3}, "must divide query_heads"),
        ({"query_heads": -1}, "integer >= 0"),
    ],
)
def test_topology_head_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(world=8, ranks_per_node=8, capacity=1000, **kwargs)


def test_topology_kv_heads_fewer_than_u_are_replicated() -> None:
    topo = Topology(8, 8, 100, head_sizes=(8, 2), query_heads=16, kv_heads=2)
    assert topo.head_sizes == (1, 2, 8)
    assert topo.splits(4) == (1, 2) and topo.splits(8) == (1, 2, 8) and topo.splits(1) == (1,)


def test_version_1_plans_still_read() -> None:
    data = valid_plan().to_dict()
    data["schema_version"] = 1
    for key in ("head_sizes", "query_heads", "kv_heads"):
        del data["topology"][key]
    for wave_groups in data["waves"]:
        for g in wave_groups:
            del g["heads"]
    back = StepPlan.from_dict(data)
    assert back.waves == valid_plan().waves and back.topology == valid_plan().topology
    assert all(g.heads == 1 for w in back.waves for g in w.groups)


@pytest.mark.parametrize("field", ["heads", "head_sizes"])
def test_version_2_needs_head_fields(field: str) -> None:
    data = valid_plan().to_dict()
    if field == "heads":
        del data["waves"][0][0]["heads"]
    else:
        del data["topology"]["head_sizes"]
    with pytest.raises(PlanError, match=f"missing field '{field}'"):
        StepPlan.from_dict(data)
