"""Padding for CUDA graphs (``CudaGraphs(pad=True)``): every size up to the largest captured one
runs as the next captured size, inputs padded with zeros along the dynamic dim and outputs sliced
back. Only for models whose rows are independent (each output row depends only on its input row
and earlier ones, as causal attention)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from shapewise._compat import node_value
from shapewise.errors import ConfigError
from shapewise.ir.program import Program, TensorMeta

__all__ = ["pad_runner", "padded_entries"]


def _varying_dims(metas: Sequence[Any], symbol: sympy.Symbol, what: str) -> list[tuple[int, ...] | None]:
    """Per input/output: the dims whose size is exactly ``symbol``; refuses other uses of it."""
    out: list[tuple[int, ...] | None] = []
    for i, meta in enumerate(metas):
        if isinstance(meta, TensorMeta):
            dims = tuple(d for d, e in enumerate(meta.shape) if e == symbol)
            others = [e for e in meta.shape if e != symbol and symbol in getattr(e, "free_symbols", ())]
            if others:
                raise ConfigError(f"pad=True: {what} {i} has a size {others[0]} derived from the dynamic size; "
                                  "padding only works when every varying dim is the size itself")
            out.append(dims)
        else:
            out.append(None)
    return out


def pad_runner(run: Callable[..., Any], n: int, m: int, in_dims: Sequence[tuple[int, ...] | None],
               int_args: Sequence[int], out_dims: Sequence[tuple[int, ...] | None]) -> Callable[..., Any]:
    """Run size ``n`` through the runner of size ``m >= n``: pad inputs with zeros, slice outputs."""

    def padded(*args: Any) -> Any:
        args = list(args)
        for i in int_args:
            args[i] = m
        for i, dims in enumerate(in_dims):
            if dims:
                t = args[i]
                big = t.new_zeros([m if d in dims else s for d, s in enumerate(t.shape)])
                view = big
                for d in dims:
                    view = view.narrow(d, 0, n)
                view.copy_(t)
                args[i] = big
        outs = run(*args)
        flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        for j, dims in enumerate(out_dims):
            if dims and isinstance(flat[j], torch.Tensor):
                for d in dims:
                    flat[j] = flat[j].narrow(d, 0, n)
        return type(outs)(flat) if isinstance(outs, (tuple, list)) else flat[0]

    return padded


def padded_entries(program: Program, captured: Mapping[tuple, Callable[..., Any]]) -> dict[tuple, Callable[..., Any]]:
    """Exact dispatch entries for every size up to the largest captured one, padded up."""
    shapes = program.shapes
    if len(shapes.symbols) != 1:
        raise ConfigError("pad=True needs exactly one dynamic size")
    (sym,) = shapes.symbols
    in_dims = _varying_dims(shapes.inputs, sym, "input")
    int_args = [i for i, meta in enumerate(shapes.inputs) if isinstance(meta, sympy.Basic) and meta == sym]
    out_node = next(n for n in program.graph.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    out_metas = []
    for o in outs:
        v = node_value(o) if isinstance(o, torch.fx.Node) else None
        out_metas.append(TensorMeta(tuple(sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d)
                                          for d in v.shape), (), 0, v.dtype, v.device)
                         if isinstance(v, torch.Tensor) else None)
    out_dims = _varying_dims(out_metas, sym, "output")
    sizes = sorted(k[0] for k in captured)
    entries: dict[tuple, Callable[..., Any]] = {}
    for n in range(1, sizes[-1] + 1):
        if (n,) in captured:
            continue
        m = sizes[bisect.bisect_left(sizes, n)]
        entries[(n,)] = pad_runner(captured[(m,)], n, m, in_dims, int_args, out_dims)
    return entries
