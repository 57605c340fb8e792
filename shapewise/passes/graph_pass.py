"""The research surface: ``GraphPass`` (a rewrite of a piece's FX graph) and ``InductorPass``
(a post-grad pass inside Inductor), each gated by the sizes of the variant it would change.

    @dataclass(frozen=True)
    class FastGelu(sw.GraphPass):
        name: ClassVar[str] = "fast_gelu"
        limit: int = 16
        def applies(self, sizes):                 # {dim name: int, or (lo, hi) for a range variant}
            return all(isinstance(v, int) and v <= self.limit for v in sizes.values())
        def rewrite(self, gm, sizes):             # the piece's graph, as Split made it
            ...                                   # torch.fx.subgraph_rewriter, or edit gm.graph
            return gm

The ``Rewrite`` stage (``shapewise.rewrite``) runs them per (compute piece, variant); ``version``
is part of every content key, so bump it when a pass changes what it does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch.fx

from shapewise._compat import node_value, sym_expr
from shapewise.ir.symbolic import evaluate

__all__ = ["GraphPass", "InductorPass", "Sizes", "VariantSizes"]

#: A variant's sizes as a pass sees them: ``{dim name: size}`` for a static variant,
#: ``{dim name: (low, high)}`` for the dims a range variant leaves symbolic.
Sizes = Mapping[str, "int | tuple[int, int]"]


class VariantSizes(dict):
    """What ``applies`` and ``rewrite`` get: ``{dim name: size or (low, high)}`` (a plain dict),
    which also knows the graph's symbols, so a pass can ask what a node's shape is at this
    variant: ``sizes.shape(node)`` gives ints where the variant fixes them, None elsewhere."""

    def __init__(self, sizes: Mapping[str, Any], symbols: Mapping[sympy.Symbol, Any] | None = None) -> None:
        super().__init__(sizes)
        self.symbols = dict(symbols or {})

    def evaluate(self, dim: Any) -> int | None:
        """An int, SymInt or sympy expression at this variant: an int, or None when it depends
        on a dim that the variant leaves as a range."""
        expr = sym_expr(dim) if not isinstance(dim, sympy.Basic) else dim
        try:
            return evaluate(expr, {s: v for s, v in self.symbols.items() if isinstance(v, int)})
        except KeyError:  # a symbol the variant leaves as a range
            return None

    def shape(self, node: torch.fx.Node) -> tuple[int | None, ...] | None:
        """The shape of a node's tensor value at this variant (None for a non-tensor node)."""
        value = node_value(node)
        if not isinstance(value, torch.Tensor):
            return None
        return tuple(self.evaluate(d) for d in value.shape)


def _spec(obj: Any, every_field: bool = False) -> str:
    fields = []
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        value = getattr(obj, f.name)
        if f.repr and (every_field or value != f.default):
            fields.append(f"{f.name}={value!r}".replace(" ", ""))
    return f"{obj.name}{{{' '.join(fields)}}}" if fields else obj.name


@dataclass(frozen=True)
class GraphPass:
    """A rewrite of one piece's graph for the variants whose sizes it ``applies`` to.

    ``rewrite(gm, sizes)`` gets a copy of the piece's graph (its own to change) and returns the
    new graph: the same placeholders in the same order, and as many outputs.
    ``inductor_options()``: Inductor config the rewritten graph needs, applied to the variants
    whose graph this pass changed (the user's own options for the compile win over them).
    """

    name: ClassVar[str] = "graph_pass"
    version: ClassVar[int] = 1

    def applies(self, sizes: Sizes) -> bool:
        return True

    def inductor_options(self) -> Mapping[str, Any]:
        return {}

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> torch.fx.GraphModule:
        raise NotImplementedError(f"{type(self).__name__}.rewrite")

    def spec(self) -> str:
        """``name{field=value ...}``: what the report and the printer show."""
        return _spec(self)

    def uuid(self) -> str:
        """What content keys record of this pass: its class, every field and ``version``."""
        return f"{type(self).__module__}.{type(self).__qualname__}:{_spec(self, True)}@{self.version}"


@dataclass(frozen=True)
class InductorPass:
    """A post-grad pass that Inductor runs on the variants whose sizes it ``applies`` to:
    ``__call__(graph)`` changes Inductor's post-grad ``torch.fx.Graph`` in place (Inductor's
    ``post_grad_custom_post_pass``; its pattern matcher works here)."""

    name: ClassVar[str] = "inductor_pass"
    version: ClassVar[int] = 1

    def applies(self, sizes: Sizes) -> bool:
        return True

    def __call__(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError(f"{type(self).__name__}.__call__")

    def spec(self) -> str:
        return _spec(self)

    def uuid(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}:{_spec(self, True)}@{self.version}"
