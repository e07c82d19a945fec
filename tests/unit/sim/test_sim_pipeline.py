"""``python -m dyncp.sim --pp P [--vpp V]``: every policy's plans pipelined, reported with the
bubble and the pipelined bound; pipelined Gantt charts; bad pipeline flags in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dyncp.sim.__main__ import main

SMALL = ["--world", "8", "--ranks-per-node", "4", "--capacity", "512", "--max-length", "4096"]
POLICIES = ["--policies", "static,megatron,dyncp"]


def test_pipelined_replay_reports_bubbles_and_the_pipelined_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    assert main([*SMALL, *POLICIES, "--steps", "2", "--pp", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["pipeline"] == {"stages": 2, "virtual": 1}
    policies = report["policies"]
    for name in ("static", "megatron", "dyncp"):
        p = policies[name]
        assert 0.0 <= p["mean_bubble_fraction"] < 1.0
        assert p["mean_imbalance"] is None  # a pipelined plan's balance is its bubble
        assert p["mean_step_seconds"] >= report["lower_bound_mean_step_seconds"] * (1 - 1e-9)
    assert policies["dyncp"]["mean_step_seconds"] <= policies["megatron"]["mean_step_seconds"]
    printed = capsys.readouterr().out
    assert "pipelined over 2 stages (1f1b)" in printed and " bubble " in printed


def test_interleaved_replay_and_its_gantt(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    args = [*SMALL, *POLICIES, "--steps", "1", "--pp", "2", "--vpp", "2", "--plot", str(plots)]
    assert main(args) == 0
    assert {p.name for p in plots.iterdir()} == {
        "pipeline-gantt.png",
        "step-seconds.png",
        "step-parts.png",
        "timeseries.png",
    }


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--vpp", "2"], "--vpp 2 needs --pp"),
        (["--pp", "1", "--vpp", "2"], "--pp 1 --vpp 2: virtual stages (2) need at least 2"),
        (["--pp", "2", "--metrics-port", "0"], "--metrics-port with --pp"),
        (["--pp", "0"], "argument --pp: expected a positive integer"),
    ],
)
def test_bad_pipeline_flags_are_one_line(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--steps", "1", *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and named in lines[0], lines
