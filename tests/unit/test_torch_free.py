"""The cost model, the calibration, the planner and the simulator import no torch (DESIGN:
``python -m dyncp.sim`` runs on a laptop): each is imported in a fresh interpreter in which any
import of torch fails."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dyncp.cost_model

#: Modules of dyncp.cost_model that are thin entry points to the torch-side profiler
#: (``dyncp.profiling``), kept for existing ``python -m dyncp.cost_model.<name>`` commands.
ENTRY_POINTS = {"profile", "validate"}

BLOCKER = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (imported: {name})")
        return None

sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    __import__(name)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch imported"
"""

COST_MODEL = sorted(
    f"dyncp.cost_model.{m.name}"
    for m in pkgutil.iter_modules(dyncp.cost_model.__path__)
    if m.name not in ENTRY_POINTS
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "modules",
    [
        ["dyncp.cost_model", *COST_MODEL],
        ["dyncp.cost_model.calibration.online"],
        ["dyncp.planner"],
        ["dyncp.sim"],
    ],
    ids=["cost_model", "calibration", "planner", "sim"],
)
def test_imports_without_torch(modules):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", BLOCKER, *modules],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_blocker_really_blocks():
    out = subprocess.run(
        [sys.executable, "-c", BLOCKER, "dyncp.profiling.packs"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode != 0 and "torch is blocked" in out.stderr
