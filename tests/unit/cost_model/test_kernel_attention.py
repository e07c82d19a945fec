"""The kernel-aware attention form: tiles read from the kernel, a per-(sequence x ring step)
cost that calibration learns, CP 1 free of ring costs, and profiles without them unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dyncp.cost_model.calibration.fit import Measurement, fit_profile
from dyncp.cost_model.kernels import KERNELS, kernel_tiles, tile_length
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.reference import main
from dyncp.cost_model.schema import Profile, ProfileError, bundled_profiles, load_profile

SRC = Path("/work/shared/reference/h100-distca")
needs_src = pytest.mark.skipif(not SRC.is_dir(), reason=f"{SRC} not available")
FA3 = kernel_tiles("fa3-sm90", 128)


def with_attention(profile: Profile, **update: object) -> Profile:
    data = json.loads(profile.to_json())
    data["attention"].update(update)
    return Profile.model_validate(data)


def tiles_json(kernel: str = "fa3-sm90") -> dict:
    t = kernel_tiles(kernel, 128)
    return {
        "kernel": t.kernel,
        "forward_block_q": t.forward_block_q,
        "forward_block_kv": t.forward_block_kv,
        "backward_block_q": t.backward_block_q,
        "backward_block_kv": t.backward_block_kv,
        "pads": t.pads,
        "source": t.source,
    }


def test_tiles_are_the_ones_read_from_source() -> None:
    assert (FA3.forward_block_q, FA3.forward_block_kv) == (128, 128)
    assert (FA3.backward_block_q, FA3.backward_block_kv) == (64, 128)
    fa2 = kernel_tiles("fa2-sm80", 128)
    assert (fa2.forward_block_q, fa2.forward_block_kv) == (128, 64)
    assert (fa2.backward_block_q, fa2.backward_block_kv) == (64, 128)
    assert not kernel_tiles("sdpa-cpu", 128).pads  # the CPU kernel clamps its splits
    for by_dim in KERNELS.values():
        for t in by_dim.values():
            assert ".h:" in t.source or ".cpp" in t.source  # a file (and line) is cited
    with pytest.raises(ValueError, match="head dim"):
        kernel_tiles("fa3-sm90", 64)
    with pytest.raises(ValueError, match="fa3-sm90"):
        kernel_tiles("fa9", 128)


def test_a_piece_smaller_than_a_tile_pays_a_whole_tile() -> None:
    # Square tiles: ceil(n / 128) x 128.
    assert tile_length(np.array([1, 16, 32, 128]), 128, 128).tolist() == [128] * 4
    assert tile_length(np.array([129, 256, 1024]), 128, 128).tolist() == [256, 256, 1024]
    # 64 x 128: a padded rectangle of 64 x 128 for anything up to 64 tokens.
    assert tile_length(16, 64, 128) == pytest.approx(np.sqrt(64 * 128))
    assert tile_length(1024, 64, 128) == 1024  # a multiple of both blocks is unchanged


def test_tiles_price_tiny_ring_chunks_and_leave_block_multiples_alone() -> None:
    base = load_profile("h100-reference")
    plain = CostModel(base, 8)
    tiled = CostModel(with_attention(base, tiles=tiles_json()), 8)
    # A multiple of both blocks per ring step (4096 at CP 4: 1024 a step) costs as before.
    for cp, lengths in ((4, [4096]), (1, [1024, 2048]), (8, [8192, 1024 * 8])):
        assert tiled.microbatch_seconds(cp, lengths) == pytest.approx(
            plain.microbatch_seconds(cp, lengths), rel=1e-12
        )
    # A 128-token sequence at CP 4: 32 tokens a step (two 16-token zigzag pieces) are priced
    # as a whole 128-token tile forward and a 64 x 128 tile backward.
    f = tiled.fwd_fraction
    want = f * plain._net_attention(128.0) + (1 - f) * plain._net_attention(np.sqrt(64 * 128))
    assert tiled._net_attention(32.0) == pytest.approx(want, rel=1e-12)
    assert tiled._net_attention(16.0) == pytest.approx(want, rel=1e-12)
    assert tiled._net_attention(32.0) > 1.5 * plain._net_attention(32.0)
    assert tiled.microbatch_seconds(4, [128] * 8) > plain.microbatch_seconds(4, [128] * 8)


def test_ring_sequence_term_is_paid_per_sequence_and_ring_step_only_at_cp_above_1() -> None:
    base = load_profile("h100-analytic")  # no overlap: every term adds exactly
    rs = 2e-4
    plain = CostModel(base, 8)
    ring = CostModel(with_attention(base, ring_sequence_step_seconds=rs), 8)
    lengths = [300, 1000, 64, 2048]
    assert ring.microbatch_seconds(1, lengths) == plain.microbatch_seconds(1, lengths)
    for cp in (2, 4, 8):
        extra = ring.microbatch_seconds(cp, lengths) - plain.microbatch_seconds(cp, lengths)
        assert extra == pytest.approx(base.model.num_layers * cp * len(lengths) * rs, rel=1e-9)
    # A head split u x r pays it per sequence and step of its r-step ring; r = 1: not at all.
    assert ring.microbatch_seconds(8, lengths, heads=8) == pytest.approx(
        plain.microbatch_seconds(8, lengths, heads=8), rel=1e-12
    )
    extra = ring.microbatch_seconds(8, lengths, heads=2) - plain.microbatch_seconds(
        8, lengths, heads=2
    )
    assert extra == pytest.approx(base.model.num_layers * 4 * len(lengths) * rs, rel=1e-9)
    # All-to-all groups run no ring.
    a2a = load_profile("published-flexsp")
    same = CostModel(with_attention(a2a, ring_sequence_step_seconds=rs), 8)
    assert same.microbatch_seconds(4, lengths) == CostModel(a2a, 8).microbatch_seconds(4, lengths)


def test_cp1_pays_no_ring_cost_whatever_the_ring_costs() -> None:
    base = load_profile("h100-megatron-dcp-gpt")
    data = json.loads(base.to_json())
    data["attention"]["ring_sequence_step_seconds"] = 1.0
    for link in ("intra_node", "inter_node"):
        data["communication"][link] = {"latency_seconds": 1.0, "bandwidth_bytes_per_second": 1.0}
    data["communication"]["all_to_all_links"] = []
    costly = CostModel(Profile.model_validate(data), 4)
    model = CostModel(base, 4)
    lengths = np.array([128, 777, 2048])
    assert costly.microbatch_seconds(1, lengths) == model.microbatch_seconds(1, lengths)
    assert costly.fixed_seconds(1) == model.fixed_seconds(1)
    bounds = (m.bound_rank_seconds(1, lengths) for m in (costly, model))
    assert np.array_equal(*bounds)


@pytest.mark.parametrize("name", ["h100-megatron-dcp-gpt", "h100-analytic"])
def test_lower_bound_holds_with_tiles_and_the_ring_term(name: str) -> None:
    base = load_profile(name)
    model = CostModel(
        with_attention(base, ring_sequence_step_seconds=5e-5, tiles=tiles_json("fa2-sm80")), 4
    )
    rng = np.random.default_rng(0)
    for cp in (1, 2, 4, 8):
        for _ in range(20):
            lengths = rng.integers(1, 3000, size=int(rng.integers(1, 9)))
            total = model.microbatch_seconds(cp, lengths)
            bound = model.fixed_seconds(cp) + model.bound_rank_seconds(cp, lengths).sum() / cp
            assert bound <= total * (1 + 1e-12)


def test_profiles_without_the_new_fields_load_and_write_as_before() -> None:
    for name, path in bundled_profiles().items():
        text = path.read_text()
        profile = load_profile(name)
        if "tiles" in json.loads(text)["attention"]:
            continue
        out = json.loads(profile.to_json())
        assert "tiles" not in out["attention"], name
        assert "ring_sequence_step_seconds" not in out["attention"], name
        assert CostModel(profile, 8).ring_sequence == 0.0
    tiled = load_profile("h100-megatron-dcp-gpt")
    assert tiled.attention.tiles is not None and tiled.attention.tiles.kernel == "fa3-sm90"
    assert Profile.from_json(tiled.to_json()) == tiled


def test_a_layer_mix_refuses_the_ring_term() -> None:
    data = json.loads(load_profile("h100-gpt-oss-20b-like").to_json())
    data["attention"]["ring_sequence_step_seconds"] = 1e-4
    with pytest.raises(ProfileError, match="ring_sequence_step_seconds"):
        Profile.from_json(json.dumps(data))


def test_calibration_learns_the_ring_term_from_zero() -> None:
    """A kernel-aware profile at rs = 0 against a machine paying 60 us per sequence and ring
    step (and 30% more per-token work): CP-1 measurements tell rs from the per-sequence cost."""
    base = load_profile("h100-megatron-dcp-gpt")
    assert base.attention.ring_sequence_step_seconds == 0.0
    truth_profile = with_attention(base, ring_sequence_step_seconds=6e-5)
    truth_profile = truth_profile.model_copy(
        update={"linear_seconds_per_token": 1.3 * base.linear_seconds_per_token}
    )
    truth = CostModel(truth_profile, 4)
    rng = np.random.default_rng(1)
    ms = []
    for _ in range(60):
        cp = int(rng.choice([1, 2, 4]))
        lengths = tuple(int(x) for x in rng.integers(64, 2048 * cp // 4, size=rng.integers(1, 9)))
        seconds = truth.microbatch_seconds(cp, lengths) * float(np.exp(rng.normal(0, 0.02)))
        ms.append(Measurement(cp, lengths, seconds))
    res = fit_profile(base, ms, ranks_per_node=4)
    assert res.coefficients_before["ring"] == 0.0
    assert res.coefficients_after["ring"] == pytest.approx(6e-5, rel=0.15)
    assert res.profile.attention.ring_sequence_step_seconds == res.coefficients_after["ring"]
    assert res.profile.attention.tiles == base.attention.tiles  # the form is kept
    assert res.error_after < 0.02


def test_calibration_keeps_the_ring_term_of_a_plain_profile() -> None:
    """A profile without the kernel-aware form keeps rs = 0 exactly (its fit is unchanged)."""
    base = load_profile("h100-reference")
    model = CostModel(base, 8)
    rng = np.random.default_rng(2)
    ms = [
        Measurement(cp, (int(x),), model.microbatch_seconds(cp, [int(x)]) * 1.1)
        for cp in (1, 2, 4)
        for x in rng.integers(256, 4096, size=6)
    ]
    res = fit_profile(base, ms, ranks_per_node=8)
    assert res.coefficients_after["ring"] == 0.0
    assert "ring_sequence_step_seconds" not in json.loads(res.profile.to_json())["attention"]


@needs_src
def test_reference_cli_builds_the_kernel_aware_form_for_any_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    main(["--src", str(SRC), "--model", "megatron-dcp-gpt", "--heads", "32", "--kv-heads", "8",
          "--kernel", "fa2-sm80", "--out", str(out)])  # fmt: skip
    profile = load_profile(out)
    assert profile.model.num_heads == 32 and profile.model.num_kv_heads == 8
    att = profile.attention
    assert att.tiles is not None and att.tiles.kernel == "fa2-sm80"
    assert att.step_overhead_seconds == 0.0 and att.sequence_overhead_seconds > 0
    assert "--kernel fa2-sm80" in profile.provenance.method
    names = " ".join(a.name for a in profile.provenance.assumptions)
    assert "per document" in names and "ring step" in names
    plain = tmp_path / "plain.json"
    main(["--src", str(SRC), "--model", "megatron-dcp-gpt", "--out", str(plain)])
    assert load_profile(plain).attention.tiles is None
    with pytest.raises(SystemExit):
        main(["--src", str(SRC), "--head-dim", "64", "--kernel", "fa3-sm90", "--out", str(out)])
    assert "head dim [128] only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--src", str(SRC), "--kernel", "sdpa-cpu", "--out", str(out)])
