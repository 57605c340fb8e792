"""Rich display for Jupyter: ``Program`` and ``ShapeInfo`` as HTML tables with the split picture.

This module registers its renderers in ``shapewise.ir.RENDERERS`` when imported (``import
shapewise`` does), so the IR never imports it; the graph text itself always comes from the
canonical printer (``shapewise.ir.printer``).
"""

from __future__ import annotations

import base64
import html
from typing import Any

from shapewise.graph_split.draw import op_count, split_png
from shapewise.ir.printer import format_graph, format_program
from shapewise.ir.program import RENDERERS, Program, ShapeInfo, TensorMeta
from shapewise.ir.report import html_table
from shapewise.ir.symbolic import range_text

__all__ = ["piece_rows", "program_html", "program_png", "shapes_html", "symbol_rows"]

def _pre(text: str, summary: str | None = None) -> str:
    block = f"<pre style='font-size:85%'>{html.escape(text)}</pre>"
    return f"<details><summary>{html.escape(summary)}</summary>{block}</details>" if summary else block


# -- shapes ------------------------------------------------------------------------------------

def _input_row(name: str, meta: Any) -> dict[str, Any]:
    if isinstance(meta, TensorMeta):
        kind = str(meta.dtype).replace("torch.", "")
        return {"input": name, "kind": kind if meta.subclass is None else f"{kind} {meta.subclass.cls.__name__}",
                "shape": "[" + ", ".join(str(e) for e in meta.shape) + "]",
                "stride": "(" + ", ".join(str(e) for e in meta.stride) + ")", "offset": str(meta.offset)}
    if hasattr(meta, "free_symbols"):
        return {"input": name, "kind": "SymInt", "shape": str(meta), "stride": "", "offset": ""}
    meta = getattr(meta, "real_obj", meta)  # an opaque object Dynamo lifted (a DeviceMesh), not its fake wrapper
    return {"input": name, "kind": type(meta).__name__, "shape": repr(meta), "stride": "", "offset": ""}


def symbol_rows(shapes: ShapeInfo) -> list[dict[str, Any]]:
    rows = []
    for s in shapes.symbols:
        lo, hi = shapes.ranges.get(s, (None, None))
        src = shapes.sources.get(s)
        rows.append({"symbol": str(s), "name": shapes.names.get(s, ""), "read from": str(src) if src else "derived",
                     "traced": shapes.hints.get(s, ""), "range": range_text(lo, hi)})
    return rows


def shapes_html(shapes: ShapeInfo) -> str:
    """Symbols, inputs (shape/stride/offset as sympy) and guards as HTML tables."""
    parts = [html_table(symbol_rows(shapes), caption="symbols")]
    parts.append(html_table([_input_row(n, m) for n, m in zip(shapes.input_names, shapes.inputs)],
                            caption="inputs"))
    guards = [{"guard": str(g), "from": where} for g, where in shapes.guards]
    parts.append(html_table(guards, ["guard", "from"], caption="guards") if guards else "<p>guards: none</p>")
    return "<div>" + "".join(parts) + "</div>"


# -- program -----------------------------------------------------------------------------------

def program_png(program: Program) -> bytes | None:
    """The split picture as PNG bytes; None for an unsplit program or without matplotlib."""
    if program.graph is None:
        return None
    try:
        return split_png(program)
    except ImportError:
        return None


def piece_rows(program: Program) -> list[dict[str, Any]]:
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
        parts.append(program.dispatch._repr_html_())
    parts.append(_pre(format_program(program), "text (canonical printer)"))
    return "<div>" + "".join(parts) + "</div>"


RENDERERS.update({("Program", "html"): program_html, ("Program", "png"): program_png,
                  ("ShapeInfo", "html"): shapes_html})
