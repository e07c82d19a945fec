"""The documentation site loads nothing from the network: it must work on an offline cluster.

Material loads its text font from Google Fonts unless ``theme.font`` is ``false``; a page that
pulls a script, stylesheet or font from elsewhere falls back (or hangs) where only the site's own
files are reachable. The configuration is checked always; the built site (``site/``, which CI
builds with ``mkdocs build --strict`` before the tests) when it is there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site"
# What a browser fetches by itself when it renders a page: scripts, stylesheets, fonts, images,
# frames (links a reader clicks, <a href>, are not fetched).
FETCHED = re.compile(
    r"<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=[\"']((?:https?:)?//[^\"']+)",
    re.I,
)
FONT_HOSTS = ("fonts.googleapis.com", "fonts.gstatic.com")


def test_the_theme_uses_system_fonts() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"].get("font") is False, (
        "mkdocs.yml: theme.font must be false (system fonts); Material's default loads Google Fonts"
    )


def test_the_fetch_pattern_sees_external_resources() -> None:
    page = (
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
        '<script src="//cdn.example.org/x.js"></script><a href="https://github.com/x">x</a>'
        '<link rel="stylesheet" href="../assets/main.css">'
    )
    assert FETCHED.findall(page) == [
        "https://fonts.googleapis.com/css?family=Roboto",
        "//cdn.example.org/x.js",
    ]


def test_the_built_site_fetches_nothing_external() -> None:
    pages = sorted(SITE.rglob("*.html")) if SITE.is_dir() else []
    if not pages:
        pytest.skip("site/ not built (mkdocs build --strict builds it)")
    external = {
        f"{page.relative_to(SITE)}: {url}"
        for page in pages
        for url in FETCHED.findall(page.read_text(errors="replace"))
    }
    assert not external, "the site fetches from the network:\n" + "\n".join(sorted(external)[:20])
    fonts = [
        str(css.relative_to(SITE))
        for css in SITE.rglob("*.css")
        if any(host in css.read_text(errors="replace") for host in FONT_HOSTS)
    ]
    assert not fonts, f"stylesheets that load web fonts: {fonts}"
