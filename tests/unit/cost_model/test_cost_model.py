"""Tests for dyncp.cost_model: profile schema and loading, the CostModel formula and its
properties on the H100 reference profile, plan evaluation and the reference profile builder."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from json_close import assert_json_close

from dyncp.cost_model.evaluate import evaluate_plan
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import (
    PROFILES_DIR,
    Profile,
    ProfileError,
    bundled_profiles,
    load_profile,
)
from dyncp.plan import Group, MicroBatch, StepPlan, Topology, Wave

REFERENCE_SRC = Path("/work/shared/reference/h100-distca")
REF = load_profile("h100-reference")
REF_MODEL = CostModel(REF, ranks_per_node=8)
CPS = [1, 2, 4, 8, 16, 32]


def ref_padded(length: int, cp: int) -> int:
    return length if cp == 1 else math.ceil(length / (2 * cp)) * 2 * cp


def ref_dict() -> dict:
    return json.loads(REF.to_json())


def with_overlap(profile: Profile, overlap: bool) -> Profile:
    comm = profile.communication.model_copy(update={"overlap": overlap})
    return profile.model_copy(update={"communication": comm})


def quadratic_dict(overlap: bool = False, ratio: float = 2.5) -> dict:
    """A profile with round numbers so the formula can be evaluated by hand."""
    data = ref_dict()
    data["name"] = "hand-quadratic"
    data["model"]["num_layers"] = 2
    data["linear_seconds_per_token"] = 1e-5
    data["attention"] = {
        "form": "quadratic",
        "alpha": 1e-9,
        "beta": 1e-6,
        "step_overhead_seconds": 1e-4,
        "backward_forward_ratio": ratio,
    }
    data["communication"] = {
        "kv_bytes_per_token": 1000.0,
        "backward_bytes_factor": 2.0,
        "overlap": overlap,
        "intra_node": {"latency_seconds": 1e-5, "bandwidth_bytes_per_second": 1e9},
        "inter_node": {"latency_seconds": 1e-4, "bandwidth_bytes_per_second": 1e8},
    }
    data["overheads"] = {"microbatch_seconds": 1e-3, "wave_seconds": 2e-3}
    return data


QUAD = Profile.model_validate(quadratic_dict())


# ------------------------------------------------------------------------------------ loading


def test_bundled_profiles_include_reference() -> None:
    bundled = bundled_profiles()
    assert "h100-reference" in bundled
    assert bundled["h100-reference"] == PROFILES_DIR / "h100-reference.json"
    assert REF.name == "h100-reference"
    assert REF.attention.form == "table"


@pytest.mark.parametrize("path", sorted(PROFILES_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_bundled_profile_loads_and_prices(path: Path) -> None:
    by_name = load_profile(path.stem)
    by_path = load_profile(path)
    assert by_name == by_path
    assert by_name.name == path.stem  # the file name is the profile's name
    assert Profile.from_json(by_name.to_json()) == by_name
    model = CostModel(by_name, ranks_per_node=8)
    for cp in (1, 2, 8, 16):
        t = model.microbatch_seconds(cp, [1000, 5000])
        assert math.isfinite(t) and t > 0


def test_load_by_path_outside_bundle(tmp_path: Path) -> None:
    data = quadratic_dict()
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(data))
    assert load_profile(path) == QUAD
    assert load_profile(str(path)) == QUAD
    model = CostModel.load(path, ranks_per_node=4)
    assert model.name == "hand-quadratic"
    assert model.ranks_per_node == 4


def test_unknown_profile_name_lists_bundled() -> None:
    with pytest.raises(ProfileError, match="no-such-profile") as info:
        load_profile("no-such-profile")
    for name in bundled_profiles():
        assert name in str(info.value)


def test_invalid_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    data = ref_dict()
    del data["overheads"]["wave_seconds"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    assert "overheads.wave_seconds" in str(info.value)


def test_profile_json_round_trip() -> None:
    text = REF.to_json()
    again = Profile.from_json(text)
    assert again == REF
    assert again.to_json() == text
    assert Profile.from_json(QUAD.to_json()) == QUAD


def test_profile_is_frozen() -> None:
    with pytest.raises(ValueError, match="frozen"):
        REF.overheads.wave_seconds = 0.0  # type: ignore[misc]


# ------------------------------------------------------------------------------------ bad profiles


def _set(path: str, value: object):
    def mutate(d: dict) -> None:
        *head, last = path.split(".")
        for key in head:
            d = d[key]
        d[last] = value

    return mutate


def _drop(path: str):
    def mutate(d: dict) -> None:
        *head, last = path.split(".")
        for key in head:
            d = d[key]
        del d[last]

    return mutate


def _table(fn):
    def mutate(d: dict) -> None:
        fn(d["attention"])

    return mutate


BAD = {
    "missing-wave-seconds": (_drop("overheads.wave_seconds"), "overheads.wave_seconds", "required"),
    "missing-provenance": (_drop("provenance"), "provenance", "required"),
    "missing-link": (_drop("communication.inter_node"), "communication.inter_node", "required"),
    "extra-field-typo": (_set("overheads.wave_secs", 1e-3), "overheads.wave_secs", "Extra"),
    "extra-top-level": (_set("linear_second_per_token", 1.0), "linear_second_per_token", "Extra"),
    "wrong-type-int": (_set("model.num_layers", "many"), "model.num_layers", "integer"),
    "wrong-type-list": (_set("attention.lengths", "64,128"), "attention.table.lengths", "list"),
    "wrong-type-link": (_set("communication.intra_node", 5.0), "communication.intra_node", ""),
    "negative-overhead": (
        _set("overheads.microbatch_seconds", -1.0),
        "overheads.microbatch_seconds",
        "greater",
    ),
    "negative-linear": (_set("linear_seconds_per_token", -1e-6), "linear_seconds_per_token", ""),
    "zero-bandwidth": (
        _set("communication.inter_node.bandwidth_bytes_per_second", 0.0),
        "communication.inter_node.bandwidth_bytes_per_second",
        "greater",
    ),
    "zero-layers": (_set("model.num_layers", 0), "model.num_layers", "greater"),
    "table-length-mismatch": (
        _table(lambda a: a["seconds"].pop()),
        "attention.table",
        "attention.lengths has 11 entries but attention.seconds has 10",
    ),
    "table-not-increasing": (
        _table(lambda a: a["lengths"].__setitem__(3, a["lengths"][2])),
        "attention.table",
        "attention.lengths must be positive and strictly increasing",
    ),
    "table-decreasing": (
        _table(lambda a: a["lengths"].reverse()),
        "attention.table",
        "strictly increasing",
    ),
    "table-nonpositive-length": (
        _table(lambda a: a["lengths"].__setitem__(0, 0)),
        "attention.table",
        "positive",
    ),
    "table-value-at-overhead": (
        _table(lambda a: a["seconds"].__setitem__(4, a["step_overhead_seconds"])),
        "attention.table",
        "attention.seconds must all exceed attention.step_overhead_seconds",
    ),
    "table-too-short": (
        _table(
            lambda a: (
                a["lengths"].__delitem__(slice(1, None)),
                a["seconds"].__delitem__(slice(1, None)),
            )
        ),
        "attention.table.lengths",
        "",
    ),
    "unknown-form": (_set("attention.form", "cubic"), "attention", "cubic"),
    "schema-version": (_set("schema_version", 3), "schema_version", ""),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_profile_names_the_field(case: str) -> None:
    mutate, field, hint = BAD[case]
    data = ref_dict()
    mutate(data)
    with pytest.raises(ProfileError) as info:
        Profile.from_json(json.dumps(data), origin="bad.json")
    message = str(info.value)
    assert "bad.json" in message
    assert f"{field}: " in message, message
    assert hint in message


def test_quadratic_with_negative_alpha_refused() -> None:
    data = quadratic_dict()
    data["attention"]["alpha"] = -1e-9
    with pytest.raises(ProfileError, match=r"attention\.quadratic\.alpha"):
        Profile.from_json(json.dumps(data))


def test_invalid_json_text() -> None:
    with pytest.raises(ProfileError, match="x.json is not valid JSON"):
        Profile.from_json('{"schema_version": 1,', origin="x.json")
    with pytest.raises(ProfileError, match="invalid"):
        Profile.from_json("[1, 2]")


def test_nan_in_attention_table_refused() -> None:
    data = ref_dict()
    data["attention"]["seconds"][5] = float("nan")
    with pytest.raises(ProfileError, match="attention"):
        Profile.from_json(json.dumps(data))


def test_costmodel_rejects_bad_ranks_per_node() -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        CostModel(REF, ranks_per_node=0)


# ------------------------------------------------------------------------------------ formula


@pytest.mark.parametrize(
    ("cp", "rpn", "lengths", "expected"),
    [
        # cp = 1: lin*T + mb + L*(A(1000) + A(2000) + k) = 0.03 + 0.001 + 2*(2e-3 + 6e-3 + 1e-4)
        (1, 8, [1000, 2000], 0.0472),
        # cp = 2 (intra): 2001 pads to 2004, T = 3004, block = 1000*1502/1e9 = 1.502e-3;
        # per layer 2*(A(500)+A(1002)+k) + (fwd 1.512e-3 + bwd 3.014e-3) + home 1.512e-3
        (2, 8, [1000, 2001], 0.01502 + 0.001 + 2 * 0.011750008),
        # cp = 4 > ranks_per_node = 2: inter link, block = 1000*1000/1e8 = 0.01;
        # per layer 4*(A(1000)+k) + 3*(0.0101 + 0.0201) + 0.0101 = 0.1091
        (4, 2, [4000], 0.01 + 0.001 + 2 * 0.1091),
        # the same group inside a node: block = 1e-3, per layer 0.0084 + 3*3.02e-3 + 1.01e-3
        (4, 4, [4000], 0.01 + 0.001 + 2 * 0.01847),
    ],
)
def test_quadratic_formula_by_hand(cp: int, rpn: int, lengths: list, expected: float) -> None:
    model = CostModel(QUAD, ranks_per_node=rpn)
    assert model.microbatch_seconds(cp, lengths) == pytest.approx(expected, rel=1e-12)
    got = model.alone_seconds(cp, np.asarray(lengths[-1:]))
    assert got[0] == pytest.approx(model.microbatch_seconds(cp, lengths[-1:]), rel=1e-12)


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        # communication exposed: fwd max(7.14001e-4, 1.512e-3), bwd max(2.142003e-3, 3.014e-3)
        ([1000, 2001], 0.01502 + 0.001 + 2 * (2.856004e-3 + 1.512e-3 + 3.014e-3 + 1.512e-3)),
        # compute hides it: step 0.1101 split 1:3, per layer step + step + home 0.01001
        ([20000], 0.1 + 0.001 + 2 * (0.1101 + 0.1101 + 0.01001)),
    ],
)
def test_quadratic_formula_with_overlap_by_hand(lengths: list, expected: float) -> None:
    model = CostModel(Profile.model_validate(quadratic_dict(overlap=True, ratio=3.0)), 8)
    assert model.microbatch_seconds(2, lengths) == pytest.approx(expected, rel=1e-12)


def test_quadratic_attention_seconds() -> None:
    model = CostModel(QUAD, ranks_per_node=8)
    x = np.array([1.0, 10.0, 1000.0])
    np.testing.assert_allclose(model.attention_seconds(x), 1e-9 * x * x + 1e-6 * x, rtol=1e-15)


def test_table_attention_interpolation() -> None:
    table = REF.attention
    k = table.step_overhead_seconds
    lengths = np.asarray(table.lengths, dtype=float)
    net = np.asarray(table.seconds) - k
    # exact at the measured points
    np.testing.assert_allclose(REF_MODEL.attention_seconds(lengths), net, rtol=1e-12)
    # linear below the table, quadratic above it, continuous at both ends
    assert REF_MODEL.attention_seconds(lengths[0] / 4) == pytest.approx(net[0] / 4, rel=1e-12)
    assert REF_MODEL.attention_seconds(lengths[-1] * 3) == pytest.approx(net[-1] * 9, rel=1e-12)
    # log-log interpolation between two points: the geometric mean at the geometric mean
    mid = math.sqrt(lengths[4] * lengths[5])
    assert REF_MODEL.attention_seconds(mid) == pytest.approx(math.sqrt(net[4] * net[5]), rel=1e-9)
    # cp = 1, one sequence at a table length: lin*s + mb + L*(seconds)
    s = int(lengths[6])
    expected = REF.linear_seconds_per_token * s + REF.overheads.microbatch_seconds
    expected += REF.model.num_layers * table.seconds[6]
    assert REF_MODEL.microbatch_seconds(1, [s]) == pytest.approx(expected, rel=1e-12)


def test_link_selection_by_node_size() -> None:
    comm = REF.communication
    intra = (comm.intra_node.latency_seconds, comm.intra_node.bandwidth_bytes_per_second)
    inter = (comm.inter_node.latency_seconds, comm.inter_node.bandwidth_bytes_per_second)
    assert REF_MODEL.link(8) == intra
    assert REF_MODEL.link(16) == inter
    assert CostModel(REF, 16).link(16) == intra


def test_empty_microbatch_costs_nothing() -> None:
    assert REF_MODEL.microbatch_seconds(4, []) == 0.0
    assert REF_MODEL.memory_tokens(4, []) == 0


# ------------------------------------------------------------------------------------ properties


@settings(max_examples=200, deadline=None)
@given(
    cp=st.sampled_from(CPS),
    a=st.integers(1, 300_000),
    b=st.integers(1, 300_000),
)
def test_time_increases_with_length(cp: int, a: int, b: int) -> None:
    short, long = sorted((a, b))
    t_short = REF_MODEL.microbatch_seconds(cp, [short])
    t_long = REF_MODEL.microbatch_seconds(cp, [long])
    if ref_padded(short, cp) < ref_padded(long, cp):
        assert t_short < t_long
    else:
        assert t_short == t_long


@settings(max_examples=100, deadline=None)
@given(
    cp=st.sampled_from(CPS),
    pack=st.lists(st.integers(1, 50_000), min_size=1, max_size=8),
    extra=st.integers(1, 50_000),
)
def test_adding_a_sequence_adds_time(cp: int, pack: list[int], extra: int) -> None:
    assert REF_MODEL.microbatch_seconds(cp, [*pack, extra]) > REF_MODEL.microbatch_seconds(cp, pack)


def test_long_sequence_speeds_up_with_cp() -> None:
    times = [REF_MODEL.microbatch_seconds(cp, [65536]) for cp in (1, 2, 4, 8)]
    assert all(b < a for a, b in zip(times, times[1:])), times
    # attention dominates at 64k: cp = 8 is well over twice as fast as cp = 1
    assert times[-1] < times[0] / 2


def test_short_pack_pays_for_the_ring() -> None:
    one = [512] * 16  # 8192 tokens on one rank
    eight = [512] * 128  # 8192 tokens per rank on eight ranks
    assert REF_MODEL.memory_tokens(1, one) == REF_MODEL.memory_tokens(8, eight) == 8192
    assert REF_MODEL.microbatch_seconds(8, eight) > REF_MODEL.microbatch_seconds(1, one)


@pytest.mark.parametrize("lengths", [[131072], [512] * 256, [20000, 3000, 100]])
def test_node_cliff(lengths: list[int]) -> None:
    across = CostModel(REF, ranks_per_node=8)
    within = CostModel(REF, ranks_per_node=16)
    assert across.microbatch_seconds(16, lengths) > within.microbatch_seconds(16, lengths)
    # groups that fit in both node sizes cost the same
    assert across.microbatch_seconds(8, lengths) == within.microbatch_seconds(8, lengths)


@settings(max_examples=150, deadline=None)
@given(
    cp=st.sampled_from(CPS),
    rpn=st.sampled_from([1, 4, 8]),
    lengths=st.lists(st.integers(1, 200_000), min_size=1, max_size=6),
    quadratic=st.booleans(),
)
def test_overlap_never_slower(cp: int, rpn: int, lengths: list[int], quadratic: bool) -> None:
    base = QUAD if quadratic else REF
    on = CostModel(with_overlap(base, True), rpn)
    off = CostModel(with_overlap(base, False), rpn)
    assert on.overlap and not off.overlap
    t_on = on.microbatch_seconds(cp, lengths)
    t_off = off.microbatch_seconds(cp, lengths)
    assert t_on <= t_off * (1 + 1e-12)
    if cp == 1:
        assert t_on == t_off
    else:  # there are ring steps to overlap: strictly faster
        assert t_on < t_off


@settings(max_examples=150, deadline=None)
@given(
    cp=st.sampled_from(CPS),
    lengths=st.lists(st.integers(1, 100_000), min_size=0, max_size=10),
)
def test_memory_tokens(cp: int, lengths: list[int]) -> None:
    expected = math.ceil(sum(ref_padded(s, cp) for s in lengths) / cp)
    assert REF_MODEL.memory_tokens(cp, lengths) == expected
    assert REF_MODEL.memory_tokens(cp, np.asarray(lengths, dtype=np.int64)) == expected
    topo = Topology(world=32, ranks_per_node=8, capacity=10**9)
    assert topo.memory_tokens(lengths, cp) == expected


@settings(max_examples=100, deadline=None)
@given(
    cp=st.sampled_from(CPS),
    lengths=st.lists(st.integers(1, 300_000), min_size=1, max_size=12),
    quadratic=st.booleans(),
    overlap=st.booleans(),
)
def test_alone_and_work_agree_with_microbatch(
    cp: int, lengths: list[int], quadratic: bool, overlap: bool
) -> None:
    model = CostModel(with_overlap(QUAD if quadratic else REF, overlap), ranks_per_node=8)
    arr = np.asarray(lengths, dtype=np.int64)
    alone = model.alone_seconds(cp, arr)
    work = model.work_rank_seconds(cp, arr)
    assert alone.shape == work.shape == arr.shape
    for i, s in enumerate(lengths):
        single = model.microbatch_seconds(cp, [s])
        assert alone[i] == pytest.approx(single, rel=1e-12)
        assert 0 < work[i] <= cp * single
    # a pack is cheaper than its sequences run one by one (shared constants), never cheaper
    # than the sequences' work spread over the group
    if len(lengths) > 1:
        pack = model.microbatch_seconds(cp, lengths)
        assert pack < alone.sum()
        assert pack * cp >= work.sum() * (1 - 1e-12)


# ------------------------------------------------------------------------------------ evaluate


def test_evaluate_plan_by_hand() -> None:
    topo = Topology(world=4, ranks_per_node=4, capacity=100_000)
    lengths = (30000, 20000, 5000, 700, 60000, 1000)
    plan = StepPlan(
        topology=topo,
        lengths=lengths,
        waves=(
            Wave(
                (
                    Group(0, 2, (MicroBatch((0,)), MicroBatch((1, 3)))),
                    Group(2, 1, (MicroBatch((2,)),)),
                )
            ),
            Wave((Group(0, 4, (MicroBatch((4, 5)),)),)),
        ),
    )
    plan.validate()
    model = CostModel(REF, ranks_per_node=4)
    t0 = model.microbatch_seconds(2, [30000])
    t13 = model.microbatch_seconds(2, [20000, 700])
    t2 = model.microbatch_seconds(1, [5000])
    t45 = model.microbatch_seconds(4, [60000, 1000])
    wave_oh = REF.overheads.wave_seconds

    cost = evaluate_plan(plan, model)
    assert cost.microbatch_seconds == ((t0, t13, t2), (t45,))
    assert cost.wave_seconds == pytest.approx((max(t0 + t13, t2) + wave_oh, t45 + wave_oh))
    assert cost.step_seconds == pytest.approx(max(t0 + t13, t2) + t45 + 2 * wave_oh, rel=1e-12)
    busy = [t0 + t13 + t45, t0 + t13 + t45, t2 + t45, t45]  # rank 3 idle in wave 0
    np.testing.assert_allclose(cost.rank_busy_seconds, busy, rtol=1e-12)
    mean = sum(busy) / 4
    assert cost.imbalance == pytest.approx(max(busy) / mean, rel=1e-12)
    assert cost.imbalance > 1
    assert cost.efficiency == pytest.approx(mean / cost.step_seconds, rel=1e-12)
    assert cost.rank_busy_seconds.max() <= cost.step_seconds


def test_evaluate_empty_plan() -> None:
    plan = StepPlan(topology=Topology(world=2, ranks_per_node=2, capacity=10), lengths=(), waves=())
    cost = evaluate_plan(plan, REF_MODEL)
    assert cost.step_seconds == 0.0
    assert cost.imbalance == 1.0 and cost.efficiency == 1.0


# ------------------------------------------------------------------------------------ reference


@pytest.mark.skipif(not REFERENCE_SRC.is_dir(), reason=f"{REFERENCE_SRC} not available")
def test_reference_builder_reproduces_bundled_profile() -> None:
    from dyncp.cost_model.reference import build_reference_profile

    built = build_reference_profile(REFERENCE_SRC).model_dump()
    bundled = copy.deepcopy(REF.model_dump())
    assert built["provenance"].pop("date")
    assert bundled["provenance"].pop("date")
    assert_json_close(built, bundled)
