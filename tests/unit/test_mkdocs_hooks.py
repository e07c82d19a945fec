"""Identifiers in the site's tables break at their dots and underscores, never mid-word
(tools/mkdocs_hooks.py adds the break opportunities; docs/stylesheets/extra.css forbids others)."""

from __future__ import annotations

from pathlib import Path

from mkdocs_hooks import break_points, on_page_content

ROOT = Path(__file__).resolve().parents[2]


def test_a_dotted_or_snake_case_name_breaks_after_each_separator() -> None:
    assert break_points("dyncp.integrations.fsdp.FSDPRunner") == (
        "dyncp.<wbr>integrations.<wbr>fsdp.<wbr>FSDPRunner"
    )
    assert break_points("dyncp_plan_seconds") == "dyncp_<wbr>plan_<wbr>seconds"
    assert break_points("dyncp/cost_model/x.json") == (
        "dyncp/<wbr>cost_<wbr>model/<wbr>x.<wbr>json"
    )


def test_no_break_inside_a_word_an_entity_or_at_a_leading_or_trailing_separator() -> None:
    for text in ("FSDPRunner", "_private", "x.", "...", "./run", "a2a&lt;u&gt;"):
        assert "<wbr>" not in break_points(text), text
    assert break_points("ring&lt;c&gt;_total") == "ring&lt;c&gt;_total"  # ';' is no word character


def test_only_the_inline_code_of_tables_is_touched() -> None:
    page = (
        "<p><code>a.b</code></p><pre><code>x.y</code></pre>"
        "<table><tr><td><code>dyncp.ddp.DDPRunner</code> and text.with.dots</td></tr></table>"
    )
    out = on_page_content(page)
    assert out.startswith("<p><code>a.b</code></p><pre><code>x.y</code></pre>")
    assert "<code>dyncp.<wbr>ddp.<wbr>DDPRunner</code> and text.with.dots" in out


def test_the_stylesheet_forbids_other_breaks_in_table_code() -> None:
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rule = css[css.index(".md-typeset table:not([class]) code {") :]
    rule = rule[: rule.index("}")]
    assert "word-break: normal" in rule and "overflow-wrap: normal" in rule, rule
