"""Rich display: HTML tables and pictures for Jupyter, plain tables for a terminal.

``Program``, ``ShapeInfo``, ``DispatchTable`` and ``Report`` call into here from their
``_repr_html_`` / ``_repr_png_`` / ``__str__``; the graph text itself always comes from the
canonical printer (``passes.printer``).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shapewise.passes.printer import format_graph, format_program
from shapewise.passes.program import Program, ShapeInfo, TensorMeta

__all__ = [
    "REPORT_COLUMNS",
    "Report",
    "html_table",
    "piece_rows",
    "program_html",
    "program_png",
    "shapes_html",
    "symbol_rows",
    "table_html",
    "table_text",
    "text_table",
]

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


def _pre(text: str, summary: str | None = None) -> str:
    block = f"<pre style='font-size:85%'>{html.escape(text)}</pre>"
    return f"<details><summary>{html.escape(summary)}</summary>{block}</details>" if summary else block


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


# -- shapes ------------------------------------------------------------------------------------

def _input_row(name: str, meta: Any) -> dict[str, Any]:
    if isinstance(meta, TensorMeta):
        return {"input": name, "kind": str(meta.dtype).replace("torch.", ""),
                "shape": "[" + ", ".join(str(e) for e in meta.shape) + "]",
                "stride": "(" + ", ".join(str(e) for e in meta.stride) + ")", "offset": str(meta.offset)}
    if hasattr(meta, "free_symbols"):
        return {"input": name, "kind": "SymInt", "shape": str(meta), "stride": "", "offset": ""}
    return {"input": name, "kind": type(meta).__name__, "shape": repr(meta), "stride": "", "offset": ""}


def symbol_rows(shapes: ShapeInfo) -> list[dict[str, Any]]:
    rows = []
    for s in shapes.symbols:
        lo, hi = shapes.ranges.get(s, (None, None))
        src = shapes.sources.get(s)
        rows.append({"symbol": str(s), "name": shapes.names.get(s, ""), "read from": str(src) if src else "derived",
                     "traced": shapes.hints.get(s, ""), "range": f"[{lo}, {hi if hi is not None else 'inf'}]"})
    return rows


def shapes_html(shapes: ShapeInfo) -> str:
    """Symbols, inputs (shape/stride/offset as sympy) and guards as HTML tables."""
    parts = [html_table(symbol_rows(shapes), caption="symbols")]
    parts.append(html_table([_input_row(n, m) for n, m in zip(shapes.input_names, shapes.inputs)],
                            caption="inputs"))
    guards = [{"guard": str(g), "from": where} for g, where in shapes.guards]
    parts.append(html_table(guards, ["guard", "from"], caption="guards") if guards else "<p>guards: none</p>")
    return "<div>" + "".join(parts) + "</div>"


# -- dispatch table ----------------------------------------------------------------------------

def _table_header(table: Any) -> str:
    names = ", ".join(f"{s}" + (f" ({table.names[s]})" if s in table.names else "") + f" ← {src}"
                      for s, src in zip(table.symbols, table.sources))
    return (f"DispatchTable: {len(table.static_keys)} exact, {len(table.range_bindings)} ranges, "
            f"on_miss={table.on_miss!r}; key = ({names})")


def table_text(table: Any) -> str:
    """A dispatch table as text: what the key reads, then one row per entry."""
    return _table_header(table) + "\n" + text_table(table.rows(), ["kind", "key"])


def table_html(table: Any) -> str:
    return html_table(table.rows(), ["kind", "key"], caption=_table_header(table))


# -- program -----------------------------------------------------------------------------------

def program_png(program: Program) -> bytes | None:
    """The split picture as PNG bytes; None for an unsplit program or without matplotlib."""
    if program.graph is None:
        return None
    try:
        from shapewise.graph_split.draw import split_png

        return split_png(program)
    except ImportError:
        return None


def piece_rows(program: Program) -> list[dict[str, Any]]:
    from shapewise.graph_split.draw import op_count

    rows = []
    for p in program.pieces:
        names = p.shapes.names if p.shapes else {}
        n_in = sum(1 for n in p.gm.graph.nodes if n.op == "placeholder")
        out = next(n for n in p.gm.graph.nodes if n.op == "output")
        n_out = len(out.args[0]) if isinstance(out.args[0], (tuple, list)) else 1
        variants = [v.binding.describe(names) + ("" if v.compiled is not None else " (uncompiled)")
                    for v in p.variants]
        rows.append({"piece": p.name, "kind": "splitting op (runs as is)" if p.is_splitting else "compiled",
                     "ops": op_count(p.gm), "inputs": n_in, "outputs": n_out, "variants": ", ".join(variants)})
    return rows


def program_html(program: Program, picture: bool = True) -> str:
    """Pieces, symbols, bindings and dispatch as HTML, with the split picture embedded."""
    parts = []
    n_split = sum(1 for p in program.pieces if p.is_splitting)
    head = (f"Program: {len(program.pieces)} pieces ({n_split} splitting)" if program.graph is not None
            else "Program: not split yet")
    parts.append(f"<p><b>{html.escape(head)}</b></p>")
    png = program_png(program) if picture else None
    if png is not None:
        parts.append(f"<img src='data:image/png;base64,{base64.b64encode(png).decode()}' style='max-width:100%'/>")
    if program.graph is not None:
        parts.append(html_table(piece_rows(program), caption="pieces"))
    else:
        parts.append(_pre(format_graph(program.gm), "graph"))
    if program.shapes is not None:
        parts.append(html_table(symbol_rows(program.shapes), caption="symbols"))
        guards = [{"guard": str(g), "from": where} for g, where in program.shapes.guards]
        if guards:
            parts.append(html_table(guards, ["guard", "from"], caption="guards"))
    if program.bindings is not None:
        names = program.shapes.names if program.shapes else {}
        parts.append(html_table([{"binding": b.describe(names), "static": b.is_static} for b in program.bindings],
                                caption="bindings"))
    if program.dispatch is not None:
        parts.append(table_html(program.dispatch))
    parts.append(_pre(format_program(program), "text (canonical printer)"))
    return "<div>" + "".join(parts) + "</div>"
