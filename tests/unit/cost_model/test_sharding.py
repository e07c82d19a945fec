"""Full-sharding pass pricing: the prefetch-overlap formula on a hand case, the collectives taken
from a profile, and a plan priced as lockstep passes."""

from __future__ import annotations

import pytest

from dyncp.cost_model import CostModel
from dyncp.cost_model.pass_timing import price_passes
from dyncp.cost_model.sharding import (
    Collective,
    ShardingCost,
    collective_from_profile,
    dtype_bytes,
)
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave

REL = 1e-12


def hand_case(**options: object) -> ShardingCost:
    """Two units of 100 and 300 parameters, bf16 gathers and fp32 gradients:
    gathers a = 1 + 2 * 100 / 100 = 3 and 1 + 2 * 300 / 100 = 7 seconds,
    reduce-scatters s = 2 + 4 * 100 / 400 = 3 and 2 + 4 * 300 / 400 = 5 seconds;
    compute shares 1/4 and 3/4 (by parameters), a quarter of it in the forward."""
    return ShardingCost(
        unit_params=(100, 300),
        gather=Collective(latency_seconds=1.0, bandwidth_bytes_per_second=100.0),
        scatter=Collective(latency_seconds=2.0, bandwidth_bytes_per_second=400.0),
        forward_share=0.25,
        **options,
    )


def test_collectives_of_the_hand_case():
    cost = hand_case()
    assert cost.gather_seconds == pytest.approx((3.0, 7.0), rel=REL)
    assert cost.scatter_seconds == pytest.approx((3.0, 5.0), rel=REL)
    assert cost.unit_compute == pytest.approx((0.25, 0.75), rel=REL)


def test_a_pass_hides_what_its_compute_covers_and_exposes_the_rest():
    # Compute 40 s: forward f = (2.5, 7.5), backward b = (7.5, 22.5).
    # forward  = a1 + max(f1, a2) + f2           = 3 + max(2.5, 7) + 7.5      = 17.5
    # backward = a2 + max(b2, a1) + max(b1, s2) + s1 = 7 + 22.5 + max(7.5, 5) + 3 = 40
    cost = hand_case()
    assert cost.pass_seconds(40.0) == pytest.approx(57.5, rel=REL)
    assert cost.exposed_seconds(40.0) == pytest.approx(17.5, rel=REL)


def test_with_compute_long_enough_only_the_first_gathers_and_last_scatter_are_exposed():
    # Compute 400 s hides every prefetched collective: exposed = a1 + a2 + s1 = 3 + 7 + 3.
    assert hand_case().pass_seconds(400.0) == pytest.approx(413.0, rel=REL)


def test_an_empty_pass_pays_its_collectives_alone():
    # 2 * (3 + 7) + (3 + 5) = 28: two gathers (forward, backward) and one scatter per unit.
    cost = hand_case()
    assert cost.empty_pass_seconds == pytest.approx(28.0, rel=REL)
    assert cost.pass_seconds(0.0) == cost.empty_pass_seconds


def test_pass_seconds_never_decrease_with_compute_and_never_undercut_it():
    cost = hand_case()
    previous = 0.0
    for t in [0.0, 1.0, 5.0, 17.0, 40.0, 100.0, 1000.0]:
        seconds = cost.pass_seconds(t)
        assert seconds >= previous and seconds >= t
        previous = seconds


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"unit_params": ()}, "unit_params"),
        ({"unit_params": (1, -1)}, "unit_params"),
        ({"unit_compute": (0.5, 0.2)}, "unit_compute"),
        ({"forward_share": 1.0}, "forward_share"),
        ({"grad_bytes": 0}, "grad_bytes"),
        ({"gather": 3.0}, "gather"),
    ],
)
def test_bad_configs_name_the_field(options, match):
    base = {
        "unit_params": (100, 300),
        "gather": Collective(latency_seconds=1.0, bandwidth_bytes_per_second=100.0),
        "scatter": Collective(latency_seconds=2.0, bandwidth_bytes_per_second=400.0),
    }
    with pytest.raises(ValueError, match=match):
        ShardingCost(**{**base, **options})


def test_collective_bad_values():
    with pytest.raises(ValueError, match="bandwidth"):
        Collective(latency_seconds=0.0, bandwidth_bytes_per_second=0.0)
    with pytest.raises(ValueError, match="latency"):
        Collective(latency_seconds=-1.0, bandwidth_bytes_per_second=1.0)


def test_collectives_from_the_reference_profile():
    profile = CostModel.load("h100-reference", 8).profile
    comm = profile.communication
    # Inside a node: the profile's fit over measured NCCL all_gathers of 8 H100s.
    eight = next(x for x in comm.all_to_all_links if x.group_size == 8)
    inside = collective_from_profile(profile, world=8, ranks_per_node=8)
    assert inside.latency_seconds == eight.latency_seconds
    assert inside.bandwidth_bytes_per_second == eight.bandwidth_bytes_per_second
    # 64 ranks on 8 nodes: 7 inter-node hops and 56 NVLink hops; every rank receives 63/64 of
    # the buffer over its InfiniBand port.
    ring = collective_from_profile(profile, world=64, ranks_per_node=8)
    latency = 7 * comm.inter_node.latency_seconds + 56 * comm.intra_node.latency_seconds
    assert ring.latency_seconds == pytest.approx(latency, rel=REL)
    bandwidth = comm.inter_node.bandwidth_bytes_per_second * 64 / 63
    assert ring.bandwidth_bytes_per_second == pytest.approx(bandwidth, rel=REL)
    assert collective_from_profile(profile, world=1, ranks_per_node=8).seconds(1e12) == 0.0


def two_rank_plan() -> StepPlan:
    """Rank 0 runs two packs, rank 1 one: two passes, rank 1's second is empty."""
    topo = Topology(2, 2, 8192)
    wave = Wave(
        (
            Group(0, 1, (MicroBatch((0,)), MicroBatch((1,)))),
            Group(1, 1, (MicroBatch((2,)),)),
        )
    )
    return StepPlan(topo, (4000, 1000, 2000), (wave,))


def test_a_plan_priced_as_passes():
    model = CostModel.load("h100-reference", 2)
    plan = two_rank_plan()
    plan.validate()
    a, b, c = (model.microbatch_seconds(1, [s]) for s in (4000, 1000, 2000))
    cost = hand_case()
    priced = price_passes(plan, model, cost)
    assert priced.passes == 2 and priced.empty == 1
    assert priced.pass_compute == pytest.approx((max(a, c), b), rel=REL)
    expected = cost.pass_seconds(max(a, c)) + cost.pass_seconds(b) + model.wave_overhead
    assert priced.step_seconds == pytest.approx(expected, rel=REL)
    free = price_passes(plan, model)  # collectives free: the passes' busiest compute
    assert free.step_seconds == pytest.approx(max(a, c) + b + model.wave_overhead, rel=REL)
    assert free.exposed_seconds == pytest.approx(0.0, abs=1e-12)


def test_for_model_reads_names_and_bytes_and_takes_the_profiles_collectives():
    profile = CostModel.load("h100-reference", 8).profile
    units = (1_000_000, 2_000_000, 2_000_000, 500_000)
    named = ShardingCost.for_model(
        units,
        param_dtype="torch.bfloat16",
        reduce_dtype="float32",
        profile=profile,
        world=64,
        ranks_per_node=8,
    )
    link = collective_from_profile(profile, world=64, ranks_per_node=8)
    assert named.unit_params == units
    assert (named.param_bytes, named.grad_bytes) == (2, 4)
    assert named.gather == named.scatter == link
    assert named.reduce == "every-pass"
    by_bytes = ShardingCost.for_model(
        units, param_dtype=2, reduce_dtype=4, profile=profile, world=64, ranks_per_node=8
    )
    assert by_bytes == named
    assert dtype_bytes("float64") == 8 and dtype_bytes("torch.float16") == 2
    with pytest.raises(ValueError, match="unknown dtype 'int7'"):
        dtype_bytes("int7")
    with pytest.raises(ValueError, match="dtype bytes must be >= 1"):
        dtype_bytes(0)
    with pytest.raises(ValueError, match="ShardingCost.reduce must be one of every-pass, once"):
        ShardingCost.for_model(
            units,
            param_dtype=2,
            reduce_dtype=4,
            profile=profile,
            world=8,
            ranks_per_node=8,
            reduce="never",
        )


def test_reduced_once_only_the_last_pass_reduce_scatters():
    model = CostModel.load("h100-reference", 2)
    plan = two_rank_plan()
    every, once = hand_case(), hand_case(reduce="once")
    priced = price_passes(plan, model, once)
    first, last = priced.pass_compute
    # The hand case without reduce-scatters in pass 1 (s = 0): compute 40 s would give
    # forward 17.5 and backward 7 + 22.5 + max(7.5, 0) + 0 = 37; here by the formula.
    assert once.pass_seconds(40.0, scatter=False) == pytest.approx(17.5 + 37.0, rel=REL)
    expected = once.pass_seconds(first, scatter=False) + once.pass_seconds(last)
    assert priced.step_seconds == pytest.approx(expected + model.wave_overhead, rel=REL)
    assert once.pass_seconds(last) == every.pass_seconds(last)
    assert priced.step_seconds < price_passes(plan, model, every).step_seconds
