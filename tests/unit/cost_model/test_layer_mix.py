"""Layer-mix profiles: full/windowed attention, SSM and MoE layers priced per CP size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from json_close import assert_json_close

from dyncp.cost_model.layer_mix import LayerMixCostModel
from dyncp.cost_model.mix_reference import build_mix_profile, fit_moe_throughput
from dyncp.cost_model.mix_shapes import MIX_SHAPES, LayerMixShape
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import Profile, ProfileError, load_profile
from dyncp.cost_model.shapes import SHAPES, ShapeError
from dyncp.ring_attention.window import window_plan

SRC = Path("/work/shared/reference/h100-distca")
needs_src = pytest.mark.skipif(not SRC.exists(), reason="shared reference data not present")


def _with_mix(profile: Profile, mix: dict) -> Profile:
    data = profile.model_dump(mode="json")
    data["layer_mix"] = mix
    return Profile.model_validate(data)


def test_all_full_attention_mix_predicts_like_the_dense_profile() -> None:
    dense = load_profile("h100-reference")
    mixed = _with_mix(dense, {"full_attention_layers": dense.model.num_layers})
    a, b = CostModel(dense, 8), CostModel(mixed, 8)
    assert type(a) is CostModel and isinstance(b, LayerMixCostModel)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40000, size=12)
    starts = np.array([0, 5, 9])
    for cp in (1, 2, 4, 8, 16):
        assert b.microbatch_seconds(cp, lengths) == a.microbatch_seconds(cp, lengths)
        assert np.array_equal(b.packs_seconds(cp, lengths, starts),
                              a.packs_seconds(cp, lengths, starts))  # fmt: skip
        assert np.array_equal(b.bound_rank_seconds(cp, lengths),
                              a.bound_rank_seconds(cp, lengths))  # fmt: skip
        assert b.fixed_seconds(cp) == a.fixed_seconds(cp)


def test_profiles_without_a_mix_keep_their_json() -> None:
    text = json.loads(load_profile("h100-reference").to_json())
    assert "layer_mix" not in text


def test_llama_mix_counts_the_same_gemm_weights_as_the_dense_shape() -> None:
    assert MIX_SHAPES["llama3-8b"].dense_gemm_params == SHAPES["llama3-8b"].gemm_params


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("window", [1, 16, 100, 129, 300, 5000])
def test_window_transfers_match_the_runtime_plan(cp: int, window: int) -> None:
    # The cost model's transfers are the ones ring attention's window plan makes.
    length = 2048
    hops = min(cp - 1, 2 * LayerMixCostModel.window_distance(cp, np.array([length]), window)[0])
    assert hops == window_plan(seqlens=[length], cp=cp, window=window).transfers


def test_windowed_layers_grow_linearly_past_the_window_and_skip_transfers() -> None:
    dense = load_profile("h100-reference")
    layers = dense.model.num_layers
    mix = {"full_attention_layers": 0, "window": [{"window": 4096, "layers": layers}]}
    win = CostModel(_with_mix(dense, mix), 8)
    full = CostModel(dense, 8)
    w = [win.window_work(1, np.array([n]), 4096)[0] for n in (16384, 32768, 65536)]
    assert w[2] - w[1] == pytest.approx(2 * (w[1] - w[0]), rel=1e-9)  # linear past the window
    for cp in (1, 4, 8):
        assert win.microbatch_seconds(cp, [65536]) < full.microbatch_seconds(cp, [65536])
    # Short sequences inside the window cost what full attention costs.
    assert win.microbatch_seconds(1, [1000]) == pytest.approx(full.microbatch_seconds(1, [1000]))


def test_ssm_layers_add_scan_work_and_a_per_sequence_exchange() -> None:
    dense = load_profile("h100-reference")
    mix = {"full_attention_layers": 0, "ssm_layers": 10, "ssm_seconds_per_token": 1e-9,
           "ssm_chunk_state_bytes": 1e6}  # fmt: skip
    ssm = CostModel(_with_mix(dense, mix), 8)
    base = CostModel(_with_mix(dense, {**mix, "ssm_seconds_per_token": 0.0,
                                       "ssm_chunk_state_bytes": 0.0}), 8)  # fmt: skip
    assert ssm.microbatch_seconds(1, [1000, 3000]) - base.microbatch_seconds(1, [1000, 3000]) == (
        pytest.approx(10 * 1e-9 * 4000)
    )
    latency, bandwidth = ssm.link(4)
    one = ssm.microbatch_seconds(4, [4000]) - base.microbatch_seconds(4, [4000])
    four = ssm.microbatch_seconds(4, [1000] * 4) - base.microbatch_seconds(4, [1000] * 4)
    # Same tokens; three more sequences add 3 x 2 all-gathers x 3 steps x 2 chunks x 1 MB.
    assert four - one == pytest.approx(10 * 3 * 2 * 3 * 2e6 / bandwidth)
    # Every pack pays the two all-gathers' latencies: 3 steps each, forward and backward.
    assert ssm.fixed_seconds(4) - CostModel.fixed_seconds(ssm, 4) == pytest.approx(
        10 * 2 * 3 * latency
    )


def test_ssm_pays_the_cheaper_exchange_and_says_which() -> None:
    dense = load_profile("h100-reference")
    mix = {"full_attention_layers": 0, "ssm_layers": 10, "ssm_chunk_state_bytes": 4e6}
    state = CostModel(_with_mix(dense, mix), 8)
    both = CostModel(_with_mix(dense, {**mix, "ssm_all_to_all_bytes_per_token": 4e4}), 8)
    many, one = [256] * 32, [65536]
    # Many short documents: states per document outweigh activations per token.
    assert both.ssm_exchange(8, many) == "all_to_all" and state.ssm_exchange(8, many) == "state"
    assert both.microbatch_seconds(8, many) < state.microbatch_seconds(8, many)
    # One long document: a few states are cheaper than moving every token.
    assert both.ssm_exchange(8, one) == "state"
    assert both.microbatch_seconds(8, one) == state.microbatch_seconds(8, one)
    assert both.ssm_exchange(1, one) == "none"
    for cp, lengths in ((8, many), (8, one), (4, many + one)):
        split = both.fixed_seconds(cp) + both.bound_rank_seconds(cp, np.array(lengths)).sum() / cp
        assert both.microbatch_seconds(cp, lengths) >= split * (1 - 1e-12)


def test_layer_mix_errors() -> None:
    dense = load_profile("h100-reference")
    with pytest.raises(ValueError, match="model.num_layers is 32"):
        _with_mix(dense, {"full_attention_layers": 33})
    with pytest.raises(ValueError, match="no layer has a mixer"):
        _with_mix(dense, {"full_attention_layers": 0})
    bad = dense.model_dump(mode="json")
    bad["layer_mix"] = {"full_attention_layers": 2, "windows": []}
    with pytest.raises(ProfileError, match="layer_mix.windows"):
        Profile.from_json(json.dumps(bad))
    with pytest.raises(ShapeError, match="gemm_dtype 'fp4'"):
        LayerMixShape(base=SHAPES["llama3-8b"], full_attention_layers=32, gemm_dtype="fp4")
    with pytest.raises(ShapeError, match="moe_top_k"):
        LayerMixShape(base=SHAPES["llama3-8b"], full_attention_layers=32, moe_experts=8,
                      moe_top_k=9)  # fmt: skip


@needs_src
def test_measured_moe_throughput_and_fp8() -> None:
    flops, rows = fit_moe_throughput(SRC)
    assert 150e12 < flops < 500e12 and len(rows) == 11
    nemo = MIX_SHAPES["nemotron-h-8b"]
    fp8 = build_mix_profile(SRC, nemo)
    bf16 = build_mix_profile(SRC, LayerMixShape(**{**_fields(nemo), "gemm_dtype": "bf16"}))
    assert fp8.linear_seconds_per_token == pytest.approx(bf16.linear_seconds_per_token / 2)


def _fields(mix: LayerMixShape) -> dict:
    return {name: getattr(mix, name) for name in LayerMixShape.__slots__}


@needs_src
@pytest.mark.parametrize("key", ["falcon-h1-7b", "nemotron-h-8b", "gpt-oss-20b"])
def test_bundled_mix_profiles_are_what_the_builder_writes(key: str) -> None:
    built = json.loads(build_mix_profile(SRC, MIX_SHAPES[key]).to_json())
    bundled = json.loads(load_profile(f"h100-{MIX_SHAPES[key].name}").to_json())
    built["provenance"].pop("date")
    bundled["provenance"].pop("date")
    assert_json_close(built, bundled)
