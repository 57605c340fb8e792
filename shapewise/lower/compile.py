"""One compile: a (piece, variant) through a backend (Inductor, aot_eager, eager or a
callable), static from concrete fake inputs or over a range in the variant's own ShapeEnv."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from shapewise import _compat
from shapewise.errors import CompileError
from shapewise.ir.program import Binding, Piece, Variant

__all__ = ["MOST_PARTS", "RangeParts", "compile_static", "lower_variant", "reads_item_values"]

log = logging.getLogger("shapewise")


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


_READS_VALUES = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount", "repeat_interleave",
                 "item", "tolist", "argwhere")


def reads_values(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` reads a tensor's value into a size (``.item()``, ``nonzero``): a node that
    binds an unbacked size and is such an op (a slice's size that torch 2.11 makes unbacked under
    size-oblivious tracing is concrete at one size, and does not count)."""
    for node in gm.graph.nodes:
        if node.meta.get("unbacked_bindings") and node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            if any(k in str(name) for k in _READS_VALUES):
                return True
    return False


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


def compile_static(gm: torch.fx.GraphModule, args: Sequence[Any], options: Mapping[str, Any]) -> Any:
    """Inductor's compile of ``gm`` at one size, from concrete (fake) ``args``, in no tracing
    context: what ``lower_variant`` does for a static variant, and a compile worker
    (``shapewise.lower.workers``) for the session."""
    with _compat.fresh_tracing_context(None), _compat.no_zero_one_specialisation(False):
        return _compat.standalone_compile(_compat.specialise_region_sizes(_copy_gm(gm, True), args), list(args),
                                          static=True, options=dict(options))


def lower_variant(piece: Piece, variant: Variant, backend: Any, options: Mapping[str, Any],
                  _parts_left: list[int] | None = None) -> Callable[..., Any]:
    """Compile one (piece, variant) and return a callable taking the piece's inputs positionally.

    Static variants compile from concrete fake inputs in no tracing context; range variants in
    the context of their own fresh ShapeEnv (see ``concretize.example_args``). A range compile
    that assumed something about one of its sizes that holds over part of the range only (a
    floor division, ``(n // 8 - 1) // 2 == 1``) serves that part, and the rest compiles again,
    part by part (``RangeParts``, at most ``MOST_PARTS`` compiles).
    """
    args = list(variant.example_args)
    if backend == "eager":
        return piece.gm.forward
    # Symbolic args: a range variant, or a piece whose inputs have data-dependent sizes.
    mode = _fake_mode_of(args) if _is_symbolic(args) else None
    static = mode is None
    if static and backend == "inductor" and not reads_values(piece.gm):
        return compile_static(piece.gm, args, options)
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
    context = mode
    reads = static and reads_values(piece.gm)
    if reads:
        # A piece that reads a tensor's value (.item(): XLM's longest length, JetMoE's expert
        # counts) makes an unbacked size as it compiles, in a ShapeEnv: a static compile gets one.
        context = _compat.data_env_mode()
        args = _compat.refake(args, context)
    _compat.skip_unbacked_names(context, piece.gm)
    # The trace's unbacked bindings name symbols of the trace's ShapeEnv; a compile in another
    # env (a range's, or a value-reading piece's) cannot rebind them, so they go too.
    gm = _copy_gm(piece.gm, static or _compat.has_traced_unbacked(piece.gm))
    with _compat.fresh_tracing_context(context), oblivious:
        if backend == "inductor":
            fn = _compat.standalone_compile(gm, args, static=static, options=options,
                                            cache_salt=None if static else f"shapewise range {variant.binding}")
        elif backend == "aot_eager":
            fn = _compat.aot_eager(gm, args)
        else:
            fn = backend(gm, args)
    if mode is not None:
        failures = _compat.range_guard_failures(mode)
        if failures:
            parts = _in_parts(piece, variant, mode, failures, fn, backend, options,
                              [MOST_PARTS - 1] if _parts_left is None else _parts_left)
            if parts is None:
                bad = "; ".join(f"{g} fails at {c}" if c else str(g) for g, c in failures)
                raise CompileError(
                    f"the compile of {piece.name} for range {variant.binding} assumed something that does not "
                    f"hold over the whole range: {bad}; split the range or compile those sizes statically"
                )
            return parts
    return fn


MOST_PARTS = 8  # compiles one range variant may take when its compiles hold over parts of it


class RangeParts:
    """A range variant compiled in parts: ``parts`` are (low, high, compiled callable) over one
    of its sizes, read from the call's input ``place`` ((input index, dim), or (index, None) for
    a size passed as an int)."""

    def __init__(self, name: str, place: tuple[int, int | None], parts: list[tuple[int, int, Callable[..., Any]]]):
        self.name, self.place, self.parts = name, place, sorted(parts, key=lambda p: p[0])

    def __call__(self, *args: Any) -> Any:
        i, d = self.place
        v = int(args[i]) if d is None else args[i].shape[d]
        for lo, hi, fn in self.parts:
            if lo <= v <= hi:
                return fn(*args)
        raise CompileError(f"{self.name}={v} is in none of the parts {self.describe()} of this range variant")

    def describe(self) -> str:
        return ", ".join(f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi, _ in self.parts)


def _in_parts(piece: Piece, variant: Variant, mode: Any, failures: list, fn: Callable[..., Any], backend: Any,
              options: Mapping[str, Any], parts_left: list[int]) -> RangeParts | None:
    """``fn`` (compiled over ``variant``'s range, breaking ``failures``) for the part of the range
    it is right on, and the rest compiled again; None when the failures are not over one size."""
    from shapewise.concretize.examples import narrowed_example_args

    run = _compat.serving_run(mode, failures)
    if run is None:
        return None
    name, a, b = run
    sym = next((s for s, v in variant.binding.items if str(s) == name and not isinstance(v, int)), None)
    place = _place_of(variant.example_args, next((k for k, v in _compat.made_for(mode).items() if v == name), None))
    if sym is None or place is None:
        return None
    lo, hi = variant.binding.mapping[sym]
    rest = [(p, q) for p, q in ((lo, a - 1), (b + 1, hi)) if p <= q]
    if len(rest) > parts_left[0]:
        return None
    parts_left[0] -= len(rest)
    parts = [(a, b, fn)]
    for p, q in rest:
        sub = Binding(tuple((s, ((p, q) if p < q else p) if s == sym else v) for s, v in variant.binding.items))
        part = dataclasses.replace(variant, binding=sub, example_args=narrowed_example_args(
            piece, variant.example_args, sub))
        parts.append((p, q, lower_variant(piece, part, backend, options, parts_left)))
    out = RangeParts(piece.shapes.name_of(sym) if piece.shapes else name, place, parts)
    log.info("shapewise: %s over %s compiled in parts %s (a compile assumed %s)", piece.name,
             variant.binding.describe(piece.shapes.names if piece.shapes else None), out.describe(),
             "; ".join(str(g) for g, _ in failures))
    return out


def _place_of(args: Sequence[Any], sym: Any) -> tuple[int, int | None] | None:
    """Where ``sym`` is an input's size as it is: (input index, dim), or (index, None)."""
    if sym is None:
        return None
    for i, a in enumerate(args):
        if isinstance(a, torch.SymInt) and a.node.expr == sym:
            return i, None
        if isinstance(a, torch.Tensor):
            for d, n in enumerate(a.shape):
                if isinstance(n, torch.SymInt) and n.node.expr == sym:
                    return i, d
    return None


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


def reads_item_values(gm: torch.fx.GraphModule) -> bool:
    """Whether a piece reads a tensor's values into Python (``.item()``, ``.tolist()``: a MoE's
    expert token counts), so that sizes inside it come from data."""
    return any(n.op == "call_method" and n.target in ("item", "tolist") or
               n.op == "call_function" and "_local_scalar_dense" in str(n.target) for n in gm.graph.nodes)
