"""Hybrid head x ring pricing (issue 15's cost model): a group of c = u x r ranks, ``heads=u``.

Formulas against hand computations, ``heads=1`` bit for bit against the pricing before the split
existed, the protocol's contract for every valid (c, u), the errors, the schema's
``all_to_all_links`` and the H100 reference's all-to-all figures against the NCCL data.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from json_close import assert_json_close

from dyncp.cost_model.calibration.fit import Measurement, fit_profile
from dyncp.cost_model.distca import fit_all_to_all
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.protocol import CostModelProtocol
from dyncp.cost_model.reference import (
    INTER_NODE_BW,
    INTER_NODE_LATENCY,
    build_reference_profile,
)
from dyncp.cost_model.schema import Profile, ProfileError, load_profile

SRC = Path("/work/shared/reference/h100-distca")
needs_src = pytest.mark.skipif(not SRC.is_dir(), reason=f"{SRC} not available")


def _base(**over: object) -> dict:
    """A profile with round numbers (8 query heads, 2 KV heads, head dim 4, 2-byte dtype)."""
    data = {
        "schema_version": 1,
        "name": "hand",
        "description": "round numbers for hand computation",
        "provenance": {"source": "test", "device": "none", "date": "2026-11-30", "method": "-"},
        "model": {
            "name": "hand",
            "num_layers": 2,
            "hidden_size": 32,
            "num_heads": 8,
            "num_kv_heads": 2,
            "head_dim": 4,
            "ffn_hidden_size": 64,
            "vocab_size": 100,
            "dtype_bytes": 2,
        },
        "linear_seconds_per_token": 1e-5,
        "attention": {
            "form": "quadratic",
            "alpha": 1e-9,
            "beta": 1e-6,
            "step_overhead_seconds": 1e-4,
            "backward_forward_ratio": 3.0,
            "sequence_overhead_seconds": 1e-6,
        },
        "communication": {
            "kv_bytes_per_token": 32.0,
            "backward_bytes_factor": 2.0,
            "overlap": False,
            "intra_node": {"latency_seconds": 1e-5, "bandwidth_bytes_per_second": 1e7},
            "inter_node": {"latency_seconds": 1e-4, "bandwidth_bytes_per_second": 1e6},
        },
        "overheads": {"microbatch_seconds": 1e-3, "wave_seconds": 2e-3},
    }
    for path, value in over.items():
        *head, last = path.split("__")
        d = data
        for key in head:
            d = d[key]
        d[last] = value
    return data


LINKS = [
    {"latency_seconds": 2e-5, "bandwidth_bytes_per_second": 3e7, "group_size": 2},
    {"latency_seconds": 3e-5, "bandwidth_bytes_per_second": 2e7, "group_size": 4},
    {"latency_seconds": 1e-4, "bandwidth_bytes_per_second": 1e6, "group_size": 16},
]
# heads == 1 goldens were recorded on these before hybrid pricing existed: every branch of the
# ring and all-to-all formulas (quadratic attention only: exact arithmetic on every CPU).
GOLDEN_PROFILES = {
    "quadratic": _base(),
    "quadratic-overlap": _base(communication__overlap=True),
    "overlap-links": _base(communication__overlap=True, communication__links=LINKS),
    "unpadded-links": _base(communication__links=LINKS, padding={"multiple_per_rank": 0}),
    "all-to-all": _base(communication__kind="all_to_all", communication__links=LINKS),
}


def model_of(data: dict, ranks_per_node: int = 4) -> CostModel:
    return CostModel(Profile.model_validate(data), ranks_per_node=ranks_per_node)


# ------------------------------------------------------------------------------ heads == 1
PACKS = [[1], [7, 300], [1000, 2001, 5], [4096, 64, 64, 8000]]
GOLDEN = {  # sha256 of every value below as float.hex, recorded before hybrid pricing existed
    "quadratic": "b81c9b516c5ffb92",
    "quadratic-overlap": "d6147e8f7a039e4b",
    "overlap-links": "859db4a4f63e6cf6",
    "unpadded-links": "bf7170d55ccfebbc",
    "all-to-all": "8876d9d149f5fbee",
}


def _digest(model: CostModel, **heads: int) -> str:
    arr = np.concatenate([np.asarray(p) for p in PACKS])
    starts = np.cumsum([0] + [len(p) for p in PACKS[:-1]])
    vals: list[float] = []
    for c in (1, 2, 4, 8, 16):
        vals += [model.microbatch_seconds(c, p, **heads) for p in PACKS]
        vals += model.packs_seconds(c, arr, starts, **heads).tolist()
        vals += model.alone_seconds(c, arr, **heads).tolist()
        vals += model.marginal_seconds(c, arr, **heads).tolist()
        vals += model.work_rank_seconds(c, arr, **heads).tolist()
        vals += model.bound_rank_seconds(c, arr, **heads).tolist()
        vals += [model.fixed_seconds(c, **heads)]
    text = " ".join(float(v).hex() for v in vals)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_heads_one_is_bit_identical_to_the_ring_pricing(name: str) -> None:
    model = model_of(GOLDEN_PROFILES[name])
    assert _digest(model) == GOLDEN[name]
    assert _digest(model, heads=1) == GOLDEN[name]
    # all_to_all_links change nothing at heads = 1
    with_links = json.loads(json.dumps(GOLDEN_PROFILES[name]))
    if with_links["communication"].get("kind") != "all_to_all":
        with_links["communication"]["all_to_all_links"] = [
            {"group_size": 2, "latency_seconds": 1.0, "bandwidth_bytes_per_second": 1.0}
        ]
        assert _digest(model_of(with_links)) == GOLDEN[name]


# ------------------------------------------------------------------------------ by hand
# A(x) = 1e-9 x^2 + 1e-6 x + 1e-6 (per sequence); k = 1e-4; lin = 1e-5; 2 layers; 1 ms per
# micro-batch; 8 query heads, 2 KV heads, head dim 4, 2 bytes: kv_bytes_per_token 32 and an
# exchange of b = (2*8 + 2*max(2, u)) * 4 * 2 bytes per token a layer each way.
A2A_LINKS = [
    {"group_size": 2, "latency_seconds": 5e-6, "bandwidth_bytes_per_second": 5e7},
    {"group_size": 8, "latency_seconds": 7e-6, "bandwidth_bytes_per_second": 4e7},
]


@pytest.mark.parametrize(
    ("c", "u", "rpn", "overlap", "ratio", "a2a", "lengths", "expected"),
    [
        # c=4 = 2x2 in a node, no overlap. 2001 pads to 2008, T = 3008. linear 7.52e-3.
        # step: (A(500) + A(1004)) / 2 + k = (7.51e-4 + 2.013016e-3) / 2 + 1e-4 = 1.482008e-3.
        # ring block: 32 * (2/2/2) * 3008 / 2 / 1e7 = 2.4064e-3; fwd 2.4164e-3, bwd 4.8228e-3,
        # home 2.4164e-3: layer 2 * step + (fwd + bwd) + home = 1.2619616e-2.
        # a2a derived from link(2): 1e-5 s, 1e7 * 2 = 2e7 B/s, b = 160:
        # 4e-5 + 2 * 160 * 3008 / 4 / 2e7 = 1.2072e-2.
        (4, 2, 4, False, 3.0, [], [1000, 2001], 7.52e-3 + 1e-3 + 2 * (1.2619616e-2 + 1.2072e-2)),
        # c=8 = 8x1 across nodes of 4: no ring; 1000 pads to 1008; linear 1.26e-3.
        # step A(1008) / 8 + k = 2.025064e-3 / 8 + 1e-4 = 3.53133e-4.
        # a2a derived from link(8) = inter: 1e-4 s, 1e6 * 8 / 7 B/s; b = (16 + 16) * 8 = 256:
        # 4e-4 + 2 * 256 * 1008 / 8 / (8e6 / 7) = 5.6848e-2.
        (8, 8, 4, False, 3.0, [], [1000], 1.26e-3 + 1e-3 + 2 * (3.53133e-4 + 5.6848e-2)),
        # c=8 = 2x4, ring across nodes of 4 (link(8) inter: 1e-4 s, 1e6 B/s), overlap, fwd 1/4.
        # T = 20000, linear 0.025. step A(5000) / 2 + k = 0.030001 / 2 + 1e-4 = 0.0151005.
        # block 16 * 20000 / 4 / 1e6 = 0.08: fwd max(0.003775125, 0.0801), bwd max(0.011325375,
        # 0.1601), 3 steps + step + home 0.0801: layer 0.8158005.
        # a2a listed for 2: 4 * 5e-6 + 2 * 160 * 20000 / 8 / 5e7 = 0.01602.
        (8, 2, 4, True, 3.0, A2A_LINKS, [20000], 0.025 + 1e-3 + 2 * (0.8158005 + 0.01602)),
        # c=4 = 2x2 in a node of 8, overlap: step A(10000) / 2 + k = 0.0551005; block 0.016:
        # fwd max(0.013775125, 0.01601) = 0.01601, bwd max(0.041325375, 0.03201) = 0.041325375;
        # layer step + (fwd + bwd) + home 0.01601 = 0.128445875.
        # a2a listed: 2e-5 + 2 * 160 * 20000 / 4 / 5e7 = 0.03202.
        (4, 2, 8, True, 3.0, A2A_LINKS, [20000], 0.05 + 1e-3 + 2 * (0.128445875 + 0.03202)),
        # c=8 = 4x2 in a node of 8, a2a of 4 takes the next larger listed size (8: 7e-6 s, 4e7);
        # held max(2, 4) = 4 KV heads, share 4/4/2 = 1/2, b = (16 + 8) * 8 = 192.
        # 3000 pads to 3008, T = 3008; linear 3.76e-3; step A(1504) / 4 + k
        # = (2.262016e-3 + 1.504e-3 + 1e-6) / 4 + 1e-4 = 1.041754e-3.
        # block 16 * 3008 / 2 / 1e7 = 2.4064e-3; no overlap: 2 * step + 3 * 2.4064e-3 + 1e-5 * 2
        # + home 2.4164e-3 = 1.1739108e-2; a2a 2.8e-5 + 2 * 192 * 3008 / 8 / 4e7 = 3.6376e-3.
        (8, 4, 8, False, 3.0, A2A_LINKS, [3000], 3.76e-3 + 1e-3 + 2 * (1.1739108e-2 + 3.6376e-3)),
    ],
)
def test_hybrid_formula_by_hand(
    c: int, u: int, rpn: int, overlap: bool, ratio: float, a2a: list, lengths: list, expected: float
) -> None:
    data = _base(communication__overlap=overlap, communication__all_to_all_links=a2a)
    data["attention"]["backward_forward_ratio"] = ratio
    model = model_of(data, rpn)
    assert model.microbatch_seconds(c, lengths, heads=u) == pytest.approx(expected, rel=1e-12)
    alone = model.alone_seconds(c, np.asarray(lengths[-1:]), heads=u)[0]
    assert alone == pytest.approx(model.microbatch_seconds(c, lengths[-1:], heads=u), rel=1e-12)


def test_the_other_members_by_hand() -> None:
    """The first case above (c=4 = 2x2, no overlap): marginal, work, fixed, bound."""
    model = model_of(_base())
    one = np.asarray([1000])
    # marginal: lin 2.5e-3 + 2 layers x (2 steps x A(500)/2 = 7.51e-4, exchange 2 * 160 * 1000
    # / 4 / 2e7 = 4e-3, ring (2-1) x (1+2) x 8e-4 = 2.4e-3)
    assert model.marginal_seconds(4, one, heads=2)[0] == pytest.approx(
        2.5e-3 + 2 * (7.51e-4 + 4e-3 + 2.4e-3), rel=1e-12
    )
    # work: (lin 1e-2) + 2 layers x 4 ranks x 2 steps x 3.755e-4
    assert model.work_rank_seconds(4, one, heads=2)[0] == pytest.approx(1.6008e-2, rel=1e-12)
    # fixed: 1e-3 + 2 x (2 steps x k + (2*2-1) ring latencies + 4 a2a latencies)
    assert model.fixed_seconds(4, heads=2) == pytest.approx(1e-3 + 2 * 2.7e-4, rel=1e-12)
    # bound: work + 4 ranks x 2 layers x (exchange 4e-3 + (1 x 3 + 1) x 8e-4 ring)
    assert model.bound_rank_seconds(4, one, heads=2)[0] == pytest.approx(
        1.6008e-2 + 8 * (4e-3 + 3.2e-3), rel=1e-12
    )


def test_single_kv_head_moves_whole_kv_blocks() -> None:
    """kv = 1 < u = 2: the KV head is replicated, each ring moves all of kv_bytes_per_token, the
    exchange carries 2 KV heads. c=4 = 2x2, 1000 tokens: step A(500)/2 + k = 4.755e-4, block
    32 * 1 * 1000 / 2 / 1e7 = 1.6e-3, b = (16 + 4) * 8 = 160."""
    model = model_of(_base(model__num_kv_heads=1))
    ring = 2 * 4.755e-4 + (1e-5 + 1.6e-3 + 1e-5 + 3.2e-3) + (1e-5 + 1.6e-3)
    a2a = 4e-5 + 2 * 160 * 1000 / 4 / 2e7
    expected = 2.5e-3 + 1e-3 + 2 * (ring + a2a)
    assert model.microbatch_seconds(4, [1000], heads=2) == pytest.approx(expected, rel=1e-12)


def test_head_split_constants() -> None:
    model = model_of(_base(communication__all_to_all_links=A2A_LINKS), ranks_per_node=4)
    s = model.head_split(16, 4)
    assert (s.ranks, s.heads, s.ring) == (16, 4, 4)
    assert s.ring_latency == 1e-4  # the ring spans 16 > 4 ranks: the node cliff
    assert s.ring_seconds_per_token == pytest.approx(32 * 0.5 / 4 / 1e6, rel=1e-15)
    assert s.exchange_latency == pytest.approx(4 * 7e-6, rel=1e-15)
    assert s.exchange_seconds_per_token == pytest.approx(2 * 192 / 16 / 4e7, rel=1e-15)
    assert model.head_split(8, 8).ring_latency == 0.0  # no ring
    assert model.head_split(8, 8).ring_seconds_per_token == 0.0


def test_all_to_all_link_rules() -> None:
    listed = model_of(_base(communication__all_to_all_links=A2A_LINKS), ranks_per_node=4)
    assert listed.all_to_all_link(2) == (5e-6, 5e7)
    assert listed.all_to_all_link(4) == (7e-6, 4e7)  # next larger listed
    # 8 ranks cross nodes of 4: the slower of the listed link and the inter-node one.
    assert listed.all_to_all_link(8) == (1e-4, 1e6 * 8 / 7)
    in_node = model_of(_base(communication__all_to_all_links=A2A_LINKS), ranks_per_node=8)
    assert in_node.all_to_all_link(8) == (7e-6, 4e7)
    with pytest.raises(ValueError, match=r"sizes \[2, 8\]; none covers a head group of 16"):
        listed.all_to_all_link(16)
    derived = model_of(_base(), ranks_per_node=4)
    assert derived.all_to_all_link(2) == (1e-5, 1e7 * 2 / 1)
    assert derived.all_to_all_link(4) == (1e-5, 1e7 * 4 / 3)
    assert derived.all_to_all_link(8) == (1e-4, 1e6 * 8 / 7)  # across nodes of 4
    with pytest.raises(ValueError, match="at least 2 ranks, got 1"):
        derived.all_to_all_link(1)


def test_head_split_is_cheaper_where_the_ring_crosses_nodes() -> None:
    """A long sequence over 16 ranks in nodes of 8 on the H100 reference: rings of 2 (heads 8
    inside a node) beat the 16-rank ring that pays InfiniBand on each of its 15 steps."""
    model = CostModel.load("h100-reference", ranks_per_node=8)
    ring = model.microbatch_seconds(16, [131072])
    split = model.microbatch_seconds(16, [131072], heads=8)
    assert split < ring


# ------------------------------------------------------------------------------ contract
def _valid_splits(query: int, kv: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    return [
        (c, u)
        for c in sizes
        for u in range(1, c + 1)
        if c % u == 0 and query % u == 0 and (kv % u == 0 or u % kv == 0)
    ]


CONTRACT_PROFILES = {
    "hand-overlap": (_base(communication__overlap=True), 4),
    "hand-no-overlap": (_base(), 4),
    "hand-mqa-links": (
        _base(
            model__num_kv_heads=1,
            communication__links=LINKS,
            communication__all_to_all_links=A2A_LINKS
            + [{"group_size": 16, "latency_seconds": 1e-4, "bandwidth_bytes_per_second": 2e6}],
        ),
        8,
    ),
    "hand-gqa-unpadded": (
        _base(model__num_kv_heads=4, padding={"multiple_per_rank": 0}, communication__overlap=True),
        2,
    ),
}


def _check_contract(model: CostModel, c: int, u: int, lengths: list[int], extra: int) -> None:
    arr = np.asarray(lengths)
    t = model.microbatch_seconds(c, arr, heads=u)
    tol = 1e-12 * t
    assert model.microbatch_seconds(c, lengths + [extra], heads=u) >= t - tol  # 1: monotone
    fixed = model.fixed_seconds(c, heads=u)
    split = fixed + model.bound_rank_seconds(c, arr, heads=u).sum() / c
    assert t >= split - tol  # 2: the additive bound
    if not model.overlap or c == u:  # nothing overlapped: the split is exact
        assert t == pytest.approx(split, rel=1e-12)
    alone = model.alone_seconds(c, arr, heads=u)
    for s, a in zip(lengths, alone):  # 3
        assert a == pytest.approx(model.microbatch_seconds(c, [s], heads=u), rel=1e-12)
    work = model.work_rank_seconds(c, arr, heads=u)
    assert ((work >= 0) & (work <= model.bound_rank_seconds(c, arr, heads=u) * (1 + 1e-12))).all()
    assert fixed >= model.fixed_seconds(1) >= model.microbatch_overhead
    packs = [lengths, [extra], lengths[:1] + [extra]]
    flat = np.concatenate([np.asarray(p) for p in packs])
    starts = np.cumsum([0] + [len(p) for p in packs[:-1]])
    got = model.packs_seconds(c, flat, starts, heads=u)  # 5
    for p, g in zip(packs, got):
        assert g == pytest.approx(model.microbatch_seconds(c, p, heads=u), rel=1e-12)
    assert (model.marginal_seconds(c, arr, heads=u) > 0).all()


@pytest.mark.parametrize("name", sorted(CONTRACT_PROFILES))
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60_000), min_size=1, max_size=6),
    extra=st.integers(1, 60_000),
)
def test_contract_for_every_split(name: str, lengths: list[int], extra: int) -> None:
    data, rpn = CONTRACT_PROFILES[name]
    model = model_of(data, rpn)
    assert isinstance(model, CostModelProtocol)
    shape = model.profile.model
    for c, u in _valid_splits(shape.num_heads, shape.num_kv_heads, (1, 2, 4, 8, 16)):
        _check_contract(model, c, u, lengths, extra)


@pytest.mark.parametrize("name", ["h100-reference", "h100-analytic", "cpu-gloo"])
@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200_000), min_size=1, max_size=6),
    extra=st.integers(1, 200_000),
)
def test_bundled_profiles_keep_the_contract_for_every_split(
    name: str, lengths: list[int], extra: int
) -> None:
    model = CostModel.load(name, ranks_per_node=8)
    shape = model.profile.model
    listed = max(link.group_size for link in model.profile.communication.all_to_all_links)
    for c, u in _valid_splits(shape.num_heads, shape.num_kv_heads, (1, 2, 4, 8, 16, 32, 64)):
        if u <= listed:  # cpu-gloo measured head groups of 2 only (2 processes)
            _check_contract(model, c, u, lengths, extra)


def test_split_memory_is_the_ring_of_c() -> None:
    model = model_of(_base())
    assert model.memory_tokens(8, [1000, 17]) == (1008 + 32) // 8


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kv", "c", "u", "message"),
    [
        (2, 4, 3, "heads 3 must divide the group size 4"),
        (2, 16, 16, "heads 16 must divide the model's 8 query heads"),
        (2, 4, 0, "heads must be a positive integer, got 0"),
        (2, 4, -2, "heads must be a positive integer, got -2"),
        (2, 4, 2.0, "heads must be a positive integer, got 2.0"),
        (3, 4, 2, "heads 2 and the model's 3 KV heads: the KV heads must be a multiple"),
        (3, 8, 4, "heads 4 and the model's 3 KV heads"),
    ],
)
def test_bad_splits_name_the_values(kv: int, c: int, u: object, message: str) -> None:
    model = model_of(_base(model__num_kv_heads=kv))
    arr = np.asarray([100, 200])
    calls = [
        lambda: model.microbatch_seconds(c, arr, heads=u),
        lambda: model.microbatch_seconds(c, [], heads=u),
        lambda: model.packs_seconds(c, arr, np.asarray([0]), heads=u),
        lambda: model.alone_seconds(c, arr, heads=u),
        lambda: model.marginal_seconds(c, arr, heads=u),
        lambda: model.work_rank_seconds(c, arr, heads=u),
        lambda: model.fixed_seconds(c, heads=u),
        lambda: model.bound_rank_seconds(c, arr, heads=u),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            call()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("published-flexsp", "communication.kind 'all_to_all'"),
        ("h100-falcon-h1-7b-like", "has a layer_mix"),
    ],
)
def test_profiles_that_cannot_split_refuse(name: str, message: str) -> None:
    model = CostModel.load(name, ranks_per_node=8)
    arr = np.asarray([1000, 3000])
    for call in (
        lambda: model.microbatch_seconds(4, arr, heads=2),
        lambda: model.packs_seconds(4, arr, np.asarray([0]), heads=2),
        lambda: model.alone_seconds(4, arr, heads=2),
        lambda: model.marginal_seconds(4, arr, heads=2),
        lambda: model.work_rank_seconds(4, arr, heads=2),
        lambda: model.fixed_seconds(4, heads=2),
        lambda: model.bound_rank_seconds(4, arr, heads=2),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    assert model.microbatch_seconds(4, arr, heads=1) == model.microbatch_seconds(4, arr)


# ------------------------------------------------------------------------------ schema
def test_all_to_all_links_round_trip_and_validation() -> None:
    data = _base(communication__all_to_all_links=A2A_LINKS)
    profile = Profile.model_validate(data)
    assert Profile.from_json(profile.to_json()) == profile
    assert json.loads(profile.to_json())["communication"]["all_to_all_links"] == A2A_LINKS
    unsorted = _base(communication__all_to_all_links=A2A_LINKS[::-1])
    with pytest.raises(ProfileError, match="all_to_all_links must be sorted"):
        Profile.from_json(json.dumps(unsorted))
    one = _base(communication__all_to_all_links=[{**A2A_LINKS[0], "group_size": 1}])
    with pytest.raises(ProfileError, match="all_to_all_links.0.group_size"):
        Profile.from_json(json.dumps(one))
    a2a_kind = _base(communication__kind="all_to_all", communication__all_to_all_links=A2A_LINKS)
    with pytest.raises(ProfileError, match="kind 'all_to_all' profile lists its exchange in links"):
        Profile.from_json(json.dumps(a2a_kind))


def test_profiles_without_the_field_keep_their_json() -> None:
    """An empty all_to_all_links is left out, so a file written before the field existed is
    written again byte for byte."""
    text = load_profile("h100-reference").to_json()
    old = json.loads(text)
    del old["communication"]["all_to_all_links"]
    old_text = json.dumps(old, indent=2) + "\n"
    profile = Profile.from_json(old_text)
    assert profile.communication.all_to_all_links == []
    assert profile.to_json() == old_text
    assert "all_to_all_links" not in load_profile("cpu-gloo-4proc").to_json()


def test_calibration_carries_the_links_through() -> None:
    profile = Profile.model_validate(_base(communication__all_to_all_links=A2A_LINKS))
    model = CostModel(profile, ranks_per_node=4)
    rng = np.random.default_rng(0)
    ms = []
    for i in range(24):
        cp = (1, 2, 4)[i % 3]
        lengths = tuple(int(x) for x in rng.integers(100, 3000, size=3))
        ms.append(Measurement(cp, lengths, 1.2 * model.microbatch_seconds(cp, lengths)))
    fitted = fit_profile(profile, ms, ranks_per_node=4).profile
    assert fitted.linear_seconds_per_token != profile.linear_seconds_per_token
    assert fitted.communication.all_to_all_links == profile.communication.all_to_all_links


# ------------------------------------------------------------------------------ reference
def _all_gather_rows() -> list[dict[str, str]]:
    with (SRC / "nccl_perf.csv").open(newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["op"] == "all_gather"]


@needs_src
def test_reference_all_to_all_follows_the_all_gather_rows() -> None:
    """Each fit predicts every all_gather row of its GPU count within its stated error (at most
    15%), and its bandwidth is the all-gather's algorithm bandwidth at the largest message
    within 10%."""
    fits = fit_all_to_all(SRC)
    assert sorted(fits) == [2, 4, 8]
    rows = _all_gather_rows()
    for n, (latency, bandwidth, err) in fits.items():
        mine = [r for r in rows if int(r["ngpu"]) == n]
        assert err <= 0.15 and 0 <= latency < 1e-4
        for r in mine:
            t = float(r["t_us_out"]) * 1e-6
            predicted = latency + float(r["size_bytes"]) / bandwidth
            assert abs(predicted / t - 1) <= err + 1e-12
        largest = max(mine, key=lambda r: float(r["size_bytes"]))
        algbw = float(largest["size_bytes"]) / (float(largest["t_us_out"]) * 1e-6)
        assert bandwidth == pytest.approx(algbw, rel=0.10)
        assert float(largest["algbw_out_gbs"]) * 1e9 == pytest.approx(algbw, rel=0.01)


@needs_src
@pytest.mark.parametrize("name", ["h100-reference", "h100-analytic", "h100-megatron-dcp-gpt"])
def test_bundled_reference_all_to_all_links(name: str) -> None:
    profile = load_profile(name)
    links = {link.group_size: link for link in profile.communication.all_to_all_links}
    fits = fit_all_to_all(SRC)
    for n in (2, 4, 8):
        assert links[n].latency_seconds == pytest.approx(fits[n][0], rel=1e-12)
        assert links[n].bandwidth_bytes_per_second == pytest.approx(fits[n][1], rel=1e-12)
    inter = sorted(u for u in links if u > 8)
    heads = profile.model.num_heads
    assert inter and inter[-1] >= heads and inter[-1] // 2 < heads  # covers every head group
    for u in inter:
        assert links[u].latency_seconds == INTER_NODE_LATENCY
        assert links[u].bandwidth_bytes_per_second == pytest.approx(
            INTER_NODE_BW * u / (u - 1), rel=1e-12
        )
    names = " ".join(a.name for a in profile.provenance.assumptions)
    assert "all-to-all inside a node" in names and "all-to-all across nodes" in names
    assert any("all_gather" in str(a.value) for a in profile.provenance.assumptions)
    built = build_reference_profile(SRC, analytic=name == "h100-analytic", shape=None)
    if name != "h100-megatron-dcp-gpt":
        assert_json_close(
            [link.model_dump() for link in built.communication.all_to_all_links],
            [link.model_dump() for link in profile.communication.all_to_all_links],
        )
