"""The ``slow`` list in tests/conftest.py names tests that exist: a renamed or moved test would
otherwise drop out of it silently and slow down ``pytest -m "not slow"``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _conftest():
    spec = importlib.util.spec_from_file_location("_tests_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{n.name}" for n in cls.body if isinstance(n, ast.FunctionDef)}
    return {n for n in names if n.split("::")[-1].startswith("test_")}


def test_every_slow_entry_names_an_existing_test() -> None:
    slow = _conftest().SLOW
    assert slow, "the slow list is empty"
    missing = []
    for entry in sorted(slow):
        path, _, name = entry.partition("::")
        file = TESTS / path
        if not file.is_file() or name not in _test_names(file):
            missing.append(entry)
    assert not missing, f"tests/conftest.py SLOW names tests that do not exist: {missing}"
