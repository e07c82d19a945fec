"""The README's Gantt chart is what its caption's command draws today.

``bench/readme_figures.py`` draws ``docs/gantt-wikipedia.png`` with the caption's command and
records, beside it, what the picture shows (the policies in panel order, each one's predicted
step). The picture's bytes depend on matplotlib's version, the record only on the plans; so the
slow test replays the command and compares the record, and the fast ones check that every page
showing the picture names the recorded command and policies, and that the comparison can fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench_modules import load_bench

ROOT = Path(__file__).resolve().parents[2]
figures = load_bench("readme_figures")
RECORD = json.loads(figures.RECORD.read_text())
# Every page that shows the picture, with the path it uses for it.
PAGES = {
    "README.md": "docs/gantt-wikipedia.png",
    "docs/index.md": "gantt-wikipedia.png",
    "docs/guides/observability.md": "../gantt-wikipedia.png",
}


def _policy_phrase(policies: list[str]) -> str:
    return ", ".join(policies[:-1]) + " and " + policies[-1]


@pytest.mark.timeout(600)
def test_the_record_is_what_the_caption_command_plans_now() -> None:
    diff = figures.check()
    assert not diff, "docs/gantt-wikipedia.png is stale (python bench/readme_figures.py):\n" + (
        "\n".join(diff)
    )


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_page_shows_the_picture_under_its_command_and_policies(page: str) -> None:
    text = " ".join((ROOT / page).read_text().split())  # captions wrap anywhere
    image = re.search(rf"!\[([^\]]*)\]\({re.escape(PAGES[page])}\)", text)
    assert image, f"{page} does not show {PAGES[page]}"
    around = text[max(0, image.start() - 600) : image.end() + 1000]  # the caption, either side
    assert RECORD["command"] in around, f"{page}: the caption does not name {RECORD['command']}"
    phrase = _policy_phrase(RECORD["policies"])
    assert phrase in around, f"{page}: the caption does not list {phrase}"


def test_the_record_names_the_pictures_command_and_every_panel() -> None:
    assert RECORD["command"] == figures.COMMAND
    assert RECORD["policies"] and set(RECORD["step_seconds"]) == set(RECORD["policies"])
    assert all(s > 0 for s in RECORD["step_seconds"].values())


def test_a_moved_plan_or_a_lost_panel_is_a_difference() -> None:
    fresh = json.loads(json.dumps(RECORD))
    assert figures.differences(RECORD, fresh) == []
    fresh["step_seconds"]["dyncp"] *= 1 + 1e-12  # within the tolerance: the same plan
    assert figures.differences(RECORD, fresh) == []
    fresh["step_seconds"]["dyncp"] *= 1.001
    assert [d.split(":")[0] for d in figures.differences(RECORD, fresh)] == ["step_seconds"]
    fresh = json.loads(json.dumps(RECORD))
    fresh["policies"] = fresh["policies"][:-1]
    assert [d.split(":")[0] for d in figures.differences(RECORD, fresh)] == ["policies"]
