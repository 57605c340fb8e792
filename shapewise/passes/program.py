"""The data that flows through the pipeline: Program, Piece, ShapeInfo, Binding, Variant."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch.fx

__all__ = ["Binding", "Piece", "Program", "ShapeInfo", "SymbolSource", "Variant"]


@dataclass(frozen=True)
class SymbolSource:
    """Where a symbol's run-time value is read from the call's arguments.

    ``kind`` is ``"int"`` (``args[index]`` is the value), ``"size"`` (``args[index].shape[dim]``)
    or ``"stride"`` (``args[index].stride(dim)``).
    """

    kind: str
    index: int
    dim: int = -1

    def expr(self, argname: str = "args") -> str:
        if self.kind == "int":
            return f"{argname}[{self.index}]"
        if self.kind == "size":
            return f"{argname}[{self.index}].shape[{self.dim}]"
        return f"{argname}[{self.index}].stride({self.dim})"

    def __str__(self) -> str:
        return self.expr()


@dataclass(frozen=True)
class TensorMeta:
    """A placeholder's layout as sympy expressions, plus dtype/device."""

    shape: tuple[sympy.Expr, ...]
    stride: tuple[sympy.Expr, ...]
    offset: sympy.Expr
    dtype: Any
    device: Any
    requires_grad: bool = False


@dataclass(frozen=True)
class ShapeInfo:
    """The symbolic facts of one graph (a piece or the whole program).

    - ``symbols``: free symbols, in the order they first appear in the inputs;
    - ``sources``: for each symbol, where its run-time value is read;
    - ``inputs``: per placeholder, a ``TensorMeta``, a sympy expr (SymInt input) or a constant;
    - ``guards``: (sympy boolean, where it came from) that every valid binding satisfies;
    - ``ranges``: per symbol, the (lower, upper) bounds the trace proved (None = open);
    - ``hints``: per symbol, its traced value.
    """

    symbols: tuple[sympy.Symbol, ...]
    sources: Mapping[sympy.Symbol, SymbolSource]
    inputs: tuple[Any, ...]
    input_names: tuple[str, ...]
    guards: tuple[tuple[sympy.Basic, str], ...] = ()
    ranges: Mapping[sympy.Symbol, tuple[int | None, int | None]] = field(default_factory=dict)
    hints: Mapping[sympy.Symbol, int] = field(default_factory=dict)
    names: Mapping[sympy.Symbol, str] = field(default_factory=dict)

    def name_of(self, s: sympy.Symbol) -> str:
        return self.names.get(s, str(s))

    def __str__(self) -> str:
        from shapewise.passes.printer import format_shapes

        return format_shapes(self)

    def _repr_html_(self) -> str:
        from shapewise.passes.display import shapes_html

        return shapes_html(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


@dataclass(frozen=True)
class Binding:
    """Values for every dispatch symbol: an int (one size) or an inclusive (lo, hi) range.

    >>> Binding.of({s0: 8})            # static
    >>> Binding.of({s0: (17, 512)})    # a range: compiled with symbolic sizes
    """

    items: tuple[tuple[sympy.Symbol, int | tuple[int, int]], ...]

    @staticmethod
    def of(mapping: Mapping[sympy.Symbol, int | tuple[int, int]]) -> Binding:
        return Binding(tuple(mapping.items()))

    @property
    def mapping(self) -> dict[sympy.Symbol, int | tuple[int, int]]:
        return dict(self.items)

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, int) for _, v in self.items)

    @property
    def key(self) -> tuple:
        return tuple(v for _, v in self.items)

    def static_values(self) -> dict[sympy.Symbol, int]:
        return {s: v for s, v in self.items if isinstance(v, int)}

    def bounds(self) -> tuple[tuple[int, int], ...]:
        return tuple((v, v) if isinstance(v, int) else v for _, v in self.items)

    def describe(self, names: Mapping[sympy.Symbol, str] | None = None) -> str:
        """``{n=8}``; dims that share a name and a value print once (``{batch=2, seq=8}`` for
        input_ids' and attention_mask's batch); a name whose symbols differ is told apart by the
        symbol: ``{n[s1]=4, n[s2]=6}``."""
        names = names or {}
        shown = [names.get(s, str(s)) for s, _ in self.items]
        values: dict[str, set[Any]] = {}
        for (_, v), name in zip(self.items, shown):
            values.setdefault(name, set()).add(v)
        parts, done = [], set()
        for (s, v), name in zip(self.items, shown):
            val = str(v) if isinstance(v, int) else f"{v[0]}..{v[1] if v[1] < 2**63 - 1 else 'inf'}"
            if len(values[name]) == 1:
                if name not in done:
                    parts.append(f"{name}={val}")
                done.add(name)
            else:
                parts.append(f"{name}[{s}]={val}")
        return "{" + ", ".join(parts) + "}"

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class Variant:
    """One compiled version of a piece for one binding."""

    binding: Binding
    example_args: tuple[Any, ...] = ()
    compiled: Callable[..., Any] | None = None
    report: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Piece:
    """A subgraph of the split program. Splitting pieces run as they are (never compiled)."""

    name: str
    gm: torch.fx.GraphModule
    is_splitting: bool = False
    shapes: ShapeInfo | None = None
    variants: tuple[Variant, ...] = ()

    def variant_for(self, binding: Binding) -> Variant | None:
        for v in self.variants:
            if v.binding == binding:
                return v
        return None


@dataclass(frozen=True)
class Program:
    """What each pass takes and returns. Passes never mutate a Program; they make a new one.

    ``gm``: the whole traced graph; ``graph``: the stitching graph (calls ``piece_i``
    submodules in order); ``pieces``; ``shapes``: the whole graph's ``ShapeInfo``;
    ``bindings``: the variants to build; ``dispatch``: the table, once built.
    """

    gm: torch.fx.GraphModule
    graph: torch.fx.GraphModule | None = None
    pieces: tuple[Piece, ...] = ()
    shapes: ShapeInfo | None = None
    bindings: tuple[Binding, ...] | None = None
    dispatch: Any = None
    lowering: Any = None
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> Program:
        return dataclasses.replace(self, **changes)

    def with_attrs(self, **attrs: Any) -> Program:
        return self.replace(attrs={**self.attrs, **attrs})

    @property
    def is_split(self) -> bool:
        return self.graph is not None

    @property
    def compute_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if not p.is_splitting)

    def __str__(self) -> str:
        from shapewise.passes.printer import format_program

        return format_program(self)

    def _repr_html_(self) -> str:
        from shapewise.passes.display import program_html

        return program_html(self)

    def _repr_png_(self) -> bytes | None:
        from shapewise.passes.display import program_png

        return program_png(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))
