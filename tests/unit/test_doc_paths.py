"""The pages name files and modules that exist: a path or a dotted module in the README or under
docs/ that a move left behind fails here, with the page and the name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# A repository file or folder in backticks: `dyncp/plan/contract.py`, `results/`, a command's
# argument (`python bench/x.py`); a file has a suffix and a folder ends in "/", so prose such as
# "dyncp/static" (a ratio) and other projects' folders are not taken for ours. Globs and
# placeholders (`examples/train_*.py`, `profiles/<name>.json`) are not paths.
SPAN = re.compile(r"`([^`\n]+)`")
TOKEN = re.compile(
    r"(?<![\w/.-])((?:dyncp|tests|bench|examples|results|dashboards|tools)/[^\s`'\"),;:]*)"
)
# A dotted module: `dyncp.x.y` in backticks, `python -m dyncp.x`, `::: dyncp.x` (API pages).
MODULE = re.compile(r"(?:`|-m |::: )(dyncp(?:\.\w+)+)")


def _paths() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        spans = SPAN.findall(page.read_text())
        names = {t.rstrip(".") for span in spans for t in TOKEN.findall(span)}
        for name in sorted(names):
            is_file = bool(Path(name).suffix) or name.endswith("/")
            if is_file and not any(c in name for c in "*<>{}"):
                found.append((str(page.relative_to(ROOT)), name))
    return found


def _modules() -> list[tuple[str, str]]:
    return [
        (str(page.relative_to(ROOT)), name)
        for page in PAGES
        for name in sorted(set(MODULE.findall(page.read_text())))
    ]


@pytest.mark.parametrize(("page", "path"), _paths())
def test_a_named_path_exists(page: str, path: str) -> None:
    assert (ROOT / path).exists(), f"{page} names {path}, which does not exist"


def _source(module: str) -> Path | None:
    """The file that defines ``module``, found without importing it (torch stays unimported)."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _resolves(dotted: str) -> bool:
    """A module, or a name defined in one (``dyncp.planner.Planner``, ``...Planner.plan``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        source = _source(".".join(parts[:cut]))
        if source is not None:
            if cut == len(parts):
                return True
            name = re.escape(parts[cut])
            text = source.read_text()
            return (
                re.search(
                    rf"^\s*(class|def)\s+{name}\b|^{name}\b|\b{name},?$|\"{name}\"", text, re.M
                )
                is not None
            )
    return False


@pytest.mark.parametrize(("page", "module"), _modules())
def test_a_named_module_exists(page: str, module: str) -> None:
    assert _resolves(module), f"{page} names {module}, which is neither a module nor in one"
