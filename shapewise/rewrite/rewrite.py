"""Rewrite: run ``GraphPass``es on each (compute piece, variant) whose sizes they apply to, and
attach ``InductorPass``es to the variants Inductor should run them on.

Between Concretize and Lower. A variant that some pass changes gets its own copy of the piece's
graph (``Variant.gm``) and the passes' ``uuid()``s (``Variant.passes``); variants no pass
applies to, or whose graph a pass left as it was, keep sharing the piece's graph, so they
dedupe as before. A pass whose result is not a
valid graph for the piece (lint fails, placeholders or the number of outputs changed) raises a
``ShapewiseError`` that names the pass, the piece and the sizes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import sympy
import torch.fx

from shapewise.errors import ConfigError, ShapewiseError
from shapewise.ir.program import Binding, Piece, Program, Variant
from shapewise.passes.base import Pass, register_pass
from shapewise.passes.graph_pass import GraphPass, InductorPass, VariantSizes

__all__ = ["Rewrite", "variant_sizes"]


def variant_sizes(binding: Binding, names: Mapping[sympy.Symbol, str],
                  fixed: Mapping[str, int] | None = None) -> VariantSizes:
    """A binding as a pass sees it: ``{dim name: size}``, ``(low, high)`` for a range (a symbol
    without a name goes by the symbol: ``{"s3": 4}``), with the dims the trace fixed (``seq=1``
    in a decode trace) at their size."""
    return VariantSizes({**dict(fixed or {}), **{names.get(s, str(s)): v for s, v in binding.items}},
                        dict(binding.items))


def _outputs(gm: torch.fx.GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(out.args[0]) if isinstance(out.args[0], (list, tuple)) else 1


def _placeholders(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]


@register_pass
@dataclass(frozen=True)
class Rewrite(Pass):
    """``Rewrite(passes=[MyRewrite()], inductor_passes=[MyPostGrad()])``: see the module docstring."""

    name: ClassVar[str] = "rewrite"
    passes: tuple[GraphPass, ...] = ()
    inductor_passes: tuple[InductorPass, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "passes", tuple(self.passes))
        object.__setattr__(self, "inductor_passes", tuple(self.inductor_passes))
        for p in self.passes:
            if not isinstance(p, GraphPass):
                hint = " (an InductorPass goes in inductor_passes)" if isinstance(p, InductorPass) else ""
                raise ConfigError(f"Rewrite(passes=...) takes sw.GraphPass objects, got {p!r}{hint}")
        for p in self.inductor_passes:
            if not isinstance(p, InductorPass):
                raise ConfigError(f"Rewrite(inductor_passes=...) takes sw.InductorPass objects, got {p!r}")

    def spec(self) -> str:
        parts = []
        if self.passes:
            parts.append("passes=" + ",".join(p.spec() for p in self.passes))
        if self.inductor_passes:
            parts.append("inductor_passes=" + ",".join(p.spec() for p in self.inductor_passes))
        return f"rewrite{{{' '.join(parts)}}}" if parts else "rewrite"

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return [] if program.bindings is not None else ["concretize"]

    def apply(self, program: Program) -> Program:
        compiled = [p.name for p in program.compute_pieces if any(v.compiled is not None for v in p.variants)]
        if compiled:
            raise ConfigError(f"Rewrite runs before Lower: {compiled[0]}'s variants are compiled already, and a "
                              "rewrite now would not reach them; put Rewrite between Concretize and Lower")
        pieces = tuple(p if p.is_splitting else dataclasses.replace(
            p, variants=tuple(self._variant(p, v, program.fixed_sizes) for v in p.variants)) for p in program.pieces)
        return program.replace(pieces=pieces, rewrites=(*program.rewrites, self))

    def _variant(self, piece: Piece, variant: Variant, fixed: Mapping[str, int] | None = None) -> Variant:
        sizes = variant_sizes(variant.binding, piece.shapes.names if piece.shapes else {}, fixed)
        graph_passes = [p for p in self.passes if self._applies(p, piece, sizes)]
        inductor = tuple(p for p in self.inductor_passes if self._applies(p, piece, sizes))
        if not graph_passes and not inductor:
            return variant
        gm = variant.gm if variant.gm is not None else piece.gm
        applied = list(variant.passes)
        options = dict(variant.inductor_options)
        for p in graph_passes:
            out = self._run(p, piece, gm, sizes)
            if out.code != gm.code:  # a pass that found nothing to change leaves the graph shared
                gm = out
                applied.append(p.uuid())
                options.update(p.inductor_options())
        changed = len(applied) > len(variant.passes)
        if not changed and not inductor:
            return variant
        return dataclasses.replace(variant, gm=gm if changed else variant.gm, passes=tuple(applied),
                                   inductor_passes=(*variant.inductor_passes, *inductor),
                                   inductor_options=tuple(sorted(options.items())))

    @staticmethod
    def _applies(p: GraphPass | InductorPass, piece: Piece, sizes: dict[str, Any]) -> bool:
        try:
            return bool(p.applies(sizes))
        except Exception as e:
            raise ShapewiseError(f"graph pass {p.spec()}.applies({sizes}) raised for {piece.name}: "
                                 f"{type(e).__name__}: {e}") from e

    @staticmethod
    def _run(p: GraphPass, piece: Piece, gm: torch.fx.GraphModule, sizes: dict[str, Any]) -> torch.fx.GraphModule:
        where = f"graph pass {p.spec()} on {piece.name} at sizes {sizes}"
        mine = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
        try:
            out = p.rewrite(mine, sizes)
        except Exception as e:
            raise ShapewiseError(f"{where} raised {type(e).__name__}: {e}") from e
        if not isinstance(out, torch.fx.GraphModule):
            raise ShapewiseError(f"{where} returned {type(out).__name__}; return the rewritten torch.fx.GraphModule")
        try:
            out.graph.lint()
            out.recompile()
        except Exception as e:
            raise ShapewiseError(f"{where} made a broken graph: {type(e).__name__}: {e}") from e
        if _placeholders(out) != _placeholders(gm):
            raise ShapewiseError(f"{where} changed the graph's inputs ({_placeholders(gm)} -> {_placeholders(out)}); "
                                 "a rewrite keeps the piece's placeholders, in order")
        if _outputs(out) != _outputs(gm):
            raise ShapewiseError(f"{where} changed the number of outputs ({_outputs(gm)} -> {_outputs(out)})")
        return out
