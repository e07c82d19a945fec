"""Profiler and validation: fits recover known coefficients; the CLIs produce valid profiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dyncp.cost_model.model import CostModel
from dyncp.cost_model.profile import (
    MODELS,
    build_profile,
    fit_attention,
    fit_linear,
    fit_link,
)
from dyncp.cost_model.profile import (
    main as profile_main,
)
from dyncp.cost_model.schema import load_profile
from dyncp.cost_model.validate import main as validate_main
from dyncp.cost_model.validate import random_pack


def test_attention_fit_recovers_coefficients() -> None:
    s = np.array([32, 64, 128, 256, 512, 1024, 2048, 4096])
    a, b, k = 3e-9, 2e-7, 4e-4
    a_, b_, k_, err = fit_attention(s, a * s * s + b * s + k)
    assert a_ == pytest.approx(a, rel=1e-6)
    assert b_ == pytest.approx(b, rel=1e-6)
    assert k_ == pytest.approx(k, rel=1e-6)
    assert err < 1e-9


def test_linear_and_link_fits_recover_coefficients() -> None:
    tokens = np.array([64, 128, 256, 512, 1024, 2048])
    per_token, constant, err = fit_linear(tokens, 5e-6 * tokens + 3e-3)
    assert (per_token, constant) == (pytest.approx(5e-6, rel=1e-9), pytest.approx(3e-3, rel=1e-9))
    nbytes = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    latency, bandwidth, err = fit_link(nbytes, 2e-5 + nbytes / 3e9)
    assert latency == pytest.approx(2e-5, rel=1e-6)
    assert bandwidth == pytest.approx(3e9, rel=1e-6)
    assert err < 1e-9


def synthetic_raw(cfg, a=2e-9, b=1e-7, k=2e-4, lin=3e-6, const=4e-3, lat=5e-5, bw=2e9) -> dict:
    """What measure() would return on a machine that follows the cost model exactly."""
    lengths = np.array([32, 64, 128, 256, 512, 1024, 2048])
    fwdbwd = a * lengths**2 + b * lengths + k
    tokens = np.array([64, 128, 256, 512, 1024, 2048])
    att_one = a * 64**2 + b * 64  # net of k
    packs = lin * tokens + const + cfg.layers * (tokens / 64 * att_one + k)
    nbytes = [1e4, 1e5, 1e6, 1e7]
    return {
        "attn_len": lengths.tolist(),
        "attn_fwd": (fwdbwd / 3.5).tolist(),
        "attn_fwdbwd": fwdbwd.tolist(),
        "pack_tokens": tokens.tolist(),
        "pack_seconds": packs.tolist(),
        "pack_seqlen": 64,
        "single_len": lengths.tolist(),
        "single_seconds": (lin * lengths + const + cfg.layers * fwdbwd).tolist(),
        "links": {2: [(n, lat + n / bw) for n in nbytes], 4: [(n, lat + n / bw) for n in nbytes]},
        "wave_seconds": 1e-3,
    }


def test_build_profile_recovers_the_cost_model() -> None:
    cfg = MODELS["tiny"]
    profile = build_profile(
        "synthetic",
        cfg,
        synthetic_raw(cfg),
        dtype=torch.float32,
        device=torch.device("cpu"),
        command="test",
    )
    assert profile.linear_seconds_per_token == pytest.approx(3e-6, rel=1e-3)
    assert profile.overheads.microbatch_seconds == pytest.approx(4e-3, rel=1e-3)
    assert profile.attention.step_overhead_seconds == pytest.approx(2e-4, rel=1e-3)
    assert profile.attention.backward_forward_ratio == pytest.approx(2.5, rel=1e-9)
    link = profile.communication.intra_node
    assert link.latency_seconds == pytest.approx(5e-5, rel=1e-6)
    assert link.bandwidth_bytes_per_second == pytest.approx(2e9, rel=1e-6)
    assert profile.overheads.wave_seconds == 1e-3
    raw = synthetic_raw(cfg)
    assert profile.attention.seconds == pytest.approx(raw["attn_fwdbwd"], rel=1e-3)
    assert "max relative error" in " ".join(profile.provenance.notes)
    model = CostModel(profile, ranks_per_node=4)
    # cp = 1 prediction of a pack of 64-token sequences equals the synthetic machine's time
    assert model.microbatch_seconds(1, [64] * 8) == pytest.approx(
        synthetic_raw(cfg)["pack_seconds"][3], rel=1e-3
    )


def test_profile_cli_single_process(tmp_path) -> None:
    out = tmp_path / "quick.json"
    profile_main(
        [
            "--out",
            str(out),
            "--max-length",
            "128",
            "--repeats",
            "1",
            "--max-seconds",
            "5",
            "--device",
            "cpu",
        ]
    )
    profile = load_profile(out)
    assert profile.name == "quick"
    assert profile.attention.lengths[-1] <= 128
    assert "single process" in profile.provenance.assumptions[0].source


def test_validate_cli_single_process(tmp_path, capsys) -> None:
    validate_main(["--profile", "cpu-gloo", "--cases", "2", "--repeats", "1", "--capacity", "256"])
    out = capsys.readouterr().out
    assert "MAPE cp=1:" in out and "MAPE overall:" in out


def test_random_pack_fills_capacity() -> None:
    rng = np.random.default_rng(0)
    pool = np.array([10, 50, 100, 300])
    for cp in (1, 2, 4):
        pack = random_pack(pool, cp, 256, rng)
        unit = 1 if cp == 1 else 2 * cp
        assert sum(-(-s // unit) * unit for s in pack) <= cp * 256
