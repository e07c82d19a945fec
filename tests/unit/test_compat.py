"""dyncp 0.1's import paths (``dyncp._compat.MOVED``) still work: each warns, naming its new path,
and gives the new module's objects, so that a monkeypatch through the old name is seen."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from dyncp._compat import MOVED

ROOT = Path(__file__).resolve().parents[2]


def fresh_import(monkeypatch: pytest.MonkeyPatch, old: str) -> types.ModuleType:
    """Import ``old`` as a first import would (its alias dropped from ``sys.modules`` for the
    test), checking the DeprecationWarning that names every new path."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"^{old} moved to ") as caught:
        module = importlib.import_module(old)
    message = str(caught[0].message)
    assert all(new in message for new in MOVED[old]), message
    return module


def public_names(module: types.ModuleType) -> list[str]:
    """Its ``__all__``, else the public functions and classes it defines (``service.cli``)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    names = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
    ]
    assert names, f"{module.__name__} has no public names to compare"
    return names


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_gives_the_new_objects(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    module = fresh_import(monkeypatch, old)
    targets = [importlib.import_module(new) for new in MOVED[old]]
    if len(targets) == 1:
        assert module is targets[0]
        assert module.__spec__.name == MOVED[old][0], "the new module's own spec is kept"
    for target in targets:
        for name in public_names(target):
            holder = next(t for t in targets if hasattr(t, name))
            assert getattr(module, name) is getattr(holder, name), f"{old}.{name}"
    if len(targets) > 1:  # `from dyncp.calibration import *` gives every new module's names
        assert set(module.__all__) >= {n for t in targets for n in public_names(t)}
    package, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(package), leaf) is module  # `from dyncp import menu`


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_monkeypatch_through_the_old_path_is_seen_by_the_new_module(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)
    for new in MOVED[old]:
        target = importlib.import_module(new)
        name = public_names(target)[-1]
        before, patched = getattr(target, name), object()
        with monkeypatch.context() as patch:
            patch.setattr(module, name, patched)
            assert getattr(target, name) is patched, f"{old}.{name} patched, {new} sees the old"
        assert getattr(target, name) is before  # and the undo is seen too


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=200
    )


@pytest.mark.timeout(240)
def test_python_m_dyncp_serve_runs_the_service_cli() -> None:
    out = run("-m", "dyncp.serve", "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("usage: python -m dyncp.service"), out.stdout[:500]
    assert "--global-batch-tokens" in out.stdout


@pytest.mark.timeout(120)
def test_an_old_path_in_a_fresh_interpreter_warns_where_it_is_imported(tmp_path: Path) -> None:
    # A script's own DeprecationWarnings are shown by default: the warning must name its line.
    script = tmp_path / "old_code.py"
    script.write_text("import dyncp.plan_auth\nprint(dyncp.plan_auth.__name__)\n")
    out = run(str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "dyncp.control.signing"
    assert f"{script}:1: DeprecationWarning: dyncp.plan_auth moved to dyncp.control.signing" in (
        out.stderr
    )
