"""Reference GPU profiles for any decoder shape: shapes, scaling, coverage, CLI."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
from json_close import assert_json_close

from dyncp.cost_model.distca import fit_attention
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.reference import (
    BWD_FWD_RATIO,
    GEMM_FLOPS,
    build_reference_profile,
    coverage_warnings,
    main,
)
from dyncp.cost_model.schema import load_profile
from dyncp.cost_model.shapes import SHAPES, DecoderShape, ShapeError, load_shape

SRC = Path("/work/shared/reference/h100-distca")
needs_src = pytest.mark.skipif(not SRC.is_dir(), reason=f"{SRC} not available")
GPT = SHAPES["megatron-dcp-gpt"]


def test_named_shapes_count_their_gemms() -> None:
    # 12 x (QKV 2048x6144 + O 2048x2048 + GELU MLP 2 x 2048x8192) + head 2048x131072
    assert GPT.gemm_params == 12 * (2048 * 6144 + 2048 * 2048 + 2 * 2048 * 8192) + 2048 * 131072
    assert GPT.gemm_params == 872_415_232
    assert GPT.kv_bytes_per_token == 2 * 16 * 128 * 2
    llama = SHAPES["llama3-8b"]  # SwiGLU: three hidden x ffn GEMMs, GQA: 8 KV heads
    per_layer = 4096 * (4096 + 2 * 8 * 128) + 4096 * 4096 + 3 * 4096 * 14336
    assert llama.gemm_params == 32 * per_layer + 4096 * 128256
    assert llama.kv_bytes_per_token == 4096.0


def test_parameters_count_a_tied_embedding_once_and_learned_positions() -> None:
    # The step's reduction and optimizer price these: Megatron's GPT ties its embedding to the
    # output layer (counted in gemm_params) and learns 8192 x 2048 positions.
    assert GPT.parameters == GPT.gemm_params + 8192 * 2048 == 889_192_448
    llama = SHAPES["llama3-8b"]  # untied, RoPE: the input embedding is a weight of its own
    assert llama.parameters == llama.gemm_params + 4096 * 128256
    untied = replace(GPT, tied_embeddings=False, position_embeddings=0)
    assert untied.parameters == GPT.gemm_params + 2048 * 131072
    with pytest.raises(ShapeError, match="'position_embeddings' must be >= 0"):
        replace(GPT, position_embeddings=-1)
    with pytest.raises(ShapeError, match="'tied_embeddings' must be true or false"):
        replace(GPT, tied_embeddings=1)


def test_shape_json_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    fields = {k: v for k, v in GPT.to_dict().items() if k != "source"}
    path.write_text(json.dumps(fields))
    assert replace(load_shape(path), source=GPT.source) == GPT
    with pytest.raises(ShapeError, match="unknown field.*hidden"):
        DecoderShape.from_dict({**fields, "hidden": 1})
    with pytest.raises(ShapeError, match="missing field.*vocab_size"):
        DecoderShape.from_dict({k: v for k, v in fields.items() if k != "vocab_size"})
    with pytest.raises(ShapeError, match="ffn_kind.*allowed: swiglu, gelu"):
        replace(GPT, ffn_kind="relu2")
    with pytest.raises(ShapeError, match="num_heads .* multiple of num_kv_heads"):
        replace(GPT, num_kv_heads=3)
    with pytest.raises(ShapeError, match="'num_layers' must be >= 1"):
        replace(GPT, num_layers=0)
    with pytest.raises(ShapeError, match="neither a named shape"):
        load_shape("no-such-model")


def test_coverage_warnings_name_what_is_not_measured() -> None:
    assert coverage_warnings(SHAPES["llama3-8b"]) == []  # 8 KV heads, measured with 2
    (w,) = coverage_warnings(GPT)  # 16 KV heads, measured with 1
    assert "num_kv_heads 16" in w and "1 KV head(s)" in w
    assert coverage_warnings(replace(GPT, num_kv_heads=4)) == []
    (w,) = coverage_warnings(replace(GPT, num_heads=24, num_kv_heads=8))
    assert "num_heads 24 was not measured" in w
    (w,) = coverage_warnings(replace(GPT, num_heads=128, num_kv_heads=16))
    assert "outside the measured 8..64" in w
    (w,) = coverage_warnings(replace(GPT, head_dim=64, num_kv_heads=4))
    assert "head_dim 64" in w
    (w,) = coverage_warnings(replace(GPT, dtype_bytes=4, num_kv_heads=4))
    assert "dtype_bytes 4" in w


@needs_src
def test_measured_head_count_is_used_unscaled() -> None:
    """16 query heads were measured (tp=4 rows): the table is that measurement x (1 + ratio)."""
    profile = build_reference_profile(SRC, shape=GPT)
    fit = fit_attention(SRC, 16)
    assert profile.name == "h100-megatron-dcp-gpt"
    assert profile.attention.lengths == fit.lengths
    assert profile.attention.seconds == pytest.approx(
        [t * (1 + BWD_FWD_RATIO) for t in fit.forward_seconds], rel=1e-12
    )
    assert profile.linear_seconds_per_token == pytest.approx(6 * 872_415_232 / GEMM_FLOPS)
    assert profile.communication.kv_bytes_per_token == 8192
    assert profile.overheads.microbatch_seconds == pytest.approx(5e-3 * 12 / 32)
    assert profile.model.num_layers == 12 and profile.model.num_heads == 16
    assert any("megatron" in n.lower() for n in profile.provenance.notes)


@needs_src
def test_unmeasured_heads_scale_the_length_dependent_part() -> None:
    """24 heads: nearest measured is 32; everything but the fixed cost scales by 24/32."""
    shape = replace(GPT, num_heads=24, num_kv_heads=8, hidden_size=3072)
    profile = build_reference_profile(SRC, shape=shape)
    fit = fit_attention(SRC, 32)
    k0 = float(fit.coef[2])
    want = [(k0 + (t - k0) * 0.75) * (1 + BWD_FWD_RATIO) for t in fit.forward_seconds]
    assert profile.attention.seconds == pytest.approx(want, rel=1e-12)
    assert any("not measured" in n for n in profile.provenance.notes)
    # The measured near-quadratic growth survives the scaling.
    model = CostModel(profile, ranks_per_node=8)
    assert model.attention_seconds(8192) > 3 * model.attention_seconds(4096)


@needs_src
def test_bundled_megatron_profile_is_what_the_builder_writes() -> None:
    built = build_reference_profile(SRC, shape=GPT, kernel="fa3-sm90").model_dump()
    bundled = copy.deepcopy(load_profile("h100-megatron-dcp-gpt").model_dump())
    assert built["provenance"].pop("date") and bundled["provenance"].pop("date")
    assert_json_close(built, bundled)


@needs_src
def test_cli_writes_a_loadable_profile_and_refuses_bad_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = tmp_path / "wide.json"
    fields = {k: v for k, v in replace(GPT, head_dim=64, hidden_size=1024).to_dict().items()}
    shape.write_text(json.dumps(fields))
    out = tmp_path / "p.json"
    main(["--src", str(SRC), "--model", str(shape), "--out", str(out)])
    profile = load_profile(out)
    assert profile.model.head_dim == 64
    assert "head_dim 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--src", str(SRC), "--model", "gpt-17", "--out", str(out)])
    assert "neither a named shape" in capsys.readouterr().err
