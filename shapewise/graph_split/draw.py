"""The split as a picture: a networkx DiGraph of pieces and the values crossing between them,
drawn with matplotlib (no system graphviz needed) or written as graphviz DOT text.

>>> g = split_graph(program)        # nodes: "input", piece_0 ... piece_N, "output"
>>> g.edges["piece_0", "piece_1"]["values"]
(Crossing(name='q', shape=(s0, 4, 8), dtype=torch.float32, expr=None), ...)
>>> draw_split(program, "split.png")
"""

from __future__ import annotations

import colorsys
import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import networkx as nx
import sympy
import torch
import torch.fx

from shapewise._compat import node_value, sym_expr
from shapewise.errors import ShapewiseError
from shapewise.ir.program import Piece, Program

__all__ = [
    "INPUT",
    "OUTPUT",
    "Crossing",
    "draw_split",
    "op_count",
    "piece_colour",
    "split_dot",
    "split_graph",
    "split_png",
]

INPUT = "input"
OUTPUT = "output"
_IO_COLOUR = "#e6e6e6"
_CALLS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Crossing:
    """A value crossing an edge of the split: a tensor (``shape``, ``dtype``) or a SymInt (``expr``)."""

    name: str
    shape: tuple[sympy.Expr, ...] | None = None
    dtype: torch.dtype | None = None
    expr: sympy.Expr | None = None

    @property
    def is_dynamic(self) -> bool:
        """Whether any size of this value is symbolic."""
        if self.shape is None:
            return self.expr is not None and bool(sympy.sympify(self.expr).free_symbols)
        return any(bool(sympy.sympify(e).free_symbols) for e in self.shape)

    def __str__(self) -> str:
        if self.shape is not None:
            dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
            return f"{self.name}: {dtype}[{', '.join(str(e) for e in self.shape)}]"
        if self.expr is not None:
            return f"{self.name}: sym {self.expr}"
        return self.name


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    text = str(target)
    if " at 0x" not in text:  # OpOverloads and builtins print stably; plain functions do not
        return text
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"


def op_count(gm: torch.fx.GraphModule) -> int:
    """Number of calls (functions, methods, modules) in a graph."""
    return sum(1 for n in gm.graph.nodes if n.op in _CALLS)


def _signature(piece: Piece) -> str:
    return "\n".join(_target_name(n.target) for n in piece.gm.graph.nodes if n.op in _CALLS)


def piece_colour(piece: Piece) -> str:
    """A colour from a stable hash (blake2b, not ``hash()``) of the piece's op sequence:
    the same from run to run, and shared by pieces that call the same ops."""
    digest = hashlib.blake2b(_signature(piece).encode(), digest_size=4).digest()
    hue = int.from_bytes(digest, "big") / 2**32
    sat, val = (0.55, 0.95) if piece.is_splitting else (0.30, 0.97)
    r, g, b = colorsys.hsv_to_rgb(hue, sat, val)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _crossing(node: torch.fx.Node) -> Crossing:
    value = node_value(node)
    if isinstance(value, torch.Tensor):
        return Crossing(node.name, tuple(sym_expr(d) for d in value.shape), value.dtype)
    if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
        return Crossing(node.name, expr=sym_expr(value))
    return Crossing(node.name)


def _label(values: Iterable[Crossing]) -> str:
    """Dynamic values grouped by layout (``q, k, v: float32[s0, 4, 8]``); static ones counted."""
    groups: dict[str, list[str]] = {}
    static = 0
    for v in values:
        if not v.is_dynamic:
            static += 1
            continue
        text = str(v)
        layout = text.split(": ", 1)[1] if ": " in text else ""
        groups.setdefault(layout, []).append(v.name)
    lines = [f"{', '.join(names)}: {layout}" if layout else ", ".join(names) for layout, names in groups.items()]
    if static:
        lines.append(f"+{static} static")
    return "\n".join(lines)


def split_graph(program: Program) -> nx.DiGraph:
    """The split program as a DiGraph.

    Nodes, in order: ``"input"``, one per piece (by name), ``"output"``. Piece attributes:
    ``kind="piece"``, ``name``, ``index``, ``splitting``, ``ops`` (number of calls),
    ``targets`` (the ops a splitting piece calls), ``variants``, ``colour``. Each edge carries
    ``values``: the ``Crossing`` values (name, symbolic shape, dtype) passed along it, and a
    ``label``. Everything comes from the stitching graph's node metadata.
    """
    if program.graph is None:
        raise ShapewiseError("split_graph needs a split program: run Split first")
    g = nx.DiGraph(name="split")
    placeholders = [n for n in program.graph.graph.nodes if n.op == "placeholder"]
    g.add_node(INPUT, kind="input", name=INPUT, index=-1, splitting=False, ops=0, targets=(), variants=0,
               colour=_IO_COLOUR, values=tuple(_crossing(n) for n in placeholders))
    pieces = {p.name: p for p in program.pieces}
    for i, p in enumerate(program.pieces):
        targets = tuple(dict.fromkeys(_target_name(n.target) for n in p.gm.graph.nodes
                                      if n.op in _CALLS and "getitem" not in _target_name(n.target)))
        g.add_node(p.name, kind="piece", name=p.name, index=i, splitting=p.is_splitting, ops=op_count(p.gm),
                   targets=targets if p.is_splitting else (), variants=len(p.variants), colour=piece_colour(p))
    g.add_node(OUTPUT, kind="output", name=OUTPUT, index=len(program.pieces), splitting=False, ops=0, targets=(),
               variants=0, colour=_IO_COLOUR)

    producer: dict[torch.fx.Node, str] = {n: INPUT for n in placeholders}
    crossings: dict[tuple[str, str], dict[str, Crossing]] = {}

    def add(src: torch.fx.Node, dst: str) -> None:
        if src not in producer:
            return
        crossings.setdefault((producer[src], dst), {}).setdefault(src.name, _crossing(src))

    for node in program.graph.graph.nodes:
        if node.op == "call_module" and node.target in pieces:
            for a in node.all_input_nodes:
                add(a, node.target)
        elif node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].op == "call_module":
            producer[node] = node.args[0].target  # a getitem of a piece's outputs
        elif node.op == "output":
            for a in node.all_input_nodes:
                add(a, OUTPUT)
    for (u, v), values in crossings.items():
        vals = tuple(values.values())
        g.add_edge(u, v, values=vals, label=_label(vals))
    return g


# -- drawing -----------------------------------------------------------------------------------

_STEP = 3.0  # horizontal distance between node centres, in data units
_BOX_W, _BOX_H = 1.3, 0.8
_INCH = 0.7  # inches per data unit


def _short_op(target: str) -> str:
    name = target.removesuffix(".default")
    return name.split("::")[-1].split(".")[-1]


def _node_text(data: dict[str, Any]) -> str:
    if data["kind"] != "piece":
        n = len(data.get("values", ()))
        return f"{data['name']}\n({n} values)" if data["kind"] == "input" else data["name"]
    ops = f"{data['ops']} op" + ("s" if data["ops"] != 1 else "")
    if data["splitting"]:
        return "\n".join([data["name"], ", ".join(_short_op(t) for t in data["targets"]), "(splitting)"])
    lines = [data["name"], ops]
    if data["variants"]:
        lines.append(f"{data['variants']} variant" + ("s" if data["variants"] != 1 else ""))
    return "\n".join(lines)


def _wrap(label: str, width: int = 20) -> str:
    out = []
    for line in label.split("\n"):
        head, sep, tail = line.partition(": ")
        out.extend([head + ":", tail] if sep and len(line) > width else [line])
    return "\n".join(out)


def _curve(x0: float, x1: float, span: int, above: bool) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """Bezier control points of one edge and the point where its label goes."""
    if span == 1:
        p0, p1 = (x0 + _BOX_W / 2, 0.0), (x1 - _BOX_W / 2, 0.0)
        return [p0, p1], ((p0[0] + p1[0]) / 2, 0.05)
    sign = 1.0 if above else -1.0
    y0 = sign * _BOX_H / 2
    ctrl_y = sign * (_BOX_H / 2 + 0.9 + 0.7 * (span - 2))
    p0, c, p1 = (x0, y0), ((x0 + x1) / 2, ctrl_y), (x1, y0)
    mid = ((p0[0] + 2 * c[0] + p1[0]) / 4, (p0[1] + 2 * c[1] + p1[1]) / 4)
    return [p0, c, p1], mid


def draw_split(program: Program, path: Any = None, ax: Any = None, dpi: int = 100):
    """Draw the split with matplotlib (Agg, no pyplot, no graphviz) and return the Figure.

    Nodes sit left to right in program order (input, pieces, output); splitting pieces are
    hatched with a thick border; colours come from ``piece_colour``. Edges between
    neighbours are straight; longer ones arc above (piece to piece) or below (from the
    inputs). With ``path``, the figure is also saved there (PNG unless the suffix says
    otherwise); with ``ax``, it is drawn into that Axes.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
        from matplotlib.path import Path
    except ImportError as e:
        raise ImportError(f"drawing the split needs matplotlib (pip install matplotlib): {e}") from e

    g = split_graph(program)
    order = list(g.nodes)
    xpos = {n: i * _STEP for i, n in enumerate(order)}
    edges = []
    top, bottom = _BOX_H, -_BOX_H
    for u, v, data in g.edges(data=True):
        span = g.nodes[v]["index"] - g.nodes[u]["index"]
        points, mid = _curve(xpos[u], xpos[v], span, above=u != INPUT)
        label = _wrap(data["label"])
        label_lines = label.count("\n") + 1 if label else 0
        if span > 1:
            top = max(top, mid[1] + 0.18 * label_lines) if u != INPUT else top
            bottom = min(bottom, mid[1] - 0.18 * label_lines) if u == INPUT else bottom
        else:
            top = max(top, 0.2 + 0.18 * label_lines)
        edges.append((points, mid, label, u == INPUT and span > 1))

    xmin, xmax = -_BOX_W, xpos[order[-1]] + _BOX_W
    ymin, ymax = bottom - 0.3, top + 0.6
    if ax is None:
        fig = Figure(figsize=(_INCH * (xmax - xmin), _INCH * (ymax - ymin)))
        FigureCanvasAgg(fig)
        ax = fig.add_axes((0, 0, 1, 1))
    fig = ax.figure
    ax.set_xlim(xmin, xmax)
    ax.set_ylim(ymin, ymax)
    ax.axis("off")

    for points, mid, label, below in edges:
        codes = [Path.MOVETO, Path.LINETO] if len(points) == 2 else [Path.MOVETO, Path.CURVE3, Path.CURVE3]
        ax.add_patch(FancyArrowPatch(path=Path(points, codes), arrowstyle="-|>", mutation_scale=10, lw=0.9,
                                     color="#555555", zorder=1))
        if label:
            ax.text(mid[0], mid[1], label, ha="center", va="top" if below else "bottom", fontsize=6.5,
                    family="monospace", zorder=3,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})

    for n in order:
        data = g.nodes[n]
        splitting = data["splitting"]
        box = FancyBboxPatch((xpos[n] - _BOX_W / 2, -_BOX_H / 2), _BOX_W, _BOX_H,
                             boxstyle="round,pad=0.02,rounding_size=0.08", fc=data["colour"],
                             ec="#222222" if splitting else "#777777", lw=2.2 if splitting else 1.0,
                             hatch="///" if splitting else None, zorder=2)
        ax.add_patch(box)
        ax.text(xpos[n], 0, _node_text(data), ha="center", va="center", fontsize=7.5, zorder=4,
                fontweight="bold" if splitting else "normal",
                bbox={"boxstyle": "round,pad=0.1", "fc": data["colour"], "ec": "none"} if splitting else None)
    n_split = sum(1 for n in order if g.nodes[n]["splitting"])
    ax.text((xmin + xmax) / 2, ymax - 0.1, f"{len(program.pieces)} pieces ({n_split} splitting, hatched)",
            ha="center", va="top", fontsize=9)
    if path is not None:
        fig.savefig(path, dpi=dpi, metadata=_png_metadata(path))
    return fig


def _png_metadata(path: Any) -> dict[str, Any] | None:
    # Drop the version stamp and date so that the same split gives the same bytes.
    suffix = str(getattr(path, "name", path)).lower().rsplit(".", 1)[-1]
    return {"png": {"Software": None}, "svg": {"Date": None}}.get(suffix)


def split_png(program: Program, dpi: int = 100) -> bytes:
    """The split picture as PNG bytes (deterministic for a given program)."""
    buf = io.BytesIO()
    fig = draw_split(program)
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


# -- graphviz text -----------------------------------------------------------------------------

def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def split_dot(program: Program) -> str:
    """The split as graphviz DOT text (left to right; splitting pieces bold and hexagonal)."""
    g = split_graph(program)
    lines = ["digraph split {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", fontsize=10];',
             "  edge [fontsize=8];"]
    for n, data in g.nodes(data=True):
        attrs = [f"label={_dot_quote(_node_text(data))}", f"fillcolor={_dot_quote(data['colour'])}"]
        if data["splitting"]:
            attrs += ["shape=hexagon", 'style="filled,bold"', "penwidth=2"]
        lines.append(f"  {_dot_quote(n)} [{', '.join(attrs)}];")
    for u, v, data in g.edges(data=True):
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)} [label={_dot_quote(data['label'])}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
