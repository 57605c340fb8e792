"""The research surface: ``GraphPass`` (a rewrite of a piece's FX graph) and ``InductorPass``
(a post-grad pass inside Inductor), each gated by the sizes of the variant it would change.

Both are ``Pass``es one level down (as TVM's function passes are passes): a spec, a registry
entry (``register_pass``) and a ``uuid``; given a ``Program`` (in a ``Pipeline``, or called on
one) a graph pass takes the concretized program and returns one whose variants it applies to
carry its rewrite (``Variant.gm`` and ``Variant.passes``) and an Inductor pass returns one whose
variants carry it in ``Variant.inductor_passes``. At its own level, ``GraphPass.rewrite(gm,
sizes)`` takes a copy of a piece's graph and returns a torch.fx ``PassResult(gm, modified)``;
``InductorPass.rewrite(graph)`` changes Inductor's post-grad graph in place.

    @dataclass(frozen=True)
    class FastGelu(sw.GraphPass):
        name: ClassVar[str] = "fast_gelu"
        limit: int = 16
        def applies(self, sizes):                 # {dim name: int, or (lo, hi) for a range variant}
            return all(isinstance(v, int) and v <= self.limit for v in sizes.values())
        def rewrite(self, gm, sizes):             # a copy of the piece's graph, as Split made it
            ...                                   # torch.fx.subgraph_rewriter, or edit gm.graph
            return sw.PassResult(gm, modified=True)

``sw.Pipeline([sw.Split(), sw.Concretize(sizes=[1, 8]), FastGelu(), sw.Lower()])`` runs it as a stage;
``sw.Rewrite(passes=[...])`` (``shapewise.rewrite``) groups several. The ``uuid`` (class, every
field, ``version`` and a hash of the class's source) is part of every content key.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch.fx

from shapewise._compat import PassResult, node_value, sym_expr
from shapewise.errors import ConfigError, ShapewiseError
from shapewise.ir.program import Binding, Piece, Program, Variant
from shapewise.ir.symbolic import evaluate
from shapewise.passes.base import Pass

__all__ = ["GraphPass", "InductorPass", "PassResult", "Sizes", "VariantSizes", "rewrite_program", "variant_sizes"]

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


def variant_sizes(binding: Binding, names: Mapping[sympy.Symbol, str],
                  fixed: Mapping[str, int] | None = None) -> VariantSizes:
    """A binding as a pass sees it: ``{dim name: size}``, ``(low, high)`` for a range (a symbol
    without a name goes by the symbol: ``{"s3": 4}``), with the dims the trace fixed (``seq=1``
    in a decode trace) at their size."""
    return VariantSizes({**dict(fixed or {}), **{names.get(s, str(s)): v for s, v in binding.items}},
                        dict(binding.items))


@dataclass(frozen=True)
class _VariantLevel(Pass):
    """What graph and Inductor passes share as program passes: they need the bindings, and they
    run before Lower."""

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return [] if program.bindings is not None else ["concretize"]

    def apply(self, program: Program) -> Program:
        graph = (self,) if isinstance(self, GraphPass) else ()
        return rewrite_program(program, graph, () if graph else (self,), by=self)


@dataclass(frozen=True)
class GraphPass(_VariantLevel):
    """A rewrite of one piece's graph for the variants whose sizes it ``applies`` to.

    ``rewrite(gm, sizes)`` gets a copy of the piece's graph (its own to change) and returns
    ``PassResult(gm, modified)`` (torch.fx's): the new graph, with the same placeholders in the
    same order and as many outputs, and whether it differs (``modified=False``: the variant keeps
    sharing the piece's graph). A bare ``GraphModule`` counts as modified where its code differs.
    ``inductor_options()``: Inductor config the rewritten graph needs, applied to the variants
    whose graph this pass changed (the user's own options for the compile win over them).
    ``rewrite_key(sizes)``: what of the sizes the rewrite depends on. None (the default): all of
    them, so each variant is rewritten on its own. Any other (hashable) value: the variants of one
    piece whose keys are equal are rewritten once and share the graph (a rewrite that never reads
    ``sizes`` returns a constant: five prompt sizes then cost one rewrite, not five).
    """

    name: ClassVar[str] = "graph_pass"

    def applies(self, sizes: Sizes) -> bool:
        return True

    def inductor_options(self) -> Mapping[str, Any]:
        return {}

    def rewrite_key(self, sizes: Sizes) -> Hashable | None:
        return None

    def rewrite(self, gm: torch.fx.GraphModule, sizes: Sizes) -> PassResult | torch.fx.GraphModule:
        raise NotImplementedError(f"{type(self).__name__}.rewrite")


@dataclass(frozen=True)
class InductorPass(_VariantLevel):
    """A post-grad pass that Inductor runs on the variants whose sizes it ``applies`` to:
    ``rewrite(graph)`` changes Inductor's post-grad ``torch.fx.Graph`` in place (Inductor's
    ``post_grad_custom_post_pass``; its pattern matcher works here). Called on a ``torch.fx.Graph``
    (as Inductor calls it) it runs ``rewrite``; on a ``Program`` it runs as a pass."""

    name: ClassVar[str] = "inductor_pass"

    def applies(self, sizes: Sizes) -> bool:
        return True

    def rewrite(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError(f"{type(self).__name__}.rewrite")

    def __call__(self, target: Any) -> Any:
        if isinstance(target, torch.fx.Graph):
            return self.rewrite(target)
        return super().__call__(target)


def rewrite_program(program: Program, graph_passes: Sequence[GraphPass], inductor_passes: Sequence[InductorPass],
                    by: Pass) -> Program:
    """``program`` with ``graph_passes`` run on each (compute piece, variant) they apply to, in
    order, and ``inductor_passes`` attached to the variants they apply to; ``by`` (the pass that
    ran them) is recorded in ``Program.rewrites``, so that variants the dispatch makes later get
    them too. Raises ``ConfigError`` once variants are compiled."""
    compiled = [p.name for p in program.compute_pieces if any(v.compiled is not None for v in p.variants)]
    if compiled:
        raise ConfigError(f"graph passes run before Lower: {compiled[0]}'s variants are compiled already, and "
                          f"{by.spec()} now would not reach them; put {by.spec()} between Concretize and Lower")
    shared: dict[tuple, torch.fx.GraphModule | None] = {}  # (pass, its input graph, rewrite_key): its output
    pieces = tuple(p if p.is_splitting else dataclasses.replace(
        p, variants=tuple(_variant(graph_passes, inductor_passes, p, v, program.fixed_sizes, shared)
                          for v in p.variants))
        for p in program.pieces)
    return program.replace(pieces=pieces, rewrites=(*program.rewrites, by))


def _variant(graph_passes: Sequence[GraphPass], inductor_passes: Sequence[InductorPass], piece: Piece,
             variant: Variant, fixed: Mapping[str, int] | None,
             shared: dict[tuple, torch.fx.GraphModule | None]) -> Variant:
    sizes = variant_sizes(variant.binding, piece.shapes.names if piece.shapes else {}, fixed)
    graph = [p for p in graph_passes if _ask(p, "applies", piece, sizes)]
    inductor = tuple(p for p in inductor_passes if _ask(p, "applies", piece, sizes))
    if not graph and not inductor:
        return variant
    gm = variant.gm if variant.gm is not None else piece.gm
    applied = list(variant.passes)
    options = dict(variant.inductor_options)
    for p in graph:
        out = _shared_run(p, piece, gm, sizes, shared)
        if out is not None:  # a pass that found nothing to change leaves the graph shared
            gm = out
            applied.append(p.uuid())
            options.update(p.inductor_options())
    changed = len(applied) > len(variant.passes)
    if not changed and not inductor:
        return variant
    return dataclasses.replace(variant, gm=gm if changed else variant.gm, passes=tuple(applied),
                               inductor_passes=(*variant.inductor_passes, *inductor),
                               inductor_options=tuple(sorted(options.items())))


def _ask(p: GraphPass | InductorPass, method: str, piece: Piece, sizes: dict[str, Any]) -> Any:
    """``p.<method>(sizes)`` (``applies``, ``rewrite_key``), an error naming the pass and piece where it raises."""
    try:
        out = getattr(p, method)(sizes)
    except Exception as e:
        raise ShapewiseError(f"graph pass {p.spec()}.{method}({sizes}) raised for {piece.name}: "
                             f"{type(e).__name__}: {e}") from e
    return bool(out) if method == "applies" else out


def _outputs(gm: torch.fx.GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(out.args[0]) if isinstance(out.args[0], (list, tuple)) else 1


def _placeholders(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]


def _shared_run(p: GraphPass, piece: Piece, gm: torch.fx.GraphModule, sizes: VariantSizes,
                shared: dict[tuple, torch.fx.GraphModule | None]) -> torch.fx.GraphModule | None:
    """``_run``, once for the variants whose ``rewrite_key`` is equal (a key of None: every time).
    The graph in the key is the input's identity: the variants share it while no earlier pass
    rewrote them apart."""
    key = _ask(p, "rewrite_key", piece, sizes)
    if key is None:
        return _run(p, piece, gm, sizes)
    memo = (id(p), id(gm), key)  # both alive for the whole rewrite_program call
    if memo not in shared:
        shared[memo] = _run(p, piece, gm, sizes)
    return shared[memo]


def _run(p: GraphPass, piece: Piece, gm: torch.fx.GraphModule, sizes: dict[str, Any]) -> torch.fx.GraphModule | None:
    """The rewritten graph, checked; None where the pass changed nothing."""
    where = f"graph pass {p.spec()} on {piece.name} at sizes {sizes}"
    mine = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    try:
        result = p.rewrite(mine, sizes)
    except Exception as e:
        raise ShapewiseError(f"{where} raised {type(e).__name__}: {e}") from e
    out, modified = (result.graph_module, result.modified) if isinstance(result, PassResult) else (result, None)
    if not isinstance(out, torch.fx.GraphModule):
        raise ShapewiseError(f"{where} returned {type(result).__name__}; return "
                             "PassResult(the rewritten torch.fx.GraphModule, whether it changed)")
    try:
        out.graph.lint()
        out.recompile()
    except Exception as e:
        raise ShapewiseError(f"{where} made a broken graph: {type(e).__name__}: {e}") from e
    differs = out.code != gm.code
    if modified is False and differs:
        raise ShapewiseError(f"{where} returned modified=False but changed the graph; return "
                             "PassResult(gm, True)")
    if not (differs if modified is None else modified):
        return None
    if _placeholders(out) != _placeholders(gm):
        raise ShapewiseError(f"{where} changed the graph's inputs ({_placeholders(gm)} -> {_placeholders(out)}); "
                             "a rewrite keeps the piece's placeholders, in order")
    if _outputs(out) != _outputs(gm):
        raise ShapewiseError(f"{where} changed the number of outputs ({_outputs(gm)} -> {_outputs(out)})")
    return out
