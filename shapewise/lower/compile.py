"""One compile: a (piece, variant) through a backend (Inductor, aot_eager, eager or a
callable), static from concrete fake inputs or over a range in the variant's own ShapeEnv."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
import torch.fx

from shapewise import _compat
from shapewise.errors import CompileError
from shapewise.ir.program import Piece, Variant

__all__ = ["lower_variant"]


def _copy_gm(gm: torch.fx.GraphModule, static: bool = False) -> torch.fx.GraphModule:
    # Compilers take ownership of (mutate) the graph they get; the piece keeps its own.
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    if static:
        # The trace's unbacked sizes (torch 2.11 makes a slice's size one under size-oblivious
        # tracing) are concrete at one size: a compile from static inputs has no shape env to
        # rebind them in ("shape_env should not be None", seen on the H200).
        for node in out.graph.nodes:
            node.meta.pop("unbacked_bindings", None)
    return out


def _fake_mode_of(args: list[Any]):
    for a in args:
        mode = getattr(a, "fake_mode", None)
        if mode is not None:
            return mode
        if isinstance(a, torch.SymInt):
            return _compat.FakeTensorMode(shape_env=a.node.shape_env)
    return None


def _is_symbolic(args: list[Any]) -> bool:
    for a in args:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride())):
            return True
    return False


def lower_variant(piece: Piece, variant: Variant, backend: Any, options: Mapping[str, Any]) -> Callable[..., Any]:
    """Compile one (piece, variant) and return a callable taking the piece's inputs positionally.

    Static variants compile from concrete fake inputs in no tracing context; range variants in
    the context of their own fresh ShapeEnv (see ``concretize.example_args``).
    """
    args = list(variant.example_args)
    if backend == "eager":
        return piece.gm.forward
    # Symbolic args: a range variant, or a piece whose inputs have data-dependent sizes.
    mode = _fake_mode_of(args) if _is_symbolic(args) else None
    static = mode is None
    # Range compiles reason size-obliviously, as the trace did, so the layouts a piece
    # produces are the ones the next piece was compiled for (otherwise an undecided stride
    # order, n vs 3, is decided by the hint, against the trace). Except in training where no
    # size of the piece reaches 0 or 1: there AOTAutograd would restride saved activations to
    # the strides of the range's trace value (its check `stride != hint` is undecidable when
    # oblivious), and the backward asserted the strides of one size (x [2, T, 32] saved for a
    # LayerNorm backward failed at every T but one; found by a user trial).
    training = torch.is_grad_enabled() and any(getattr(a, "requires_grad", False) for a in args)
    reaches_one = mode is not None and (not training or _some_size_reaches_one(piece, variant))
    oblivious = _compat.no_zero_one_specialisation(mode is not None and reaches_one)
    with _compat.fresh_tracing_context(mode), oblivious:
        if backend == "inductor":
            fn = _compat.standalone_compile(_copy_gm(piece.gm, static), args, static=static, options=options,
                                            cache_salt=None if static else f"shapewise range {variant.binding}")
        elif backend == "aot_eager":
            fn = _compat.aot_eager(_copy_gm(piece.gm, static), args)
        else:
            fn = backend(_copy_gm(piece.gm, static), args)
    if mode is not None:
        bad = _compat.range_guard_violations(mode)
        if bad:
            raise CompileError(
                f"the compile of {piece.name} for range {variant.binding} assumed something that does not "
                f"hold over the whole range: {'; '.join(bad)}; split the range or compile those sizes statically"
            )
    return fn


def _size_exprs(gm: torch.fx.GraphModule) -> set[sympy.Expr]:
    """Every symbolic size of every value in ``gm`` (each expression once)."""
    exprs: set[sympy.Expr] = set()

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            exprs.update(d.node.expr for d in v.shape if isinstance(d, torch.SymInt))
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    for node in gm.graph.nodes:
        visit(_compat.node_value(node))
    return exprs


def _some_size_reaches_one(piece: Piece, variant: Variant) -> bool:
    """Whether some size in the piece (an input's or an intermediate's: ``n - 1``, ``(n + 1) // 2``)
    is 0 or 1 at a corner of the variant's ranges, or the piece has symbols no binding fixes
    (data-dependent sizes, from 0)."""
    bound = dict(variant.binding.items)
    if piece.shapes is not None and any(s not in bound for s in piece.shapes.symbols):
        return True
    ends = [(s, (v,) if isinstance(v, int) else v) for s, v in bound.items()]
    corners = [dict(zip([s for s, _ in ends], c)) for c in itertools.product(*(e for _, e in ends))]
    for e in _size_exprs(piece.gm):
        if any(type(f).__name__ in ("Mod", "PythonMod") for f in e.atoms(sympy.Function)):
            return True  # not monotone: n % 4 is 0 and 1 inside (2, 7), at neither end
        for c in corners:
            v = e.xreplace({s: sympy.Integer(x) for s, x in c.items()})
            if v.free_symbols or v <= 1:
                return True
    return False
