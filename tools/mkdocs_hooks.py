"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``).

Identifiers in table cells (``dyncp.integrations.fsdp.FSDPRunner``, metric names) are longer than
a narrow column. Browsers may only break them where the text allows, and Material's stylesheet
lets inline code break anywhere, so a cell read ``dyncp.integrations.fsdp.FS`` / ``DPRunner``.
This hook gives the browser the places a reader would break a dotted or snake-case name at: a
``<wbr>`` (a break opportunity that draws nothing and is not copied) after each ``.``, ``_``,
``/`` and ``,`` between word characters, in the inline code of tables only; the stylesheet
(``docs/stylesheets/extra.css``) forbids every other break there. Code blocks are not touched.
"""

from __future__ import annotations

import re
from typing import Any

TABLE = re.compile(r"<table>.*?</table>", re.S)
CODE = re.compile(r"<code>([^<]*)</code>")
# After a separator, when a word character follows (no break before a closing bracket or at the
# end); \w before it so that "...", "./x" and "_private" keep their first character attached.
BREAK = re.compile(r"(?<=\w)([._/,])(?=\w)")


def break_points(code: str) -> str:
    """``code`` (HTML-escaped text) with ``<wbr>`` after each separator of a dotted name."""
    return BREAK.sub(r"\1<wbr>", code)


def _table(match: re.Match[str]) -> str:
    return CODE.sub(lambda m: f"<code>{break_points(m.group(1))}</code>", match.group(0))


def on_page_content(html: str, **kwargs: Any) -> str:
    """Insert the break opportunities into every table's inline code of a rendered page."""
    return TABLE.sub(_table, html)
