"""The simulator's ``megatron-core`` policy: megatron-core's own scheduler in a child process,
priced as the release runs it, its capacity overflow reported; a child that cannot start is
one line, not a hang."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from dyncp.sim import release
from dyncp.sim.__main__ import main

ARGS = ["--world", "8", "--capacity", "2048", "--max-length", "16384", "--steps", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    """One simulator run (the child's start and megatron-core's import are the slow part): the
    release beside static and dyncp, on a profile with the whole step (h100-reference-step plans
    exactly as h100-reference)."""
    pytest.importorskip("megatron.core", reason="needs the megatron extra")
    out = tmp_path_factory.mktemp("release") / "r.json"
    argv = [*ARGS, "--profile", "h100-reference-step", "--policies", "megatron-core,static,dyncp"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), text.getvalue()


def test_the_release_is_priced_beside_dyncp(run) -> None:
    report, text = run
    assert "megatron-core over capacity: " in text
    o = report["overflow"]["megatron-core"]
    assert o["steps"] == 2 and o["sub_samples"] == round(report["mean_batch_documents"] * 2)
    pol = report["policies"]
    # On these two batches (not a general claim: bench/megatron_core_bench.py measures it).
    assert pol["dyncp"]["mean_step_seconds"] < pol["megatron-core"]["mean_step_seconds"]


def test_the_release_pays_the_same_whole_step_parts(run) -> None:
    # Whole-step speedups over the release need its step parts: its planned part is its own
    # barrier-timed step, the parts outside it those every policy pays on this world.
    report, _ = run
    rel, static = (report["policies"][k] for k in ("megatron-core", "static"))
    parts = rel["mean_step_parts"]
    assert parts["planned"] == pytest.approx(rel["mean_step_seconds"], rel=1e-9)
    assert parts["gradient_reduction"] > 0
    for k in ("gradient_reduction", "optimizer", "fixed"):
        assert parts[k] == pytest.approx(static["mean_step_parts"][k], rel=1e-9)
    whole = report["whole_step_speedup_vs_static"]["megatron-core"]
    assert whole == pytest.approx(static["mean_step_parts"]["total"] / parts["total"], rel=1e-9)


def test_a_child_that_cannot_start_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(release, "_CHILD", "dyncp.no_such_module")
    with pytest.raises(SystemExit) as info:
        main([*ARGS, "--policies", "megatron-core"])
    assert info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "policy megatron-core: dyncp.no_such_module exited: " in last
    assert "No module named dyncp.no_such_module" in last
