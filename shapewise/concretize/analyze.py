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

from shapewise._compat import (
    is_traceable_wrapper_subclass,
    node_value,
    shape_env_of,
    subclass_inner,
    sym_expr,
    symbol_hints,
    trace_guards,
    value_range,
)
from shapewise.errors import ConfigError, ShapewiseError
from shapewise.ir.program import Program, ShapeInfo, SubclassMeta, SymbolSource, TensorMeta
from shapewise.ir.symbolic import evaluate
from shapewise.passes.base import Pass, register_pass

__all__ = ["AnalyzeShapes", "analyze_graph", "evaluate", "resolve_symbol_names", "tensor_meta"]


def _ordered_symbols(exprs) -> list[sympy.Symbol]:
    seen: dict[sympy.Symbol, None] = {}
    for e in exprs:
        if isinstance(e, sympy.Basic):
            for s in sorted(e.free_symbols, key=str):
                seen.setdefault(s, None)
    return list(seen)


def resolve_symbol_names(names: Mapping[Any, str] | None, symbols: tuple[sympy.Symbol, ...],
                         strict: bool = True) -> dict[sympy.Symbol, str]:
    """``{symbol or its name: dim name}`` as ``{symbol: dim name}`` over ``symbols``:
    ``{"s77": "n"}`` -> ``{s77: "n"}``. A name that is no symbol of ``symbols`` raises a
    ``ConfigError`` listing them, or is left out when not ``strict`` (a Dynamo trace that fixed
    that dim). A Symbol key is the graph's symbol of that name (a plain ``sympy.Symbol("s77")``
    included), or kept as it is."""
    by_name = {str(s): s for s in symbols}
    out: dict[sympy.Symbol, str] = {}
    for key, name in (names or {}).items():
        if not isinstance(key, str):
            # sympy.Symbol("s77") is not torch's s77 (which carries integer assumptions): same name, same symbol
            out[key if key in symbols else by_name.get(str(key), key)] = name
        elif key in by_name:
            out[by_name[key]] = name
        elif strict:
            known = ", ".join(map(str, symbols)) or "none: every size is static"
            raise ConfigError(f"symbol_names names {key!r} (as {name!r}), which is not a symbol of the graph; "
                              f"its symbols: {known}")
    return out


def tensor_meta(v: torch.Tensor) -> TensorMeta:
    """``v``'s layout as expressions; a traceable subclass (``DTensor``) with its inner tensors'."""
    shape = tuple(sym_expr(d) for d in v.shape)
    stride = tuple(sym_expr(d) for d in v.stride())
    sub = None
    if is_traceable_wrapper_subclass(v):
        sub = SubclassMeta(type(v), v.__tensor_flatten__()[1], tuple(
            (a, tensor_meta(x) if isinstance(x, torch.Tensor) else x) for a, x in subclass_inner(v)))
        offset = sympy.Integer(0)  # the outer tensor owns no storage
    else:
        offset = sym_expr(v.storage_offset())
    return TensorMeta(shape, stride, offset, v.dtype, v.device, bool(v.requires_grad), sub)


def analyze_graph(gm: torch.fx.GraphModule, names: Mapping[Any, str] | None = None) -> ShapeInfo:
    """The ``ShapeInfo`` of a graph, read from its placeholders' fake values. ``names``:
    ``{symbol or its name: dim name}`` (a name that is no symbol of the graph raises ConfigError)."""
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
            meta = tensor_meta(v)
            inputs.append(meta)
            shape, stride = meta.shape, meta.stride
            exprs.extend(shape)
            exprs.extend(stride)
            exprs.append(meta.offset)
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
        names=resolve_symbol_names(names, symbols),
    )


@register_pass
@dataclass(frozen=True)
class AnalyzeShapes(Pass):
    """Fill ``Program.shapes`` (whole graph) and each piece's ``shapes``. Reads only."""

    name: ClassVar[str] = "analyze_shapes"

    def apply(self, program: Program) -> Program:
        top = analyze_graph(program.gm, program.symbol_names)
        names = top.names  # keyed by symbol: a piece has only some of the graph's symbols
        missing = [s for s in top.symbols if s not in top.sources]
        if missing:
            raise ShapewiseError(
                f"cannot read the run-time value of symbol(s) {missing} from the graph's inputs: "
                "each symbol must be an input SymInt or a tensor input's size or stride"
            )
        pieces = tuple(dataclasses.replace(p, shapes=analyze_graph(p.gm, names)) for p in program.pieces)
        return program.replace(shapes=top, pieces=pieces)
