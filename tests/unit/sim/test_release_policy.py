"""The simulator's ``megatron-core`` policy: megatron-core's own scheduler in a child process,
priced as the release runs it, its capacity overflow reported; a child that cannot start is
one line, not a hang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dyncp.sim import release
from dyncp.sim.__main__ import main

ARGS = ["--world", "8", "--capacity", "2048", "--max-length", "16384", "--steps", "2"]


def test_the_release_is_priced_beside_dyncp(tmp_path: Path, capsys) -> None:
    pytest.importorskip("megatron.core", reason="needs the megatron extra")
    out = tmp_path / "r.json"
    assert main([*ARGS, "--policies", "megatron-core,megatron,dyncp", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "megatron-core over capacity: " in text
    report = json.loads(out.read_text())
    o = report["overflow"]["megatron-core"]
    assert o["steps"] == 2 and o["sub_samples"] == round(report["mean_batch_documents"] * 2)
    pol = report["policies"]
    # On these two batches (not a general claim: bench/megatron_core_bench.py measures it).
    assert pol["dyncp"]["mean_step_seconds"] < pol["megatron-core"]["mean_step_seconds"]


def test_a_child_that_cannot_start_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(release, "_CHILD", "dyncp.no_such_module")
    with pytest.raises(SystemExit) as info:
        main([*ARGS, "--policies", "megatron-core"])
    assert info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "policy megatron-core: dyncp.no_such_module exited: " in last
    assert "No module named dyncp.no_such_module" in last
