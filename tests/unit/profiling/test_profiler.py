"""Profiler and validation: fits recover known coefficients; the CLIs produce valid profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dyncp.cost_model.fitting import fit_linear, fit_link, fit_quadratic
from dyncp.cost_model.model import CostModel
from dyncp.cost_model.schema import load_profile
from dyncp.profiling.decoder import MODELS
from dyncp.profiling.fits import build_profile
from dyncp.profiling.profile import (
    main as profile_main,
)
from dyncp.profiling.validate import main as validate_main
from dyncp.profiling.validate import random_pack


def test_attention_fit_recovers_coefficients() -> None:
    s = np.array([32, 64, 128, 256, 512, 1024, 2048, 4096])
    a, b, k = 3e-9, 2e-7, 4e-4
    a_, b_, k_, err = fit_quadratic(s, a * s * s + b * s + k)
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


def synthetic_raw(cfg, a=2e-9, b=1e-7, o=2e-4, lin=3e-6, const=4e-3, lat=5e-5, bw=2e9) -> dict:
    """What measure() returns on a machine that follows the cost model exactly: attention per
    sequence a s^2 + b s + o per layer, lin per token, const per micro-batch."""
    lengths = np.array([32, 64, 128, 256, 512, 1024, 2048])
    kernel = a * lengths**2 + b * lengths + 5e-5  # bare kernel: its own call cost
    packs = [
        (s, n, lin * s * n + const + cfg.layers * n * (a * s * s + b * s + o))
        for s, counts in ((64, (1, 2, 4, 8, 16, 32)), (256, (1, 2, 4, 8)))
        for n in counts
    ]
    nbytes = [1e4, 1e5, 1e6, 1e7]
    return {
        "attn_len": lengths.tolist(),
        "attn_fwd": (kernel / 3.5).tolist(),
        "attn_fwdbwd": kernel.tolist(),
        "packs": packs,
        "single_len": lengths.tolist(),
        "single_seconds": (
            lin * lengths + const + cfg.layers * (a * lengths**2 + b * lengths + o)
        ).tolist(),
        "links": {2: [(n, lat + n / bw) for n in nbytes], 4: [(n, lat + n / bw) for n in nbytes]},
        "wave_seconds": 1e-3,
    }


def test_build_profile_recovers_the_cost_model() -> None:
    cfg = MODELS["tiny"]
    raw = synthetic_raw(cfg)
    profile = build_profile(
        "synthetic", cfg, raw, dtype=torch.float32, device=torch.device("cpu"), command="test"
    )
    assert profile.linear_seconds_per_token == pytest.approx(3e-6, rel=1e-3)
    assert profile.overheads.microbatch_seconds == pytest.approx(4e-3, rel=1e-3)
    assert profile.attention.sequence_overhead_seconds == pytest.approx(2e-4, rel=1e-3)
    assert profile.attention.backward_forward_ratio == pytest.approx(2.5, rel=1e-9)
    link = profile.communication.intra_node
    assert link.latency_seconds == pytest.approx(5e-5, rel=1e-6)
    assert link.bandwidth_bytes_per_second == pytest.approx(2e9, rel=1e-6)
    assert profile.overheads.wave_seconds == 1e-3
    assert "max relative error" in " ".join(profile.provenance.notes)
    model = CostModel(profile, ranks_per_node=4)
    # every measured pack and single sequence is predicted exactly at CP 1
    for s, n, t in raw["packs"]:
        assert model.microbatch_seconds(1, [s] * n) == pytest.approx(t, rel=1e-3)
    for s, t in zip(raw["single_len"], raw["single_seconds"]):
        assert model.microbatch_seconds(1, [s]) == pytest.approx(t, rel=1e-3)


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


def test_profile_records_its_run_and_validate_checks_it(tmp_path, capsys) -> None:
    """The profiler records its set-up; validation compares numbers only under the same set-up,
    refuses (exit 2, naming both values) under another, and warns when told to go on."""
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
    run = profile.provenance.run
    assert run is not None and run.processes == 1 and run.device_type == "cpu"
    assert run.threads_per_process == torch.get_num_threads()
    args = ["--profile", str(out), "--cases", "2", "--repeats", "1", "--capacity", "128"]
    validate_main(args)
    printed = capsys.readouterr().out
    assert "MAPE cp=1:" in printed and "MAPE overall:" in printed and "WARNING" not in printed

    data = json.loads(out.read_text())
    data["provenance"]["run"]["processes"] = 4
    other = tmp_path / "four.json"
    other.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exc:
        validate_main(["--profile", str(other), *args[2:]])
    assert exc.value.code == 2
    assert "processes: profile 4, this run 1" in capsys.readouterr().err
    validate_main(["--profile", str(other), *args[2:], "--allow-mismatch"])
    printed = capsys.readouterr().out
    assert printed.count("SET-UP DIFFERS") == 2 and "MAPE overall:" in printed


def test_random_pack_fills_capacity() -> None:
    rng = np.random.default_rng(0)
    pool = np.array([10, 50, 100, 300])
    for cp in (1, 2, 4):
        pack = random_pack(pool, cp, 256, rng)
        unit = 1 if cp == 1 else 2 * cp
        assert sum(-(-s // unit) * unit for s in pack) <= cp * 256
