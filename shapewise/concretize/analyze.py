"""AnalyzeShapes: which inputs carry which symbols, each placeholder's layout as sympy
expressions, and the trace's guards."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch
import torch.fx

from shapewise._compat import node_value, shape_env_of, sym_expr, symbol_hints, trace_guards, value_range
from shapewise.errors import ShapewiseError
from shapewise.ir.program import Program, ShapeInfo, SymbolSource, TensorMeta
from shapewise.ir.symbolic import evaluate
from shapewise.passes.base import Pass, register_pass

__all__ = ["AnalyzeShapes", "analyze_graph", "evaluate"]


def _ordered_symbols(exprs) -> list[sympy.Symbol]:
    seen: dict[sympy.Symbol, None] = {}
    for e in exprs:
        if isinstance(e, sympy.Basic):
            for s in sorted(e.free_symbols, key=str):
                seen.setdefault(s, None)
    return list(seen)


def analyze_graph(gm: torch.fx.GraphModule, names: Mapping[sympy.Symbol, str] | None = None) -> ShapeInfo:
    """The ``ShapeInfo`` of a graph, read from its placeholders' fake values."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [node_value(n) for n in placeholders]
    inputs: list[Any] = []
    exprs: list[sympy.Expr] = []
    sources: dict[sympy.Symbol, SymbolSource] = {}
    stride_sources: dict[sympy.Symbol, SymbolSource] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.SymInt):
            e = sym_expr(v)
            inputs.append(e)
            exprs.append(e)
            if isinstance(e, sympy.Symbol):
                sources.setdefault(e, SymbolSource("int", i))
        elif isinstance(v, torch.Tensor):
            shape = tuple(sym_expr(d) for d in v.shape)
            stride = tuple(sym_expr(d) for d in v.stride())
            offset = sym_expr(v.storage_offset())
            inputs.append(TensorMeta(shape, stride, offset, v.dtype, v.device, bool(v.requires_grad)))
            exprs.extend(shape)
            exprs.extend(stride)
            exprs.append(offset)
            for d, e in enumerate(shape):
                if isinstance(e, sympy.Symbol):
                    sources.setdefault(e, SymbolSource("size", i, d))
            for d, e in enumerate(stride):
                if isinstance(e, sympy.Symbol):
                    stride_sources.setdefault(e, SymbolSource("stride", i, d))
        else:
            inputs.append(v)
    for s, src in stride_sources.items():
        sources.setdefault(s, src)
    symbols = tuple(_ordered_symbols(exprs))
    env = shape_env_of(values)
    hints = symbol_hints(env)
    symset = set(symbols)
    guards = tuple((g, where) for g, where in trace_guards(env) if g.free_symbols and g.free_symbols <= symset)
    return ShapeInfo(
        symbols=symbols,
        sources={s: sources[s] for s in symbols if s in sources},
        inputs=tuple(inputs),
        input_names=tuple(n.name for n in placeholders),
        guards=guards,
        ranges={s: value_range(env, s) for s in symbols},
        hints={s: hints[s] for s in symbols if s in hints},
        names=dict(names or {}),
    )


@register_pass
@dataclass(frozen=True)
class AnalyzeShapes(Pass):
    """Fill ``Program.shapes`` (whole graph) and each piece's ``shapes``. Reads only."""

    name: ClassVar[str] = "analyze_shapes"

    def apply(self, program: Program) -> Program:
        names = program.symbol_names
        top = analyze_graph(program.gm, names)
        missing = [s for s in top.symbols if s not in top.sources]
        if missing:
            raise ShapewiseError(
                f"cannot read the run-time value of symbol(s) {missing} from the graph's inputs: "
                "each symbol must be an input SymInt or a tensor input's size or stride"
            )
        pieces = tuple(dataclasses.replace(p, shapes=analyze_graph(p.gm, names)) for p in program.pieces)
        return program.replace(shapes=top, pieces=pieces)
