"""Group-size menus shaped by the machine: placement rules, plan contract, pool counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.cost_model import CostModel
from dyncp.plan import SCHEMA_VERSION, Group, MicroBatch, PlanError, StepPlan, Topology, Wave
from dyncp.plan.menu import (
    MENU_KINDS,
    NCCL_BUFFSIZE_BYTES,
    check_sizes,
    menu_sizes,
    placements,
    pool_blocks,
    pool_count,
)
from dyncp.planner import Planner
from dyncp.planner.construction.packing import place_waves
from dyncp.planner.planner import nested_core


def _domains(world: int, rpn: int) -> list[range]:
    d = min(world, rpn)
    return [range(s, s + d) for s in range(0, world, d)]


@pytest.mark.parametrize(
    ("world", "rpn"), [(72, 72), (576, 72), (64, 4), (96, 6), (96, 4), (8, 8), (6, 8), (144, 72)]
)
@pytest.mark.parametrize("kind", MENU_KINDS)
def test_every_block_of_every_menu_obeys_the_rules(world: int, rpn: int, kind: str) -> None:
    sizes = menu_sizes(kind, world=world, ranks_per_node=rpn)
    assert sizes[0] == 1
    topo = Topology(world, rpn, 100, sizes)
    domains = _domains(world, rpn)
    for c in sizes:
        starts = placements(c, world=world, ranks_per_node=rpn)
        assert list(starts) == sorted(set(starts)) and starts
        covered: set[int] = set()
        for s in starts:
            block = set(range(s, s + c))
            assert block <= set(range(world)) and covered.isdisjoint(block)
            covered |= block
            touched = [d for d in domains if block & set(d)]
            # inside one domain, or exactly whole domains
            assert len(touched) == 1 or all(set(d) <= block for d in touched)
            assert topo.is_placement(s, c)
        others = set(range(world - c + 1)) - set(starts)
        assert not any(topo.is_placement(s, c) for s in others)


def test_divisor_menus_of_an_nvl72() -> None:
    assert menu_sizes("divisors", world=72, ranks_per_node=72) == (
        1, 2, 3, 4, 6, 8, 9, 12, 18, 24, 36, 72,
    )  # fmt: skip
    assert menu_sizes("divisors", world=576, ranks_per_node=72)[-4:] == (72, 144, 288, 576)
    assert menu_sizes("powers-of-two", world=72, ranks_per_node=72) == (1, 2, 4, 8)
    assert menu_sizes("divisors", world=96, ranks_per_node=6) == (1, 2, 3, 6, 12, 24, 48, 96)


def test_sizes_that_do_not_divide_the_domain_get_domain_aligned_blocks() -> None:
    # 3 in a domain of 8: two groups per domain, ranks 6 and 7 serve smaller sizes only.
    assert placements(3, world=16, ranks_per_node=8) == (0, 3, 8, 11)
    # 64 in an NVL72: one per rack, counted from the rack's first rank (never [64, 128)).
    assert placements(64, world=576, ranks_per_node=72) == tuple(range(0, 576, 72))
    # whole domains aligned to their size, even when the size does not divide the world
    assert placements(216, world=576, ranks_per_node=72) == (0, 216)


@pytest.mark.parametrize(
    ("world", "rpn", "bad"), [(576, 72, 100), (64, 4, 6), (16, 8, 12), (8, 8, 16), (8, 8, 0)]
)
def test_sizes_that_straddle_a_domain_are_refused(world: int, rpn: int, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"\[{bad}\]"):
        check_sizes([1, bad], world=world, ranks_per_node=rpn)
    with pytest.raises(ValueError, match=r"Topology\.group_sizes"):
        Topology(world, rpn, 100, (1, bad))


def test_unknown_menu_kind_names_the_kinds() -> None:
    with pytest.raises(ValueError, match="divisors"):
        menu_sizes("primes", world=8, ranks_per_node=8)


def test_default_menu_is_unchanged_on_power_of_two_machines() -> None:
    for world, rpn in [(64, 8), (16, 4), (8, 8), (4, 8), (32, 2)]:
        legacy = tuple(1 << k for k in range(world.bit_length()) if world % (1 << k) == 0)
        assert Topology(world, rpn, 100).group_sizes == legacy
        for c in legacy:  # the aligned blocks of earlier versions
            assert Topology(world, rpn, 100).placements(c) == tuple(range(0, world, c))


def _plan(world: int = 72, rpn: int = 72) -> StepPlan:
    topo = Topology(world, rpn, 1000, menu_sizes("divisors", world=world, ranks_per_node=rpn))
    groups = (
        Group(0, 36, (MicroBatch((0,)),)),
        Group(36, 9, (MicroBatch((2, 3)),)),
        Group(45, 3, (MicroBatch((4,)),)),
        Group(48, 24, (MicroBatch((1,)),)),
    )
    return StepPlan(topo, (30000, 20000, 3000, 4000, 2000), (Wave(groups),))


def test_menu_plans_validate_and_round_trip_with_the_placement_rule() -> None:
    plan = _plan()
    plan.validate()
    data = json.loads(plan.to_json())
    assert data["schema_version"] == SCHEMA_VERSION and data["topology"]["placement"] == "domain"
    back = StepPlan.from_json(plan.to_json())
    assert back.topology == plan.topology and back.waves == plan.waves


def test_a_group_off_its_blocks_is_refused() -> None:
    plan = _plan()
    bad = (Group(4, 9, (MicroBatch((2,)),)),)  # 9 may start at 0, 9, 18, ... only
    plan = StepPlan(plan.topology, plan.lengths[:3], (Wave(bad), Wave(plan.waves[0].groups[:2])))
    with pytest.raises(PlanError, match="may start at ranks 0, 9, 18") as info:
        plan.validate()
    assert info.value.rule == "group-alignment"


def test_version_3_needs_a_known_placement_rule() -> None:
    data = _plan().to_dict()
    data["topology"]["placement"] = "anywhere"
    with pytest.raises(PlanError, match="placement 'anywhere' not supported"):
        StepPlan.from_dict(data)
    with pytest.raises(ValueError, match="Topology.placement"):
        Topology(8, 8, 10, placement="anywhere")


def test_version_2_plans_still_read_under_the_same_rule() -> None:
    topo = Topology(16, 8, 100)
    plan = StepPlan(topo, (50, 60), (Wave((Group(0, 8, (MicroBatch((0, 1)),)),)),))
    data = plan.to_dict()
    data["schema_version"] = 2
    del data["topology"]["placement"]
    back = StepPlan.from_dict(data)
    back.validate()
    assert back.topology == topo and back.waves == plan.waves


def test_head_splits_beyond_powers_of_two() -> None:
    topo = Topology(
        12, 12, 100, (1, 2, 3, 4, 6, 12), head_sizes=(2, 3, 4), query_heads=12, kv_heads=12
    )
    assert topo.splits(6) == (1, 2, 3) and topo.splits(12) == (1, 2, 3, 4)
    # a head block of 3 ranks in a group of 2 whole domains of 4 would straddle a domain
    wide = Topology(8, 4, 100, (1, 2, 4, 8), head_sizes=(2,), query_heads=6, kv_heads=6)
    assert wide.splits(8) == (1, 2)
    with pytest.raises(ValueError, match="split no allowed group"):
        Topology(8, 4, 100, (1, 2, 4, 8), head_sizes=(3,), query_heads=6, kv_heads=6)


@settings(max_examples=60, deadline=None)
@given(
    machine=st.sampled_from([(72, 72), (144, 72), (64, 4), (96, 6), (16, 8)]),
    kind=st.sampled_from(MENU_KINDS),
    data=st.data(),
)
def test_place_waves_lays_any_groups_on_allowed_blocks(
    machine: tuple[int, int], kind: str, data: st.DataObject
) -> None:
    world, rpn = machine
    topo = Topology(world, rpn, 100, menu_sizes(kind, world=world, ranks_per_node=rpn))
    sizes = data.draw(st.lists(st.sampled_from(list(topo.group_sizes)), max_size=30))
    sizes = sizes[: next((k for k in range(len(sizes)) if sum(sizes[: k + 1]) > world), None)]
    waves = place_waves([(c, [[k]]) for k, c in enumerate(sizes)], topo)
    plan = StepPlan(topo, (1,) * len(sizes), tuple(Wave(w) for w in waves))
    plan.validate()  # every sequence once, every group on an allowed block, waves disjoint
    chain = all(b % a == 0 for a, b in zip(topo.group_sizes, topo.group_sizes[1:]))
    if chain:  # sizes that nest always fit at once
        assert len(waves) <= 1


def test_pool_counts_at_576_ranks_stay_within_3x_of_powers_of_two() -> None:
    pow2 = pool_count(
        menu_sizes("powers-of-two", world=576, ranks_per_node=72), world=576, ranks_per_node=72
    )
    menu = pool_count(
        menu_sizes("divisors", world=576, ranks_per_node=72), world=576, ranks_per_node=72
    )
    # the power-of-two pool before menus: one group per aligned block of 2..64
    legacy_total = sum(576 // c for c in (2, 4, 8, 16, 32, 64))
    assert (pow2.per_rank_max, legacy_total) == (6, 567)
    assert (menu.per_rank_max, menu.total) == (14, 991)
    assert menu.per_rank_max <= 3 * pow2.per_rank_max and menu.total <= 3 * legacy_total
    assert menu.buffer_bytes_per_rank == 14 * 2 * NCCL_BUFFSIZE_BYTES
    both = pool_count(
        menu_sizes("divisors-and-powers-of-two", world=576, ranks_per_node=72),
        world=576,
        ranks_per_node=72,
    )
    assert (both.per_rank_max, both.total) == (17, 1047)
    assert both.per_rank_max <= 3 * pow2.per_rank_max and both.total <= 3 * legacy_total


def test_pool_blocks_with_head_splits() -> None:
    blocks, heads, rings = pool_blocks((1, 6, 12), (1, 2, 3), world=12, ranks_per_node=12)
    assert blocks == [(0, 6), (6, 6), (0, 12)]
    assert heads == [(s, 2) for s in range(0, 12, 2)] + [(s, 3) for s in range(0, 12, 3)]
    assert (0, 6, 2, 1) in rings and (0, 12, 3, 2) in rings and len(rings) == 2 * (2 + 3) + 5
    count = pool_count((1, 6, 12), (1, 2, 3), world=12, ranks_per_node=12)
    assert count.total == len(blocks) + len(heads) + len(rings)
    assert sum(count.per_rank) == sum(c for _, c in blocks + heads) + sum(
        c // u for _, c, u, _ in rings
    )


def _batch(seed: int, capacity: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.integers(50, 3000, size=300)
    long = rng.integers(2 * capacity + 1, 3 * capacity - 6, size=12)  # 3 ranks, not 4
    return np.concatenate([short, long]).astype(np.int64)


@pytest.mark.parametrize(
    ("world", "rpn", "kind"), [(72, 72, "divisors"), (96, 6, "divisors"), (24, 6, "divisors")]
)
def test_the_planner_chooses_from_the_menu(world: int, rpn: int, kind: str) -> None:
    """dyncp's plans on a menu are valid (every block allowed, capacity kept), use sizes beyond
    powers of two, and stay above both lower bounds; Megatron's baseline keeps powers of two."""
    sizes = menu_sizes(kind, world=world, ranks_per_node=rpn)
    model = CostModel.load("h100-reference", rpn)
    capacity = 2048
    lengths = _batch(world, capacity)
    common = dict(world=world, ranks_per_node=rpn, capacity=capacity, group_sizes=sizes)
    plan = Planner(model, **common, deterministic=True, cpsat=None).plan(lengths)
    plan.validate()
    used = {g.size for w in plan.waves for g in w.groups}
    assert used - {1, 2, 4, 8, 16, 32, 64}, used  # a size off the powers of two is chosen
    assert plan.stats["predicted_step_seconds"] >= plan.stats["lower_bound_seconds"] * (1 - 1e-9)
    megatron = Planner(model, **common, policy="megatron")
    if rpn == 6:  # powers of two on 6-GPU nodes stop at 2 in this menu: too small for 3 ranks
        with pytest.raises(ValueError, match="exceed the longest sequence"):
            megatron.plan(lengths)
        return
    mega = megatron.plan(lengths)
    mega.validate()
    assert all(g.size & (g.size - 1) == 0 for w in mega.waves for g in w.groups)
    assert mega.topology == plan.topology


def test_links_for_every_size_of_a_menu() -> None:
    nvl = CostModel.load("h100-reference", 72)
    comm = nvl.profile.communication
    intra = (comm.intra_node.latency_seconds, comm.intra_node.bandwidth_bytes_per_second)
    inter = (comm.inter_node.latency_seconds, comm.inter_node.bandwidth_bytes_per_second)
    for c in (*menu_sizes("divisors", world=576, ranks_per_node=72), 64):
        if c > 1:
            assert nvl.link(c) == (intra if c <= 72 else inter), c
    node4 = CostModel.load("h100-reference", 4)
    assert node4.link(3) == intra and node4.link(12) == inter and node4.link(48) == inter
    table = CostModel.load("cpu-gloo", 8)  # links measured at 2, 4, 8, ...: next larger size
    assert table.link(3) == table.link(4) and table.link(6) == table.link(8)
    assert table.link(12) == table.link(16)


@pytest.mark.parametrize(
    ("world", "rpn", "sizes"),
    [
        (64, 4, (1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64)),
        (72, 72, menu_sizes("divisors-and-powers-of-two", world=72, ranks_per_node=72)),
    ],
)
def test_a_menu_holding_the_powers_of_two_is_never_slower(
    world: int, rpn: int, sizes: tuple[int, ...]
) -> None:
    """Deterministic dyncp on a menu that holds 1..64 also constructs on those powers of two, so
    its plan is never slower than dyncp on powers of two alone, and it is a plan of the menu."""
    model = CostModel.load("h100-reference", rpn)
    common = dict(world=world, ranks_per_node=rpn, capacity=2048, deterministic=True, cpsat=None)
    menu = Planner(model, **common, group_sizes=sizes)
    pow2 = Planner(model, **common, group_sizes=(1, 2, 4, 8, 16, 32, 64))
    assert nested_core(menu.topology) == pow2.topology
    assert nested_core(pow2.topology) is None
    for seed in range(3):
        lengths = _batch(seed, 2048)
        plan = menu.plan(lengths)
        plan.validate()
        assert plan.topology == menu.topology
        assert plan.stats["construction"] in ("menu", "powers-of-two")
        ref = pow2.plan(lengths).stats["predicted_step_seconds"]
        assert plan.stats["predicted_step_seconds"] <= ref * (1 + 1e-12)
