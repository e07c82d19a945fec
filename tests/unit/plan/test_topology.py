"""Tests for dyncp.plan.topology and dyncp.plan.padding: the padding rule, Topology, what fits."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_builders import ref_padded

from dyncp.plan import (
    Topology,
    padded_length,
)

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


def test_world_must_be_whole_nodes() -> None:
    with pytest.raises(ValueError, match="whole number of nodes"):
        Topology(world=12, ranks_per_node=8, capacity=16)
    assert Topology(world=4, ranks_per_node=8, capacity=16).world == 4  # one node, partly used
    assert Topology(world=24, ranks_per_node=8, capacity=16).world == 24


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
