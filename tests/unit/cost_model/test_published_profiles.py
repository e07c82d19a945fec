"""Published cost-model forms as profiles: predictions equal the published formulas.

The formulas are written out here independently of the cost model, with the coefficients read
back from each profile's provenance assumptions; the cost model must agree to 1e-12 (relative)
for every group size and pack, and the plug-in protocol must hold for every bundled profile.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dyncp.cost_model import CostModel, load_profile
from dyncp.cost_model.protocol import CostModelProtocol
from dyncp.cost_model.published import FORMS, published_profiles, read_busbw
from dyncp.cost_model.schema import PROFILES_DIR, Profile, ProfileError

NCCL = Path(__file__).resolve().parents[4] / "shared/reference/h100-distca/nccl_perf.csv"


def coefficients(profile: Profile) -> dict[str, float]:
    return {a.name: float(a.value) for a in profile.provenance.assumptions}


def formula(form: str, coef: dict[str, float], s: int, lengths: list[int]) -> float:
    L = np.asarray(lengths, dtype=np.float64)
    if form == "megatron":
        return coef["a1"] * float((L * L).sum()) / s
    if form == "wlbllm":
        return (coef["a1"] * float((L * L).sum()) + coef["a2"] * float(L.sum())) / s
    assert form == "flexsp"
    t = float((coef["a1"] * L * L + coef["a2"] * L).sum()) / s + coef["beta"]
    if s > 1:
        t += coef["V"] * float(L.sum()) / (s * coef[f"bw{s}"])
    return t


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=60, deadline=None)
@given(
    s=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 512, 16384]),
    lengths=st.lists(st.integers(1, 200_000), min_size=1, max_size=12),
)
def test_profile_predicts_its_formula(form: str, s: int, lengths: list[int]) -> None:
    profile = load_profile(f"published-{form}")
    model = CostModel(profile, ranks_per_node=8)
    expected = formula(form, coefficients(profile), s, lengths)
    got = model.microbatch_seconds(s, lengths)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    # The vectorised path the simulator uses agrees too.
    packs = model.packs_seconds(s, np.asarray(lengths + lengths), np.asarray([0, len(lengths)]))
    np.testing.assert_allclose(packs, [expected, expected], rtol=1e-12, atol=0)


@pytest.mark.parametrize("form", FORMS)
def test_bundled_file_is_what_the_builder_writes(form: str) -> None:
    busbw = read_busbw(NCCL) if NCCL.exists() else None
    built = published_profiles(busbw=busbw)[form]
    assert load_profile(f"published-{form}") == built


def test_flexsp_bandwidth_is_per_sp_size() -> None:
    model = CostModel.load("published-flexsp", ranks_per_node=8)
    coef = coefficients(model.profile)
    for s in (2, 4, 8, 16, 64):
        assert model.link(s) == (0.0, coef[f"bw{s}"])
    # The measured NVLink bandwidths differ by size: a two-link profile could not say this.
    assert len({coef["bw2"], coef["bw4"], coef["bw8"]}) == 3
    assert model.all_to_all and not model.overlap


def test_links_table_missing_size_names_the_table() -> None:
    data = load_profile("published-flexsp").model_dump(mode="json")
    data["communication"]["links"] = data["communication"]["links"][:2]  # sizes 2 and 4 only
    model = CostModel(Profile.model_validate(data), ranks_per_node=8)
    assert model.link(3) == model.link(4)  # the next larger listed size, never a smaller one
    with pytest.raises(ValueError, match=r"group sizes \[2, 4\].*8 ranks"):
        model.microbatch_seconds(8, [100])


def test_links_must_be_sorted() -> None:
    data = load_profile("published-flexsp").model_dump(mode="json")
    data["communication"]["links"].reverse()
    with pytest.raises(ProfileError, match="communication: .*strictly increasing"):
        Profile.from_json(json.dumps(data))


def test_unknown_communication_kind_refused() -> None:
    data = load_profile("h100-reference").model_dump(mode="json")
    data["communication"]["kind"] = "tree"
    with pytest.raises(ProfileError, match="communication.kind"):
        Profile.from_json(json.dumps(data))


def test_padding_granularity_is_priced() -> None:
    data = load_profile("h100-reference").model_dump(mode="json")
    assert data["padding"] == {"multiple_per_rank": 2}  # the default: zigzag
    zigzag = CostModel(Profile.model_validate(data), ranks_per_node=8)
    data["padding"] = {"multiple_per_rank": 0}
    unpadded = CostModel(Profile.model_validate(data), ranks_per_node=8)
    assert zigzag.priced(4, np.asarray([9])).tolist() == [16]
    assert unpadded.priced(4, np.asarray([9])).tolist() == [9]
    assert unpadded.microbatch_seconds(4, [9]) < zigzag.microbatch_seconds(4, [9])
    # Memory stays the plan contract's: padded() ignores the profile.
    assert unpadded.memory_tokens(4, [9]) == zigzag.memory_tokens(4, [9]) == 4


@pytest.mark.parametrize("path", sorted(PROFILES_DIR.glob("*.json")), ids=lambda p: p.stem)
@settings(max_examples=25, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4, 8, 16, 64]),
    lengths=st.lists(st.integers(1, 100_000), min_size=1, max_size=8),
    extra=st.integers(1, 100_000),
)
def test_every_profile_keeps_the_protocol(
    path: Path, cp: int, lengths: list[int], extra: int
) -> None:
    model = CostModel.load(path, ranks_per_node=8)
    assert isinstance(model, CostModelProtocol)
    arr = np.asarray(lengths)
    t = model.microbatch_seconds(cp, arr)
    tol = 1e-9 * t
    assert model.microbatch_seconds(cp, lengths + [extra]) >= t - tol  # 1: monotone
    split = model.fixed_seconds(cp) + model.bound_rank_seconds(cp, arr).sum() / cp
    assert t >= split - tol  # 2: the additive lower-bound split
    if not model.overlap or model.all_to_all or model.kvb == 0:
        assert t == pytest.approx(split, rel=1e-9)  # exact when nothing is overlapped
    for s in lengths:  # 3: alone
        assert model.alone_seconds(cp, np.asarray([s]))[0] == pytest.approx(
            model.microbatch_seconds(cp, [s]), rel=1e-12
        )
    assert (model.work_rank_seconds(cp, arr) <= model.bound_rank_seconds(cp, arr) + tol).all()
    assert model.fixed_seconds(cp) >= model.fixed_seconds(1) >= model.microbatch_overhead
