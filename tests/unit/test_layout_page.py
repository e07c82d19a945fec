"""``docs/layout.md`` is what ``tools/layout_page.py`` writes today, from docstrings that each
say in their first line what their module is, and it names the repository's real folders."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import layout_page
import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Modules whose docstring's first line is not yet a whole sentence (it runs on to the next line,
#: so the page shows half of it). Only shrinks: an entry that is fixed fails the test too.
FIRST_LINES_TO_FIX: dict[str, str] = {}


def test_the_page_is_what_the_script_writes() -> None:
    assert layout_page.PAGE.read_text() == layout_page.render(), (
        f"docs/layout.md is stale: run `{layout_page.COMMAND}` and commit the page"
    )


def test_every_module_says_what_it_is_in_one_first_line() -> None:
    missing, unfinished = [], []
    for path in sorted((ROOT / "dyncp").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc:
            missing.append(name)
        elif not doc.strip().splitlines()[0].rstrip().endswith((".", ":")):
            unfinished.append(name)
    assert not missing, f"modules without a docstring: {missing}"
    new = sorted(set(unfinished) - set(FIRST_LINES_TO_FIX))
    assert not new, f"the docstring's first line must be one whole sentence: {new}"
    fixed = sorted(set(FIRST_LINES_TO_FIX) - set(unfinished))
    assert not fixed, f"fixed, remove from FIRST_LINES_TO_FIX: {fixed}"


def test_the_page_names_the_repository_s_folders_and_test_tiers() -> None:
    try:
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {f.split("/")[0] + "/" for f in tracked if "/" in f}
    assert folders == set(layout_page.FOLDERS), "FOLDERS in tools/layout_page.py"
    for tier in ("tests/unit", "tests/multirank", "tests/examples", "tests/support"):
        assert (ROOT / tier).is_dir() and f"`{tier}/" in layout_page.FOLDERS["tests/"], tier


def test_the_check_mode_says_which_command_writes_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "layout.md"
    stale.write_text("# Layout\n")
    monkeypatch.setattr(layout_page, "PAGE", stale)
    monkeypatch.setattr(layout_page, "ROOT", tmp_path)
    assert layout_page.main(["--check"]) == 1
    assert f"run `{layout_page.COMMAND}`" in capsys.readouterr().err
    assert layout_page.main([]) == 0 and layout_page.main(["--check"]) == 0
