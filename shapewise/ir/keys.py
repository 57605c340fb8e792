"""Content keys for pieces: what a compile of a piece depends on, never where it sits.

Dynamo lifts parameters to graph inputs, so the pieces of identical layers are the same graph
up to placeholder names and symbol names. ``graph_key`` normalises a piece (nodes numbered in
order, targets by qualified name, args with nodes replaced by positions, placeholder layouts
with symbols renamed by first appearance) and hashes it; ``binding_key`` expresses a variant's
binding over those canonical symbols, so two equal graphs whose symbols are bound differently
get different keys.

>>> gk = graph_key(piece.gm, piece.shapes)         # None: something in the graph cannot be keyed
>>> binding_key(gk, piece.shapes, variant.binding)  # "c0=8" or "c0=17..512@64"
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx

from shapewise._compat import FakeTensor, distributed_fields, op_key
from shapewise.ir.program import Binding, ShapeInfo, TensorMeta
from shapewise.ir.symbolic import range_hint

__all__ = ["GraphKey", "NotKeyable", "binding_key", "graph_key"]


class NotKeyable(Exception):
    """Something in a graph has no stable content description (a lambda, a module call, ...)."""


@dataclass(frozen=True)
class GraphKey:
    """A piece's content key: ``digest`` (sha256 hex of ``text``), the piece's symbols in
    canonical order (``c0, c1, ...``) and the normalised ``text`` itself (for inspection)."""

    digest: str
    symbols: tuple[sympy.Symbol, ...]
    text: str

    @property
    def short(self) -> str:
        return self.digest[:12]


def _qualname(target: Any) -> str:
    if isinstance(target, str):
        return target
    key = op_key(target)
    if key is not None:
        return key
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or type(target).__module__
    if not qual or "<lambda>" in qual or "<locals>" in qual:
        raise NotKeyable(f"target {target!r} has no importable name")
    return f"{module}.{qual}"


def _tensor_digest(t: torch.Tensor) -> str:
    if t.device.type == "meta" or isinstance(t, FakeTensor):
        raise NotKeyable("a graph constant is a fake or meta tensor: its values are unknown")
    c = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return f"tensor({c.dtype},{tuple(c.shape)},{tuple(t.stride())},{h.hexdigest()})"


class _Normaliser:
    """Writes a graph as text in which nothing depends on names or positions in the model."""

    def __init__(self, shapes: ShapeInfo | None) -> None:
        self.symbols: dict[sympy.Symbol, sympy.Symbol] = {}
        self.shapes = shapes
        self.any_rank = False  # describing a subclass input the graph only takes ``to_local`` of

    # -- symbols ---------------------------------------------------------------------------
    def expr(self, e: Any) -> str:
        e = sympy.sympify(e)
        # First appearance; several new symbols in one expression are ordered by name, which
        # can only cost a missed share, never a wrong one (the key still spells every expr).
        for s in sorted(e.free_symbols, key=str):
            self.symbols.setdefault(s, sympy.Symbol(f"c{len(self.symbols)}", integer=True))
        return sympy.srepr(e.xreplace(self.symbols))

    def meta(self, m: Any, inner: bool = False) -> str:
        if isinstance(m, TensorMeta):
            shape = ",".join(self.expr(e) for e in m.shape)
            stride = ",".join(self.expr(e) for e in m.stride)
            offset = self.expr(m.offset)
            if inner and isinstance(m.offset, sympy.Integer) and int(m.offset) * m.dtype.itemsize % 16 == 0:
                # A subclass's inner tensor (a DTensor's local shard) is often a view of the whole
                # loaded weight at a rank's own offset. Compiled code reads an input from its data
                # pointer and depends on the offset only through the pointer's alignment.
                offset = "aligned16"
            sub = m.subclass
            flat = "" if sub is None else (
                f"|{sub.cls.__module__}.{sub.cls.__qualname__}{{{self.value(sub.ctx, {})}|"
                + ";".join(f"{name}={self.meta(x, inner=True)}" for name, x in sub.inner) + "}")
            return (f"tensor[{m.dtype}|{m.device}|({shape})|({stride})|{offset}|"
                    f"grad={bool(m.requires_grad)}{flat}]")
        if isinstance(m, sympy.Basic):
            return f"sym[{self.expr(m)}]"
        return f"const[{self.value(m, {})}]"

    # -- args --------------------------------------------------------------------------------
    def value(self, a: Any, index: Mapping[torch.fx.Node, int]) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if a is None or isinstance(a, (bool, str)):
            return repr(a)
        if isinstance(a, int):
            return f"i{a}"
        if isinstance(a, float):
            return "f" + (repr(a) if math.isfinite(a) else str(a))
        if isinstance(a, complex):
            return f"z{a!r}"
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return f"{type(a).__name__}:{a}"
        if isinstance(a, torch.Size):
            return "size(" + ",".join(self.value(x, index) for x in a) + ")"
        if isinstance(a, tuple):
            return "(" + ",".join(self.value(x, index) for x in a) + ",)"
        if isinstance(a, list):
            return "[" + ",".join(self.value(x, index) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{self.value(k, index)}:{self.value(v, index)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.value(a.start, index)},{self.value(a.stop, index)},{self.value(a.step, index)})"
        if a is Ellipsis:
            return "..."
        if isinstance(a, enum.Enum):
            return f"{type(a).__module__}.{type(a).__qualname__}.{a.name}"
        if isinstance(a, torch.Tensor):
            return _tensor_digest(a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"symval[{self.expr(a.node.expr)}]"
        if op_key(a) is not None:
            return _qualname(a)
        fields = distributed_fields(a, rank=not self.any_rank)
        if fields is not None:
            return "dist" + self.value(fields, index)
        if callable(a):
            return "fn:" + _qualname(a)
        raise NotKeyable(f"argument {a!r} of type {type(a).__qualname__} has no stable description")

    # -- graph -------------------------------------------------------------------------------
    def graph(self, gm: torch.fx.GraphModule, metas: tuple[Any, ...] | None) -> list[str]:
        lines: list[str] = []
        index: dict[torch.fx.Node, int] = {}
        ph = 0
        for node in gm.graph.nodes:
            index[node] = len(index)
            i = index[node]
            if node.op == "placeholder":
                meta = metas[ph] if metas is not None and ph < len(metas) else None
                # A DTensor weight whose only use is its local shard compiles the same on every rank
                # (in inference: a training graph's backward builds the weight's gradient as a
                # DTensor of the compiling rank's mesh).
                self.any_rank = not torch.is_grad_enabled() and bool(node.users) and all(
                    u.op == "call_method" and u.target == "to_local" for u in node.users)
                lines.append(f"%{i} = input {self.meta(meta) if meta is not None else 'unknown'}")
                self.any_rank = False
                ph += 1
            elif node.op == "get_attr":
                lines.append(f"%{i} = attr {self.attribute(gm, node.target)}")
            elif node.op == "call_module":
                sub = gm.get_submodule(node.target)
                if not isinstance(sub, torch.fx.GraphModule):
                    raise NotKeyable(f"the graph calls module {node.target!r} ({type(sub).__name__}), "
                                     "whose code is not in the graph")
                lines.append(f"%{i} = module{{{';'.join(self.graph(sub, None))}}}"
                             f"({self.value(node.args, index)}, {self.value(node.kwargs, index)})")
            elif node.op == "output":
                lines.append(f"return {self.value(node.args, index)}")
            else:
                lines.append(f"%{i} = {node.op} {_qualname(node.target)}"
                             f"({self.value(node.args, index)}, {self.value(node.kwargs, index)})")
        return lines

    def attribute(self, gm: torch.fx.GraphModule, target: str) -> str:
        obj: Any = gm
        for part in target.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.fx.GraphModule):
            return "graph{" + ";".join(self.graph(obj, None)) + "}"
        if isinstance(obj, torch.Tensor):
            return _tensor_digest(obj)
        return self.value(obj, {})


def graph_key(gm: torch.fx.GraphModule, shapes: ShapeInfo | None) -> GraphKey | None:
    """The content key of a piece (graph + placeholder layouts), or None when some part of
    it cannot be described by content (then the piece is neither shared nor cached)."""
    norm = _Normaliser(shapes)
    try:
        lines = norm.graph(gm, shapes.inputs if shapes is not None else None)
    except NotKeyable:
        return None
    text = "\n".join(lines)
    return GraphKey(hashlib.sha256(text.encode()).hexdigest(), tuple(norm.symbols), text)


def binding_key(key: GraphKey, shapes: ShapeInfo | None, binding: Binding,
                hint: Callable[[int, int, int | None], int] = range_hint) -> str:
    """``binding`` over ``key``'s canonical symbols: ``"c0=8,c1=17..512@64"`` (a range carries
    the value it is traced at). Symbols of the binding that the piece does not use are left
    out, so one artifact serves every binding that agrees on the piece's own symbols."""
    values = binding.mapping
    hints = shapes.hints if shapes is not None else {}
    parts = []
    for i, s in enumerate(key.symbols):
        v = values.get(s)
        if v is None:
            parts.append(f"c{i}=?")
        elif isinstance(v, int):
            parts.append(f"c{i}={v}")
        else:
            parts.append(f"c{i}={v[0]}..{v[1]}@{hint(v[0], v[1], hints.get(s))}")
    return ",".join(parts)
