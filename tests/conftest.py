"""Test tiers by folder: tests/unit (one process, by package), tests/multirank (gloo processes),
tests/examples (the example scripts end to end). Each tier's marker is set from its folder, so
``pytest -m "not multirank"`` runs the one-process tiers alone.

Property tests (hypothesis) run derandomized: the same examples on every machine and every run,
so a red CI names a change, not a draw. ``HYPOTHESIS_PROFILE=explore`` draws fresh examples (run
it when changing a bound or a cost; it is how the xfail in test_lp_bound_exact.py was found).
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TIERS = {"multirank": pytest.mark.multirank, "examples": pytest.mark.examples}
ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT).parts
        mark = TIERS.get(parts[0]) if parts else None
        if mark is not None:
            item.add_marker(mark)
