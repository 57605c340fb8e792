"""Report rows and the one text/HTML table formatter: ``Report`` (a list of row dicts that
prints as an aligned table and shows as HTML in Jupyter), ``text_table``, ``html_table``."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["REPORT_COLUMNS", "Report", "html_table", "text_table"]

REPORT_COLUMNS = ("piece", "key", "static", "seconds", "source", "backend")


def _cell(value: Any, width: int = 0) -> str:
    """A value as one table cell: floats to 3 digits; text to its first line, cut to ``width``
    (the whole value stays in the row dict)."""
    if isinstance(value, float):
        return f"{value:.3g}"
    text = str(value)
    if not width:
        return text
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > width or len(lines) > 1:
        return first[: width - 3] + "..."
    return first


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    cols = list(columns or ())
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def text_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows as an aligned plain-text table; ``columns`` first, then any other keys in order."""
    cols = _columns(rows, columns)
    if not cols:
        return "(empty)"
    cells = [[_cell(r.get(c, ""), 100) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def html_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
               caption: str | None = None) -> str:
    """Rows as an HTML table (values escaped)."""
    cols = _columns(rows, columns)
    out = ['<table class="shapewise">']
    if caption:
        out.append(f"<caption style='text-align:left'><b>{html.escape(caption)}</b></caption>")
    out.append("<thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr></thead><tbody>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(_cell(r.get(c, '')))}</td>"
                                    for c in cols) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


class Report(list):
    """A list of row dicts (one per compiled variant, or per check) that shows as a table:
    ``print(report)`` in a terminal, an HTML table in Jupyter."""

    def __init__(self, rows: Iterable[Mapping[str, Any]] = (), columns: Sequence[str] | None = REPORT_COLUMNS):
        super().__init__(rows)
        self.columns = tuple(columns or ())

    def __str__(self) -> str:
        return text_table(self, self.columns)

    def _repr_html_(self) -> str:
        return html_table(self, self.columns, caption=f"{len(self)} rows")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))
