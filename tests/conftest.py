"""Test tiers by folder: tests/unit (one process, by package), tests/multirank (gloo processes),
tests/examples (the example scripts end to end). Each tier's marker is set from its folder, so
``pytest -m "not multirank"`` runs the one-process tiers alone."""

from pathlib import Path

import pytest

TIERS = {"multirank": pytest.mark.multirank, "examples": pytest.mark.examples}
ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT).parts
        mark = TIERS.get(parts[0]) if parts else None
        if mark is not None:
            item.add_marker(mark)
