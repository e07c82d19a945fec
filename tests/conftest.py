"""Test tiers by folder: tests/unit (one process, by package), tests/multirank (gloo processes),
tests/examples (the example scripts end to end). Each tier's marker is set from its folder, so
``pytest -m "not multirank"`` runs the one-process tiers alone; ``slow`` marks the tests named in
``SLOW`` (over 5 s on a quiet 2-core machine), so ``pytest -m "not slow"`` is the quick loop.

Torch runs one intra-op thread in the test process and in every process it starts (unless
``OMP_NUM_THREADS`` is set by the caller): the tests' tensors are tiny, and a second thread
waiting on a busy core made the torch tests several times slower, on a loaded machine ten times.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch is imported: before any test module

TIERS = {"multirank": pytest.mark.multirank, "examples": pytest.mark.examples}
ROOT = Path(__file__).resolve().parent

# "<path under tests/>::<test function>" (every parametrisation of it); tests/unit/test_markers.py
# checks that each names a test that exists.
SLOW = frozenset()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT).parts
        mark = TIERS.get(parts[0]) if parts else None
        if mark is not None:
            item.add_marker(mark)
        name = getattr(item, "originalname", item.name)
        if f"{'/'.join(parts)}::{name}" in SLOW:
            item.add_marker(pytest.mark.slow)
