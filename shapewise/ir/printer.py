"""The one canonical printer: graphs, shape info and programs as stable, readable text.
Tests, dumps and notebooks all print through here."""

from __future__ import annotations

import re

import torch
import torch.fx

from shapewise.ir.program import RENDERERS, Piece, Program, ShapeInfo, TensorMeta, Variant
from shapewise.ir.symbolic import range_text

__all__ = ["format_graph", "format_program", "format_shapes"]


def format_graph(gm: torch.fx.GraphModule) -> str:
    """The graph's Python code without blank lines and trailing spaces; ``self`` calls kept."""
    code = gm.code
    lines = [ln.rstrip() for ln in code.splitlines() if ln.strip()]
    # Drop "x = None" bookkeeping: it is codegen detail, not meaning.
    lines = [re.sub(r";\s+(\w+ = )+None$", "", ln) for ln in lines]
    return "\n".join(lines)


def _fmt_input(meta) -> str:
    if isinstance(meta, TensorMeta):
        shape = ", ".join(str(e) for e in meta.shape)
        stride = ", ".join(str(e) for e in meta.stride)
        dtype = str(meta.dtype).replace("torch.", "")
        off = f" offset={meta.offset}" if meta.offset != 0 else ""
        sub = f" {meta.subclass.cls.__name__}" if meta.subclass is not None else ""
        return f"{dtype}[{shape}] stride=({stride}){off}{sub}"
    # An opaque object Dynamo lifted (a DeviceMesh) shows as itself, not as its fake wrapper.
    return f"sym {meta}" if hasattr(meta, "free_symbols") else repr(getattr(meta, "real_obj", meta))


def format_shapes(shapes: ShapeInfo) -> str:
    lines = []
    if shapes.symbols:
        for s in shapes.symbols:
            src = shapes.sources.get(s)
            name = f" ({shapes.names[s]})" if s in shapes.names else ""
            lo, hi = shapes.ranges.get(s, (None, None))
            lines.append(
                f"symbol {s}{name}: read from {src if src else 'derived'}; traced {shapes.hints.get(s)}; "
                f"range {range_text(lo, hi)}"
            )
    for name, meta in zip(shapes.input_names, shapes.inputs):
        lines.append(f"input {name}: {_fmt_input(meta)}")
    for g, _ in shapes.guards:
        lines.append(f"guard {g}")
    return "\n".join(lines)


def _layout_note(piece: Piece, variant: Variant) -> str:
    """Inputs of a static variant laid out otherwise than the trace says at its size (eager's
    layout at that size, see ``concretize.observed_inputs``)."""
    if piece.shapes is None or not variant.binding.is_static:
        return ""

    values = variant.binding.static_values()
    notes = []
    for name, meta, arg in zip(piece.shapes.input_names, piece.shapes.inputs, variant.example_args):
        if not (isinstance(meta, TensorMeta) and isinstance(arg, torch.Tensor)):
            continue
        try:
            _, stride, offset = meta.at(values)
            traced = (stride, offset)
        except KeyError:
            continue
        if traced != (tuple(arg.stride()), arg.storage_offset()):
            notes.append(f"{name} stride={tuple(arg.stride())} offset={arg.storage_offset()} "
                         f"(traced {traced[0]} offset={traced[1]})")
    return "; eager's layout at this size: " + ", ".join(notes) if notes else ""


def _passes_note(v: Variant) -> str:
    """``; rewritten by a{...}, b; inductor passes: c``: the passes applied to this variant."""
    labels = v.pass_labels
    graph, inductor = labels[:len(v.passes)], labels[len(v.passes):]
    note = f"; rewritten by {', '.join(graph)} (its graph below)" if graph else ""
    if inductor:
        note += f"; inductor passes: {', '.join(inductor)}"
    return note


def format_program(program: Program) -> str:
    """Pieces, shapes, bindings and the dispatch table of a program, as text."""
    out = []
    if program.shapes is not None:
        out.append("# shapes\n" + format_shapes(program.shapes))
    if program.bindings is not None:
        names = program.shapes.names if program.shapes else {}
        out.append("# bindings\n" + "\n".join(b.describe(names) for b in program.bindings))
    if program.graph is not None:
        out.append("# stitching graph\n" + format_graph(program.graph))
        for p in program.pieces:
            tag = " [splitting op, runs as is]" if p.is_splitting else ""
            out.append(f"# {p.name}{tag}\n" + format_graph(p.gm))
            for v in p.variants:
                out.append(f"#   variant {v.binding.describe(p.shapes.names if p.shapes else {})}: "
                           + ("compiled" if v.compiled is not None else "not compiled") + _layout_note(p, v)
                           + _passes_note(v))
                if v.gm is not None:
                    out.append("\n".join("#     " + ln for ln in format_graph(v.gm).splitlines()))
    else:
        out.append("# graph\n" + format_graph(program.gm))
    if program.dispatch is not None:
        rows = program.dispatch.rows()
        lines = [f"{r['kind']:5} {r['key']}" + (f"  ({r['runs']})" if r.get("runs") else "") for r in rows]
        out.append("# dispatch\n" + "\n".join(lines))
    return "\n".join(out)


RENDERERS[("Program", "text")] = format_program
RENDERERS[("ShapeInfo", "text")] = format_shapes
