"""The profiler's all-to-all (issue 15): fits, a 2-rank gloo measurement, and the stand-alone
run that adds ``all_to_all_links`` to an existing profile without touching its other numbers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dyncp.cost_model.schema import Profile, load_profile
from dyncp.profiling.decoder import MODELS
from dyncp.profiling.fits import all_to_all_section, build_profile, fit_link_robust
from dyncp.profiling.measure import measure_all_to_all
from dyncp.profiling.profile import _all_to_all_into, main
from dyncp.testing.distributed import SpawnError, run_gloo
from tests.unit.profiling.test_profiler import synthetic_raw


def test_all_to_all_fit_recovers_latency_and_bandwidth() -> None:
    nbytes = [2**e for e in range(14, 22)]
    points = {2: [(b, 1.5e-4 + b / 4e9) for b in nbytes], 4: [(b, 3e-4 + b / 2e9) for b in nbytes]}
    links, note = all_to_all_section(points)
    assert [link["group_size"] for link in links] == [2, 4]
    assert links[0]["latency_seconds"] == pytest.approx(1.5e-4, rel=1e-6)
    assert links[0]["bandwidth_bytes_per_second"] == pytest.approx(4e9, rel=1e-6)
    assert links[1]["latency_seconds"] == pytest.approx(3e-4, rel=1e-6)
    assert links[1]["bandwidth_bytes_per_second"] == pytest.approx(2e9, rel=1e-6)
    assert "0 of 8 points beyond 25%" in note and "head exchange" in note


def test_robust_fit_ignores_one_slowed_point() -> None:
    """A burst of contention that slows every repeat of one size (x15) moves the fit by < 2%."""
    nbytes = np.asarray([2.0**e for e in range(14, 22)])
    seconds = 1.5e-4 + nbytes / 4e9
    seconds[2] *= 15
    latency, bandwidth, rel = fit_link_robust(nbytes, seconds)
    assert latency == pytest.approx(1.5e-4, rel=0.02)
    assert bandwidth == pytest.approx(4e9, rel=0.02)
    assert abs(rel[2]) > 0.9 and np.abs(np.delete(rel, 2)).max() < 0.02


def test_build_profile_writes_the_measured_links() -> None:
    cfg = MODELS["tiny"]
    raw = synthetic_raw(cfg)
    nbytes = [2**e for e in range(14, 22)]
    raw["all_to_all"] = {2: [(b, 1e-4 + b / 3e9) for b in nbytes]}
    profile = build_profile(
        "synthetic", cfg, raw, dtype=torch.float32, device=torch.device("cpu"), command="test"
    )
    (link,) = profile.communication.all_to_all_links
    assert link.group_size == 2
    assert link.latency_seconds == pytest.approx(1e-4, rel=1e-6)
    assert link.bandwidth_bytes_per_second == pytest.approx(3e9, rel=1e-6)
    assert any("all-to-all fit" in n for n in profile.provenance.notes)
    del raw["all_to_all"]
    plain = build_profile(
        "synthetic", cfg, raw, dtype=torch.float32, device=torch.device("cpu"), command="test"
    )
    assert plain.communication.all_to_all_links == []


def _measure_worker(rank: int, world: int) -> list[tuple[int, float]]:
    groups = {2: [dist.new_group([0, 1])]}
    points = measure_all_to_all(
        MODELS["tiny"],
        groups,
        dtype=torch.float32,
        device=torch.device("cpu"),
        repeats=3,
        sync=lambda: None,
        log=lambda _: None,
        tokens=(64, 1024),
    )
    return points[2]


@pytest.mark.timeout(150)
def test_all_to_all_is_measured_on_two_gloo_ranks() -> None:
    first, second = run_gloo(_measure_worker, world=2, timeout=120)
    cfg = MODELS["tiny"]
    # A point is one of the four exchanges: half of a token's q, k, v and output bytes.
    per_token = (2 * cfg.heads + 2 * max(cfg.kv_heads, 2)) * cfg.head_dim * 4 // 2
    assert [b for b, _ in first] == [64 * per_token, 1024 * per_token]
    assert first == second  # every rank reports the slowest rank's median
    assert all(0 < t < 5.0 for _, t in first)


def _into_worker(rank: int, world: int, src: str, out: str, model: str) -> None:
    args = argparse.Namespace(
        all_to_all_into=Path(src), out=Path(out), model="tiny", dtype=model, repeats=2
    )
    _all_to_all_into(
        args, device=torch.device("cpu"), command="torchrun ... --all-to-all-into", log=print
    )


def _two_process_profile(tmp_path: Path) -> Path:
    data = json.loads(load_profile("cpu-gloo").to_json())
    data["communication"].pop("all_to_all_links", None)
    data["provenance"]["run"]["threads_per_process"] = 1
    src = tmp_path / "two.json"
    src.write_text(json.dumps(data))
    return src


@pytest.mark.timeout(210)
def test_all_to_all_alone_keeps_every_other_number(tmp_path: Path) -> None:
    src = _two_process_profile(tmp_path)
    out = tmp_path / "out.json"
    run_gloo(_into_worker, world=2, args=(str(src), str(out), "float32"), timeout=180)
    before, after = json.loads(src.read_text()), json.loads(out.read_text())
    (link,) = after["communication"].pop("all_to_all_links")
    assert link["group_size"] == 2 and link["bandwidth_bytes_per_second"] > 0
    method, notes = after["provenance"].pop("method"), after["provenance"].pop("notes")
    assert method.startswith(before["provenance"].pop("method") + "; all_to_all_links measured")
    assert notes[:-1] == before["provenance"].pop("notes") and "all-to-all fit" in notes[-1]
    assert after == before
    Profile.from_json(out.read_text())


@pytest.mark.timeout(270)
def test_all_to_all_alone_refuses_another_set_up(tmp_path: Path) -> None:
    src = _two_process_profile(tmp_path)
    data = json.loads(src.read_text())
    data["provenance"]["run"]["processes"] = 4
    four = tmp_path / "four.json"
    four.write_text(json.dumps(data))
    with pytest.raises(SpawnError, match="measured with 4 processes x 1 threads; this run has 2"):
        run_gloo(
            _into_worker, world=2, args=(str(four), str(tmp_path / "x"), "float32"), timeout=120
        )
    with pytest.raises(SpawnError, match="not --model tiny in float64"):
        run_gloo(
            _into_worker, world=2, args=(str(src), str(tmp_path / "x"), "float64"), timeout=120
        )


def test_all_to_all_alone_needs_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--all-to-all-into", "profiles/cpu-gloo.json"])
    assert exc.value.code == 2
    assert "run it under torchrun with >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    assert "--out is required (or --all-to-all-into PROFILE)" in capsys.readouterr().err
