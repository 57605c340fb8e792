"""Example arguments of a variant: fake tensors with a binding's shape, stride, offset and
storage (static), or symbolic ones in a fresh ShapeEnv bounded by a range."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from shapewise import _compat
from shapewise._compat import FakeTensorMode, storage_length
from shapewise.errors import BindingError
from shapewise.ir.program import Binding, Piece, TensorMeta
from shapewise.ir.symbolic import INT_MAX, evaluate, range_hint

__all__ = ['example_args', 'example_args_from_layouts', 'example_layouts', 'fake_at', 'narrowed_example_args']

def _fake(meta: TensorMeta, mode: FakeTensorMode, conv: Callable[[Any], Any], symbolic: bool,
          shape: list[Any], stride: list[Any], offset: Any) -> torch.Tensor:
    """One fake input of ``meta``'s dtype and device at (shape, stride, offset); a subclass
    (``DTensor``) rebuilt around fake inner tensors, each at its own layout."""
    with mode:
        if meta.subclass is not None:
            inner = {name: _fake(m, mode, conv, symbolic, [conv(e) for e in m.shape], [conv(e) for e in m.stride],
                                 conv(m.offset)) if isinstance(m, TensorMeta) else m
                     for name, m in meta.subclass.inner}
            t = meta.subclass.cls.__tensor_unflatten__(inner, meta.subclass.ctx, tuple(shape), tuple(stride))
        elif symbolic and offset == 0:
            t = torch.empty_strided(shape, stride, dtype=meta.dtype, device=meta.device)
        else:
            length = storage_length(shape, stride, offset) if not symbolic else \
                _compat.compute_required_storage_length(shape, stride, offset)
            t = torch.empty(length, dtype=meta.dtype, device=meta.device).as_strided(shape, stride, offset)
        if meta.requires_grad and not t.requires_grad:
            t.requires_grad_(True)
    return t


def fake_at(meta: TensorMeta, mode: FakeTensorMode, values: Mapping[sympy.Symbol, int]) -> torch.Tensor:
    """A fake input of ``meta`` at the sizes ``values`` (its traced layout, evaluated)."""
    shape, stride, offset = meta.at(values)
    return _fake(meta, mode, lambda e: evaluate(e, values), False, list(shape), list(stride), offset)


def _materialise(piece: Piece, mode: FakeTensorMode, exprs: Mapping[sympy.Symbol, Any],
                 values: Mapping[sympy.Symbol, int], symbolic: bool,
                 observed: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """Fake inputs for ``piece`` with every symbol replaced by ``exprs`` (ints or new symbols).
    ``observed``: per input, a tensor whose concrete stride and offset replace the traced ones
    (what eager makes at this size, see ``observed_inputs``)."""
    out: list[Any] = []

    def conv(e: Any) -> Any:
        if symbolic:
            return _compat.make_symint(mode, sympy.sympify(e).xreplace(exprs), evaluate(e, values))
        return evaluate(e, values)

    for i, (name, meta) in enumerate(zip(piece.shapes.input_names, piece.shapes.inputs)):
        try:
            if isinstance(meta, TensorMeta):
                shape = [conv(e) for e in meta.shape]
                stride = [conv(e) for e in meta.stride]
                offset = conv(meta.offset)
                seen = observed[i] if observed is not None and i < len(observed) else None
                if meta.subclass is not None:
                    pass  # the subclass's own layout (its inner tensors'), not one eager made
                elif not symbolic and isinstance(seen, torch.Tensor) and list(seen.shape) == shape \
                        and seen.dtype == meta.dtype:
                    stride, offset = list(seen.stride()), seen.storage_offset()
                elif symbolic and isinstance(seen, tuple) and len(seen[0]) == len(meta.stride):
                    stride, offset = [conv(e) for e in seen[0]], conv(seen[1])  # exprs over the trace's symbols
                out.append(_fake(meta, mode, conv, symbolic, shape, stride, offset))
            elif isinstance(meta, sympy.Basic):
                out.append(conv(meta))
            else:
                out.append(meta)
        except KeyError as e:
            raise BindingError(
                f"piece {piece.name} input {name!r}: {e.args[0]}; a variant needs every size to "
                "follow from the dispatch symbols (data-dependent sizes cannot be specialised)"
            ) from None
    return tuple(out)


def example_args(piece: Piece, binding: Binding, mode: FakeTensorMode | None = None,
                 observed: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """Example inputs for compiling ``piece`` under ``binding``.

    Static: fake tensors with concrete shape/stride/offset on exactly the storage they need;
    strides and offsets from ``observed`` where given (see ``observed_inputs``). Ranges:
    ``observed`` gives (strides, offset) as expressions over the trace's symbols.
    Ranges: fake tensors over a fresh ShapeEnv whose symbols carry the range as bounds (so a
    compile can neither add guards to the trace nor assume the traced size).
    """
    bound = dict(binding.items)
    # Symbols of the piece that no binding can fix (data-dependent sizes, e.g. unbacked u0):
    # those stay symbolic, so such a piece compiles with symbolic args even for one size.
    free = [s for s in piece.shapes.symbols if s not in bound]
    if binding.is_static and not free:
        values = binding.static_values()
        return _materialise(piece, mode or FakeTensorMode(), values, values, symbolic=False, observed=observed)
    mode, new, exprs, values = _range_env(binding, piece.shapes.hints, free, piece.shapes.guards)
    return _materialise(piece, mode, exprs, values, symbolic=True, observed=observed)


def narrowed_example_args(piece: Piece, args: Sequence[Any], binding: Binding) -> tuple[Any, ...]:
    """Example inputs for ``binding``, a part of the range of the variant whose example inputs
    are ``args``, laid out as those are (their strides and offsets over that variant's symbols,
    evaluated in the part: what the pieces around it were compiled to make)."""
    return example_args_from_layouts(piece, binding, example_layouts(piece, args, binding))


def example_layouts(piece: Piece, args: Sequence[Any], binding: Binding) -> list[Any]:
    """Per input of ``args`` (a variant's example inputs), its layout as plain data over the trace's
    symbols, evaluated at ``binding`` where it is static: (shape, stride, offset, dtype) for a
    static binding, (strides, offset) as expressions for a range, None for a non-tensor or a
    subclass (a saved program keeps these, ``example_args_from_layouts`` makes the inputs again)."""
    env = _compat.shape_env_of(args)
    mode = _compat.FakeTensorMode(shape_env=env) if env is not None else None
    by_name = {str(s): s for s in piece.shapes.symbols}
    back = {new: by_name[old] for new, old in (_compat.made_for(mode) if mode is not None else {}).items()
            if old in by_name}
    values = {**binding.static_values()}

    def over_trace(e: Any) -> sympy.Expr:
        return sympy.sympify(_compat.sym_expr(e)).xreplace(back)

    out: list[Any] = []
    for a in args:
        if not isinstance(a, torch.Tensor) or _compat.is_traceable_wrapper_subclass(a):
            out.append(None)
            continue
        stride, offset = [over_trace(d) for d in a.stride()], over_trace(a.storage_offset())
        if binding.is_static:
            shape = tuple(evaluate(over_trace(d), values) for d in a.shape)
            out.append((shape, tuple(evaluate(d, values) for d in stride), evaluate(offset, values), a.dtype))
        else:
            out.append((tuple(stride), offset))
    return out


def example_args_from_layouts(piece: Piece, binding: Binding, layouts: Sequence[Any],
                              mode: FakeTensorMode | None = None) -> tuple[Any, ...]:
    """``example_args`` of ``piece`` at ``binding`` laid out as ``layouts`` say (``example_layouts``)."""
    observed: list[Any] = []
    for layout in layouts:
        if layout is not None and len(layout) == 4:
            shape, stride, offset, dtype = layout
            observed.append(torch.empty(storage_length(shape, stride, offset), dtype=dtype, device="meta")
                            .as_strided(shape, stride, offset))
        else:
            observed.append(layout)
    return example_args(piece, binding, mode, observed=observed)


def _range_env(binding: Binding, hints: Mapping[sympy.Symbol, int], free: Sequence[sympy.Symbol] = (),
               guards: Sequence[tuple[Any, Any]] = ()):
    """A fresh ShapeEnv for ``binding``: one new symbol per ranged (or ``free``) symbol, bounded
    by its range and hinted at ``_range_hint``; ``guards`` (the trace's, as ``(guard, where)``)
    limit the points a compile's own guards are checked at to calls the trace can serve.
    Returns (mode, {old: new symbol}, {old: new symbol or Integer}, {old: hint or value})."""
    ranged = {s: (v[0], v[1], range_hint(v[0], v[1], hints.get(s))) for s, v in binding.items
              if not isinstance(v, int)}
    ranged.update({s: (0, INT_MAX, range_hint(0, INT_MAX, hints.get(s))) for s in free})
    static = binding.static_values()
    assumed = [sympy.sympify(g).xreplace({s: sympy.Integer(v) for s, v in static.items()}) for g, _ in guards]
    mode, new = _compat.symbolic_env(ranged, [g for g in assumed if g not in (sympy.true, sympy.false)], free)
    exprs = {**{s: sympy.Integer(v) for s, v in static.items()}, **new}
    values = {**static, **{s: h for s, (_, _, h) in ranged.items()}}
    return mode, new, exprs, values
