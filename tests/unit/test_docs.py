"""The README's promises about itself: its test commands are CI's, and its links lead somewhere.

The README tells a newcomer "this is what CI runs"; if `.ci/run` changes and the README does not
(or the reverse), the newcomer runs something else than CI. So the commands of the "Two commands"
section (in README.md and on the documentation site's home page) are compared with the commands
`.ci/run` runs, in order, both ways. The site's own links are checked by `mkdocs build --strict`
in `.ci/run`; README.md is not part of the site, so its relative links are checked here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / ".ci" / "run"
# The pages that carry a "Two commands" section.
TWO_COMMANDS_PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md"]
# What CI runs that a user must run the same way: installs, the linter, the docs, the tests.
SIGNIFICANT = re.compile(r"^(pip install|ruff |mkdocs |python -m pytest)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a Markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if match is None:
        raise AssertionError(f"no '## {title}' section")
    return match.group(1)


def _normalise(command: str) -> str:
    """One command as a user types it: ``python -m pip`` is ``pip``; pip's ``--quiet`` dropped."""
    words = shlex.split(command)
    if words[:3] == ["python", "-m", "pip"]:
        words = ["pip", *words[3:]]
    if words[:1] == ["pip"]:
        words = [w for w in words if w not in ("--quiet", "-q")]
    return shlex.join(words)


def _commands(lines: list[str]) -> list[str]:
    """Every command of shell lines, split at ``&&``, comments and blank lines dropped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out.extend(_normalise(part) for part in line.split("&&") if part.strip())
    return out


def _ci_commands() -> list[str]:
    """CI's significant top-level commands (the indented apt-get fallback is machine set-up; so is
    upgrading pip itself in the fresh environment)."""
    lines = [line for line in CI.read_text().splitlines() if not line.startswith((" ", "\t"))]
    commands = [c for c in _commands(lines) if SIGNIFICANT.match(c)]
    return [c for c in commands if c != "pip install --upgrade pip"]


def test_ci_runs_installs_docs_and_tests() -> None:
    ci = _ci_commands()
    assert any(c.startswith("pip install -e") for c in ci), ci
    assert "mkdocs build --strict" in ci, ci
    assert ci[-1] == "python -m pytest -q", ci


@pytest.mark.parametrize("page", TWO_COMMANDS_PAGES, ids=lambda p: p.name)
def test_two_commands_are_what_ci_runs(page: Path) -> None:
    blocks = FENCE.findall(_section(page.read_text(), "Two commands"))
    assert len(blocks) == 2, f"{page.name}: expected 2 command blocks, found {len(blocks)}"
    simulator, tests = (_commands(block.splitlines()) for block in blocks)
    assert simulator[-1] == "python -m dyncp.sim", simulator
    # A fresh virtual environment first (CI makes its own, .venv-ci), then exactly CI's commands.
    assert tests[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], tests
    assert tests[2:] == _ci_commands(), (
        f"{page.name}'s test commands differ from .ci/run's:\n{tests[2:]}\n{_ci_commands()}"
    )


def _relative_links(text: str) -> list[str]:
    """Targets of Markdown links and images outside code blocks and spans, minus URLs/anchors."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]


def test_readme_relative_links_resolve() -> None:
    links = _relative_links((ROOT / "README.md").read_text())
    assert len(links) >= 10, links  # the README links the docs; the parser must find them
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_link_parser_sees_what_a_reader_clicks() -> None:
    text = "[a](docs/x.md) ![b](img.png) `[c](no.md)` [d](https://e.org) [f](#g)\n"
    text += "```\n[h](i)\n```\n"
    assert _relative_links(text) == ["docs/x.md", "img.png"]
