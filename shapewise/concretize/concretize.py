"""Concretize: turn requested sizes into bindings, check them against the trace's guards,
and build each piece's static example arguments (shape, stride, offset, storage length)."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch

from shapewise import _compat
from shapewise._compat import FakeTensorMode, storage_length
from shapewise.errors import BindingError, ConfigError, GuardViolation
from shapewise.ir.keys import graph_key
from shapewise.ir.program import Binding, Piece, Program, ShapeInfo, TensorMeta, Variant
from shapewise.ir.runner import make_runner
from shapewise.ir.symbolic import evaluate
from shapewise.passes.base import Pass, register_pass

__all__ = ["Concretize", "check_binding", "check_sizes", "example_args", "make_bindings", "primary_symbols",
           "refusal"]

INT_MAX = 2**63 - 1

log = logging.getLogger("shapewise")


class _FrozenDict(dict):
    """A dict that hashes (so a frozen pass stays hashable) and is still a Mapping."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))


def _freeze(value: Any) -> Any:
    # A mapping stays a mapping: ``sizes=[{"batch": 1, "seq": 128}]`` is a list of bindings,
    # which make_bindings tells apart from (low, high) pairs by the dicts.
    if isinstance(value, Mapping):
        return _FrozenDict((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _name_table(shapes: ShapeInfo) -> dict[str, list[sympy.Symbol]]:
    table: dict[str, list[sympy.Symbol]] = {}
    for s in shapes.symbols:
        if s in shapes.names:
            table.setdefault(shapes.names[s], []).append(s)
    for s in shapes.symbols:
        table.setdefault(str(s), [s])
    return table


def primary_symbols(shapes: ShapeInfo) -> list[sympy.Symbol]:
    """The symbols a plain int size binds: every named symbol when one name is used;
    otherwise the symbol of dim 0 of the first tensor input whose dim 0 is symbolic."""
    named = sorted(set(shapes.names.get(s) for s in shapes.symbols if s in shapes.names))
    if len(named) > 1:
        raise BindingError(
            f"the graph has several named dynamic dims {named}: give sizes as a dict "
            f"{{name: [sizes]}} or a list of {{name: size}} bindings, not plain ints"
        )
    if named:
        return [s for s in shapes.symbols if shapes.names.get(s) == named[0]]
    for meta in shapes.inputs:
        if isinstance(meta, TensorMeta) and meta.shape and isinstance(meta.shape[0], sympy.Symbol):
            return [meta.shape[0]]
    if shapes.symbols:
        return [shapes.symbols[0]]
    raise BindingError("the graph has no symbolic sizes: there is nothing to bind sizes to")


def _specialised_dim0(shapes: ShapeInfo) -> int | None:
    """The size 0 or 1 Dynamo fixed dim 0 of the first tensor input to, in a graph with other
    dynamic sizes and no named ones (``torch.compile(dynamic=True)`` traces again at batch 1,
    specialised): plain-int sizes bind that dim, which this trace has fixed; else None."""
    if any(s in shapes.names for s in shapes.symbols) or not shapes.symbols:
        return None
    tensors = [m for m in shapes.inputs if isinstance(m, TensorMeta) and m.shape]
    if not tensors or any(isinstance(m.shape[0], sympy.Symbol) for m in tensors):
        return None
    first = tensors[0].shape[0]
    return int(first) if sympy.sympify(first).is_Integer and int(first) in (0, 1) else None


def resolve_names(shapes: ShapeInfo, mapping: Mapping[Any, Any], what: str) -> dict[sympy.Symbol, Any]:
    table = _name_table(shapes)
    out: dict[sympy.Symbol, Any] = {}
    for name, value in mapping.items():
        key = str(name)
        if key not in table:
            known = sorted(k for k in table if k in shapes.names.values()) or [str(s) for s in shapes.symbols]
            raise BindingError(f"{what} names {key!r}, which is not a dynamic dim of the graph; known: {known}")
        for s in table[key]:
            out[s] = value
    return out


def _by_name(shapes: ShapeInfo, resolved: Mapping[sympy.Symbol, Any]) -> dict[str, tuple[list[sympy.Symbol], Any]]:
    """``{symbol: value}`` from ``resolve_names`` grouped as ``{name: ([symbols], value)}``."""
    groups: dict[str, tuple[list[sympy.Symbol], Any]] = {}
    for s, v in resolved.items():
        groups.setdefault(shapes.name_of(s), ([], v))[0].append(s)
    return groups


def _check_size(v: Any, what: str) -> int:
    if not _is_int(v):
        raise ConfigError(f"{what}: sizes must be ints, got {v!r} ({type(v).__name__})")
    if v <= 0:
        raise ConfigError(f"{what}: sizes must be >= 1, got {v}")
    return v


def _check_range(r: Any, what: str) -> tuple[int, int]:
    if not (isinstance(r, (tuple, list)) and len(r) == 2):
        raise ConfigError(f"{what}: a range is a (low, high) pair of ints, inclusive; got {r!r}")
    lo, hi = _check_size(r[0], what), _check_size(r[1], what)
    if lo > hi:
        raise ConfigError(f"{what}: range ({lo}, {hi}) is empty: low must be <= high")
    return lo, hi


_SYMBOL_NAME = re.compile(r"[su]\d+")


def _check_name(name: Any, names: Collection[str] | None, what: str) -> None:
    if names is None or str(name) in names or _SYMBOL_NAME.fullmatch(str(name)):
        return
    close = difflib.get_close_matches(str(name), sorted(names), n=1)
    raise ConfigError(
        f"{what} names {str(name)!r}, which is not a dynamic dim; the dynamic dims are {sorted(names)}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
    )


def _no_duplicates(items: Sequence[Any], what: str) -> None:
    seen: list[Any] = []
    for x in items:
        if x in seen:
            raise ConfigError(f"{what} lists {x} more than once; give each size once")
        seen.append(x)


def _no_overlap(ranges: Sequence[tuple[int, int]], what: str) -> None:
    ordered = sorted(ranges)
    for (a, b), (c, d) in zip(ordered, ordered[1:]):
        if c <= b:
            raise ConfigError(f"{what}: ranges ({a}, {b}) and ({c}, {d}) overlap; "
                              "each run-time size must fall in at most one range")


def _listing(value: Any, what: str, of: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{what} must be {of}; got {value!r} ({type(value).__name__})")
    return list(value)


def _is_pair(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_int(x) for x in v)


def check_sizes(sizes: Any = (), ranges: Any = (), names: Collection[str] | None = None) -> None:
    """Check ``sizes`` and ``ranges`` before any trace: types, sizes >= 1, sizes listed twice,
    empty or overlapping ranges, and (given ``names``, the names of the dynamic dims) names
    that are not dims. Raises ``ConfigError``; ``make_bindings`` checks again on the graph."""
    of_sizes = "ints, a {name: [sizes]} dict or a list of {name: size} dicts"
    if isinstance(sizes, Mapping):
        for name, v in sizes.items():
            _check_name(name, names, "sizes")
            what = f"sizes[{str(name)!r}]"
            vals = [v] if _is_int(v) else _listing(v, what, "an int or a list of ints")
            _no_duplicates([_check_size(x, what) for x in vals], what)
    elif sizes is not None and not _is_int(sizes):
        items = _listing(sizes, "sizes", of_sizes)
        if any(isinstance(b, Mapping) for b in items):
            if not all(isinstance(b, Mapping) for b in items):
                raise ConfigError(f"sizes mixes ints and dicts: give {of_sizes}")
            for b in items:
                for name, v in b.items():
                    _check_name(name, names, "sizes")
                    _check_size(v, f"sizes[{str(name)!r}]")
            _no_duplicates([dict(b) for b in items], "sizes")
        else:
            _no_duplicates([_check_size(v, "sizes") for v in items], "sizes")
    elif _is_int(sizes):
        _check_size(sizes, "sizes")

    of_ranges = "a list of inclusive (low, high) pairs, a {name: [(low, high)]} dict or a list of {name: range} dicts"
    if isinstance(ranges, Mapping):
        for name, v in ranges.items():
            _check_name(name, names, "ranges")
            what = f"ranges[{str(name)!r}]"
            _no_overlap([_check_range(r, what) for r in ([v] if _is_pair(v) else _listing(v, what, "pairs"))], what)
    elif ranges is not None:
        items = _listing(ranges, "ranges", of_ranges)
        if len(items) == 2 and all(_is_int(x) for x in items):
            raise ConfigError(f"ranges must be {of_ranges}; got {ranges!r}: did you mean ranges=[{tuple(items)}]?")
        if any(isinstance(b, Mapping) for b in items):
            if not all(isinstance(b, Mapping) for b in items):
                raise ConfigError(f"ranges mixes pairs and dicts: give {of_ranges}")
            boxes = []
            for b in items:
                box = {}
                for name, v in b.items():
                    _check_name(name, names, "ranges")
                    what = f"ranges[{str(name)!r}]"
                    box[str(name)] = (_check_size(v, what),) * 2 if _is_int(v) else _check_range(v, what)
                boxes.append(box)
            for a, b in itertools.combinations(boxes, 2):
                if a.keys() == b.keys() and all(a[k][0] <= b[k][1] and b[k][0] <= a[k][1] for k in a):
                    raise ConfigError(f"ranges {a} and {b} overlap; each run-time size must fall in at most one range")
        else:
            _no_overlap([_check_range(r, "ranges") for r in items], "ranges")


def make_bindings(shapes: ShapeInfo, sizes: Any = (), ranges: Any = (),
                  fixed: Mapping[str, int | None] | None = None,
                  optional: Collection[sympy.Symbol] = ()) -> tuple[Binding, ...]:
    """Bindings over every free symbol, from user ``sizes`` and ``ranges``.

    - ints bind the primary symbol(s) (see ``primary_symbols``);
    - ``{name: [sizes]}`` is a product; ``[{name: size}, ...]`` lists bindings;
    - ranges likewise with inclusive ``(low, high)`` pairs.
    Symbols nobody named stay at their traced value; named dims missing from a range (or
    ``optional`` ones missing from a size) span their whole valid range. With neither sizes nor
    ranges: one general binding, every symbol over its whole valid range.

    ``fixed``: dims (by name) that this trace fixed to one value (Dynamo specialised them, e.g.
    ``seq=1`` where the model's Python branches on ``seq > 1``): the bindings that agree with
    it, without those dims (see ``_agreeing_bindings``).
    """
    if fixed and (sizes or ranges):
        return _agreeing_bindings(shapes, sizes, ranges, fixed)
    symbols = shapes.symbols
    named = {s for s in symbols if s in shapes.names}

    def full_range(s: sympy.Symbol) -> tuple[int, int]:
        lo, hi = shapes.ranges.get(s, (None, None))
        return max(1, lo or 1), hi if hi is not None else INT_MAX

    def complete(partial: dict[sympy.Symbol, Any], ranged: bool, what: str) -> Binding:
        items = []
        for s in symbols:
            if s in partial:
                items.append((s, partial[s]))
            elif s in named and not ranged and s not in optional:
                raise BindingError(
                    f"{what} does not bind the dynamic dim {shapes.name_of(s)!r}; "
                    f"bind every named dim ({sorted(set(shapes.names.values()))})"
                )
            elif s in named or s not in shapes.hints:
                items.append((s, full_range(s)))
            else:
                items.append((s, shapes.hints[s]))
        return Binding(tuple(items))

    out: list[Binding] = []
    if sizes is None:
        sizes = ()
    if _is_int(sizes):
        sizes = (sizes,)
    if isinstance(sizes, Mapping):
        # A product over the names: the dims that share a name (input_ids' and attention_mask's
        # batch) take the same size in every binding.
        groups = _by_name(shapes, resolve_names(shapes, sizes, "sizes"))
        lists = [[_check_size(v, f"sizes[{name!r}]") for v in ((vals,) if _is_int(vals) else vals)]
                 for name, (_, vals) in groups.items()]
        for combo in itertools.product(*lists):
            out.append(complete({s: v for (syms, _), v in zip(groups.values(), combo) for s in syms}, False, "sizes"))
    else:
        sizes = list(sizes)
        if sizes and all(isinstance(b, Mapping) for b in sizes):
            for b in sizes:
                resolved = resolve_names(shapes, b, "sizes")
                out.append(complete({s: _check_size(v, "sizes") for s, v in resolved.items()}, False, "sizes"))
        elif sizes:
            fixed0 = _specialised_dim0(shapes)
            prim = primary_symbols(shapes) if fixed0 is None else []
            for v in sizes:
                _check_size(v, "sizes")
                if fixed0 is None:
                    out.append(complete({s: v for s in prim}, False, "sizes"))
                elif v == fixed0 and not out:  # this trace serves only the size Dynamo fixed
                    out.append(complete({}, False, "sizes"))
    dup = [b for i, b in enumerate(out) if b in out[:i]]
    if dup:
        raise ConfigError(f"sizes lists {dup[0].describe(shapes.names)} more than once; give each size once")

    range_out: list[Binding] = []
    if ranges is None:
        ranges = ()
    if isinstance(ranges, Mapping):
        groups = _by_name(shapes, resolve_names(shapes, ranges, "ranges"))
        lists = []
        for name, (_, v) in groups.items():
            if isinstance(v, tuple) and len(v) == 2 and all(_is_int(x) for x in v):
                v = [v]
            lists.append([_check_range(r, f"ranges[{name!r}]") for r in v])
        for combo in itertools.product(*lists):
            range_out.append(complete({s: r for (syms, _), r in zip(groups.values(), combo) for s in syms}, True,
                                      "ranges"))
    else:
        ranges = list(ranges)
        if ranges and all(isinstance(b, Mapping) for b in ranges):
            for b in ranges:
                resolved = resolve_names(shapes, b, "ranges")
                part = {s: (_check_size(v, "ranges") if _is_int(v) else _check_range(v, "ranges"))
                        for s, v in resolved.items()}
                range_out.append(complete(part, True, "ranges"))
        elif ranges:
            fixed0 = _specialised_dim0(shapes)
            prim = primary_symbols(shapes) if fixed0 is None else []
            for r in ranges:
                r = _check_range(r, "ranges")
                if fixed0 is None:
                    range_out.append(complete({s: r for s in prim}, True, "ranges"))
                elif r[0] <= fixed0 <= r[1] and not out:
                    out.append(complete({}, False, "ranges"))
    _check_overlap(range_out, shapes)
    out.extend(range_out)
    if not out and not (sizes or ranges):  # the general binding: every symbol over its whole valid range
        out.append(Binding(tuple((s, full_range(s)) for s in symbols)))
    return tuple(out)


def _agreeing_bindings(shapes: ShapeInfo, sizes: Any, ranges: Any, fixed: Mapping[str, int]) -> tuple[Binding, ...]:
    """The user's bindings that a trace with ``fixed`` dims serves. Each fixed name stands in as
    a symbol of its own (bounded to its value), the sizes and ranges are read as for any trace,
    a binding is kept where the stand-in's size is (or its range holds) the fixed value, and the
    stand-ins are dropped: ``{batch: [1, 2], seq: [1, 8]}`` with ``seq=1`` fixed gives ``{batch=1}``
    and ``{batch=2}``; a range over seq that holds 1 gives that trace's (static) binding. A name
    fixed to None is a dim the trace does not have (an empty KV cache): every size agrees."""
    stand = {sympy.Dummy(f"fixed_{name}", integer=True, positive=True): (name, v) for name, v in fixed.items()}
    augmented = dataclasses.replace(
        shapes, symbols=(*shapes.symbols, *stand),
        names={**shapes.names, **{s: name for s, (name, _) in stand.items()}},
        ranges={**shapes.ranges, **{s: (v, v) if v is not None else (1, None) for s, (_, v) in stand.items()}},
        hints={**shapes.hints, **{s: v for s, (_, v) in stand.items() if v is not None}})
    known = {name: v for name, v in fixed.items() if v is not None}
    sizes, ranges = _agreeing_spec(sizes, known, False), _agreeing_spec(ranges, known, True)
    out: list[Binding] = []
    for b in make_bindings(augmented, sizes, ranges, optional={s for s, (_, v) in stand.items() if v is None}):
        values = b.mapping
        if all(v is None or (values[s] == v if isinstance(values[s], int) else values[s][0] <= v <= values[s][1])
               for s, (_, v) in stand.items()):
            kept = Binding(tuple((s, x) for s, x in b.items if s not in stand))
            if kept not in out:
                out.append(kept)
    return tuple(out)


def _agreeing_spec(spec: Any, fixed: Mapping[str, int], ranged: bool) -> Any:
    """``sizes`` or ``ranges`` without the entries that name a fixed dim at another size (so a
    ``{seq: 12}`` need not bind the kv dim of a trace that fixed seq=1): a list of dicts loses
    those dicts, a ``{name: [...]}`` dict those values."""
    def agrees(name: Any, v: Any) -> bool:
        f = fixed.get(str(name))
        return f is None or (v == f if _is_int(v) else _is_pair(v) and v[0] <= f <= v[1])

    if isinstance(spec, Mapping):
        out = {}
        for name, v in spec.items():
            vals = [v] if _is_int(v) or (ranged and _is_pair(v)) else list(v)
            out[name] = [x for x in vals if agrees(name, x)]
        return out if all(out.values()) else []
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(b, Mapping) for b in spec):
        return [b for b in spec if all(agrees(k, v) for k, v in b.items())]
    return spec


def _check_overlap(bindings: Sequence[Binding], shapes: ShapeInfo) -> None:
    for a, b in itertools.combinations(bindings, 2):
        if all(lo1 <= hi2 and lo2 <= hi1 for (lo1, hi1), (lo2, hi2) in zip(a.bounds(), b.bounds())):
            raise ConfigError(
                f"ranges {a.describe(shapes.names)} and {b.describe(shapes.names)} overlap; "
                "each run-time size must fall in at most one range"
            )


def _guard_text(shapes: ShapeInfo, guard: Any) -> str:
    named = str(guard)
    for s in shapes.symbols:
        named = named.replace(str(s), shapes.name_of(s)) if s in shapes.names else named
    return named


def _holds(guard: Any, values: Mapping[sympy.Symbol, int]) -> bool | None:
    """Whether ``guard`` holds at ``values`` (None: not decidable from them)."""
    try:
        return bool(sympy.sympify(guard).xreplace({s: sympy.Integer(v) for s, v in values.items()}))
    except TypeError:
        return None


def _range_corners(binding: Binding) -> list[dict[sympy.Symbol, int]]:
    """The corners of a range binding's box (its sizes at either end of every range)."""
    ends = [[v] if isinstance(v, int) else sorted({v[0], v[1]}) for _, v in binding.items]
    return [dict(zip([s for s, _ in binding.items], combo)) for combo in itertools.product(*ends)]


def check_binding(shapes: ShapeInfo, binding: Binding) -> None:
    """Refuse a binding that contradicts the trace's guards or proven value ranges. A range is
    checked at its ends (the sizes it names), so ``(1, 8)`` under a guard ``n != 1`` fails here,
    before any compile; sizes inside it that a guard refuses (odd ones under ``n % 2 == 0``) are
    the model's to refuse at run time (behind Dynamo, its guards trace them again)."""
    for s, v in binding.items:
        lo, hi = shapes.ranges.get(s, (None, None))
        vlo, vhi = (v, v) if isinstance(v, int) else v
        if (lo is not None and vlo < lo) or (hi is not None and vhi > hi):
            raise GuardViolation(
                f"size {shapes.name_of(s)}={v if isinstance(v, int) else f'{vlo}..{vhi}'} is outside the range "
                f"the trace allows for it [{lo}, {hi if hi is not None else 'inf'}]"
            )
    guards = [sympy.sympify(g) for g, _ in shapes.guards]
    points = [binding.static_values()] if binding.is_static else _range_corners(binding)
    for (guard, where), g in zip(shapes.guards, guards):
        for values in points:
            if _holds(g, values) is not False:
                continue
            where_text = f" (from: {where})" if where else ""
            if binding.is_static:
                raise GuardViolation(
                    f"size {binding.describe(shapes.names)} contradicts the trace's guard "
                    f"`{_guard_text(shapes, guard)}`{where_text}; choose sizes that satisfy it"
                )
            at = Binding(tuple((s, values[s]) for s, _ in binding.items)).describe(shapes.names)
            raise GuardViolation(
                f"range {binding.describe(shapes.names)} ends at the size {at}, which contradicts the trace's guard "
                f"`{_guard_text(shapes, guard)}`{where_text}; give a range whose ends satisfy it"
            )


def refusal(shapes: ShapeInfo, name: str, value: int) -> str | None:
    """Why a trace cannot serve the dim ``name`` at ``value`` (its proven range, or a guard over
    that dim alone, excludes it), or None when it can as far as that dim goes. A dim the trace
    has no symbol for (it fixed it) is refused too: its value is not known here."""
    syms = [s for s in shapes.symbols if shapes.names.get(s) == name]
    if not syms:
        return f"the trace fixed {name}"
    for s in syms:
        lo, hi = shapes.ranges.get(s, (None, None))
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            top = hi if hi is not None else "inf"
            return f"{name}={value} is outside the range the trace allows for it [{lo}, {top}]"
    values = {s: value for s in syms}
    for guard, _ in shapes.guards:
        g = sympy.sympify(guard)
        if g.free_symbols <= set(syms) and _holds(g, values) is False:
            return f"{name}={value} contradicts the trace's guard `{_guard_text(shapes, guard)}`"
    return None


def _range_hint(lo: int, hi: int, traced: int | None) -> int:
    """A representative value to trace a range with: the traced size if it lies inside,
    else the geometric middle; never 0 or 1 (they would be specialised)."""
    if traced is not None and lo <= traced <= hi and traced >= 2:
        return traced
    mid = int(math.sqrt(max(lo, 2) * min(hi, 8192)))
    return min(max(mid, lo, 2), hi)


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
                if not symbolic and isinstance(seen, torch.Tensor) and list(seen.shape) == shape \
                        and seen.dtype == meta.dtype:
                    stride, offset = list(seen.stride()), seen.storage_offset()
                elif symbolic and isinstance(seen, tuple) and len(seen[0]) == len(meta.stride):
                    stride, offset = [conv(e) for e in seen[0]], conv(seen[1])  # exprs over the trace's symbols
                with mode:
                    if symbolic and offset == 0:
                        t = torch.empty_strided(shape, stride, dtype=meta.dtype, device=meta.device)
                    else:
                        length = storage_length(shape, stride, offset) if not symbolic else \
                            _compat.compute_required_storage_length(shape, stride, offset)
                        t = torch.empty(length, dtype=meta.dtype, device=meta.device).as_strided(shape, stride, offset)
                    if meta.requires_grad:
                        t.requires_grad_(True)
                out.append(t)
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
    mode, new, exprs, values = _range_env(binding, piece.shapes.hints, free)
    return _materialise(piece, mode, exprs, values, symbolic=True, observed=observed)


def _range_env(binding: Binding, hints: Mapping[sympy.Symbol, int], free: Sequence[sympy.Symbol] = ()):
    """A fresh ShapeEnv for ``binding``: one new symbol per ranged (or ``free``) symbol, bounded
    by its range and hinted at ``_range_hint``. Returns (mode, {old: new symbol}, {old: new
    symbol or Integer}, {old: hint or value})."""
    ranged = {s: (v[0], v[1], _range_hint(v[0], v[1], hints.get(s))) for s, v in binding.items
              if not isinstance(v, int)}
    ranged.update({s: (0, INT_MAX, _range_hint(0, INT_MAX, hints.get(s))) for s in free})
    mode, new = _compat.symbolic_env(ranged)
    static = binding.static_values()
    exprs = {**{s: sympy.Integer(v) for s, v in static.items()}, **new}
    values = {**static, **{s: h for s, (_, _, h) in ranged.items()}}
    return mode, new, exprs, values


@register_pass
@dataclass(frozen=True)
class Concretize(Pass):
    """Bindings from sizes/ranges; per compute piece one ``Variant`` with static example args.
    A binding that contradicts a guard of the trace raises ``GuardViolation``; with
    ``refused="skip"`` it is left out with a warning, with ``"skip-sizes"`` only a single size
    is (behind Dynamo a call at that size traces again, and a trace at a size admits it; a
    range has no such promise). ``sw.compile`` uses "skip-sizes" for its first trace and "skip"
    for later ones; the torch.compile backend entry "skip".

    ``Concretize(sizes=(1, 8), ranges=((9, 512),))``; ``Concretize(sizes={"batch": [1, 2], "seq": [128]})``.
    """

    name: ClassVar[str] = "concretize"
    sizes: Any = ()
    ranges: Any = ()
    refused: str = "error"
    fixed: Mapping[str, int | None] = dataclasses.field(default_factory=dict)  # dims the trace fixed (None: lacks)

    def __post_init__(self) -> None:
        check_sizes(self.sizes, self.ranges)  # fail before any trace: typos, sizes <= 0, overlaps
        if self.refused not in ("error", "skip", "skip-sizes"):
            raise ConfigError(f"refused must be 'error', 'skip' or 'skip-sizes', got {self.refused!r}")
        if _is_int(self.sizes):
            object.__setattr__(self, "sizes", (self.sizes,))
        object.__setattr__(self, "sizes", _freeze(self.sizes) if not isinstance(self.sizes, Mapping) else self.sizes)
        ranges = self.ranges
        object.__setattr__(self, "ranges", ranges if isinstance(ranges, Mapping) else _freeze(ranges))
        object.__setattr__(self, "fixed", _FrozenDict(self.fixed or {}))

    def requires(self, program: Program) -> Sequence[Pass | str]:
        return _need_split_and_shapes(program)

    def apply(self, program: Program) -> Program:
        shapes = program.shapes
        if not shapes.symbols and self.refused == "skip" and not self.fixed:
            # A trace with every size fixed (Dynamo specialised it, e.g. its first trace without
            # dynamic=True, or at size 1): compile it as it is; it serves exactly that call.
            log.info("shapewise: this trace has no dynamic sizes; compiling it as traced")
            bindings = (Binding(()),)
            return program.replace(bindings=bindings, pieces=attach_variants(program.pieces, bindings, program))
        bindings = []
        for b in make_bindings(shapes, self.sizes, self.ranges, self.fixed):
            try:
                check_binding(shapes, b)
            except GuardViolation as e:
                if self.refused == "error" or (self.refused == "skip-sizes" and not b.is_static):
                    raise
                log.warning("shapewise: skipping %s in this trace: %s (a call at that size makes Dynamo trace again)",
                            b.describe(shapes.names), e)
                continue
            bindings.append(b)
        return program.replace(bindings=tuple(bindings), pieces=attach_variants(program.pieces, bindings, program))


def attach_variants(pieces: Iterable[Piece], bindings: Sequence[Binding],
                    program: Program | None = None) -> tuple[Piece, ...]:
    """Give every compute piece one uncompiled variant per binding. With ``program``, a static
    variant's inputs take the layouts eager makes at its size (``observed_inputs``)."""
    pieces = tuple(pieces)
    out = []
    modes = {b: FakeTensorMode() for b in bindings if b.is_static}
    observed = {}
    if program is not None and modes:
        memo: dict[Any, Any] = {}  # identical layers at one size lay their outputs out alike: run one
        digests = {}
        for p in pieces:
            gk = graph_key(p.gm, p.shapes)
            digests[p.name] = gk.digest if gk is not None else None
        shared = (FakeTensorMode(allow_non_fake_inputs=True), {})  # one mode; parameters made once
        observed = {b: observed_inputs(program, b, memo, digests, shared) for b in modes}
    if program is not None:
        observed.update({b: observed_range_inputs(program, b) for b in bindings if not b.is_static})
    for p in pieces:
        if p.is_splitting:
            out.append(p)
            continue
        variants = tuple(Variant(b, example_args(p, b, modes.get(b), observed.get(b, {}).get(p.name)))
                         for b in bindings)
        out.append(dataclasses.replace(p, variants=variants))
    return tuple(out)


def observed_range_inputs(program: Program, binding: Binding) -> dict[str, tuple[Any, ...]]:
    """Each piece's input layouts, as (strides, offset) over the trace's symbols, as the split
    program makes them on fake tensors bounded by the ``binding``'s ranges.

    A range variant is compiled knowing its bounds, and so decides what the trace left
    undecided: over (3, 7), ``x.t().contiguous().t()[::3] * 2`` is column-major (``3 <= n``
    holds), where the trace (n >= 2) kept row-major; the next piece must be compiled for the
    layout the range variant before it makes. Failures keep the traced layouts."""
    shapes = program.shapes
    if shapes is None or program.graph is None or any(s not in dict(binding.items) for s in shapes.symbols):
        return {}
    try:
        mode, new, exprs, values = _range_env(binding, shapes.hints)
        args = _materialise(Piece("program", program.graph, shapes=shapes), mode, exprs, values, symbolic=True)
        with _compat.no_zero_one_specialisation():
            recorded = _run_split(program, args, mode)
        bad = _compat.range_guard_violations(mode)
        if bad:  # the run specialised a ranged size (an op's fake kernel read it as an int)
            raise GuardViolation("; ".join(bad))
    except Exception as e:  # noqa: BLE001 - the traced layouts are the fallback
        log.debug("shapewise: layouts over %s not observed (%s: %s)", binding, type(e).__name__, e)
        return {}
    back = {v: k for k, v in new.items()}

    def over_trace(e: Any) -> sympy.Expr:
        return sympy.sympify(_compat.sym_expr(e)).xreplace(back)

    return {name: tuple((tuple(over_trace(d) for d in t.stride()), over_trace(t.storage_offset()))
                        if isinstance(t, torch.Tensor) else None for t in a)
            for name, a in recorded.items()}


def _run_split(program: Program, args: Sequence[Any], mode: FakeTensorMode,
               run_piece: Callable[[Piece, tuple[Any, ...]], Any] | None = None,
               seen: dict[str, tuple[Any, ...]] | None = None) -> dict[str, tuple[Any, ...]]:
    """Run the split program on fake ``args`` under ``mode`` in the current grad mode (an op
    may lay its output out otherwise when an input needs grad: CPU SDPA with a learned mask,
    T5's position bias, in training), each piece as its own graph (or through
    ``run_piece(piece, args)``); returns each piece's inputs, in ``seen`` if given (so a
    caller keeps what was recorded before a failure)."""
    seen = {} if seen is None else seen

    def recorder(piece: Piece) -> Callable[..., Any]:
        def call(*a: Any) -> Any:
            seen[piece.name] = a
            return run_piece(piece, a) if run_piece is not None else piece.gm.forward(*a)
        return call

    run = make_runner(program.graph, {p.name: recorder(p) for p in program.pieces})
    with mode:
        run(*args)
    return seen


def _layout_of(value: Any) -> Any:
    """A hashable description of a value's layout (a tensor's) or of the value itself."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
                value.device, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("v", value)
    raise TypeError(type(value).__name__)


def _from_layout(desc: Any) -> Any:
    if desc[0] == "v":
        return desc[1]
    _, shape, stride, offset, dtype, device, requires_grad = desc
    if offset == 0:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    else:
        t = torch.empty(max(storage_length(shape, stride, offset), 1), dtype=dtype, device=device).as_strided(
            shape, stride, offset)
    return t.requires_grad_(True) if requires_grad else t


def observed_inputs(program: Program, binding: Binding, memo: dict[Any, Any] | None = None,
                    digests: Mapping[str, str | None] | None = None,
                    shared: tuple[FakeTensorMode, dict[Any, Any]] | None = None) -> dict[str, tuple[Any, ...]]:
    """Each piece's inputs as eager makes them at the static ``binding``: the split program run
    on fake tensors of that size, every piece as its own graph.

    The trace's layouts are symbolic and size-oblivious; at one size eager can lay a tensor out
    otherwise, and a piece compiled for the traced layout would read it wrong: at n=1
    ``x[:, None].expand(-1, 2, -1).reshape(-1, k)`` is a stride-0 view, not the copy the trace
    shows; at n=8 ``x.t().contiguous().t()[::3] * 2`` is column-major (the order depends on
    n vs 3, which the trace leaves undecided, with no guard). A piece whose propagation fails
    keeps the traced layouts (logged at debug level).

    ``memo`` (shared across bindings) with ``digests`` (each piece's content key): a piece whose
    content and input layouts were seen already is not run again; its outputs are rebuilt from
    the layouts it gave then (the layers of a model are one piece, many times). ``shared``: a
    fake mode and a cache of program inputs by layout, for several bindings (the parameters)."""
    shapes = program.shapes
    if shapes is None or program.graph is None:
        return {}
    values = binding.static_values()
    if any(s not in values for s in shapes.symbols):
        return {}
    mode, made = shared if shared is not None else (FakeTensorMode(allow_non_fake_inputs=True), {})
    seen: dict[str, tuple[Any, ...]] = {}

    def run_piece(piece: Piece, args: tuple[Any, ...]) -> Any:
        digest = (digests or {}).get(piece.name)
        if memo is None or digest is None:
            return piece.gm.forward(*args)
        try:
            key = (digest, tuple(_layout_of(a) for a in args))
        except TypeError:
            return piece.gm.forward(*args)
        if key in memo:
            outs = memo[key]
            return tuple(_from_layout(d) for d in outs) if isinstance(outs, tuple) else _from_layout(outs)
        out = piece.gm.forward(*args)
        try:
            memo[key] = tuple(_layout_of(o) for o in out) if isinstance(out, (tuple, list)) else _layout_of(out)
        except TypeError:
            pass
        return out

    try:
        args = []
        with mode:
            for meta in shapes.inputs:
                if isinstance(meta, TensorMeta):
                    desc = ("t", tuple(evaluate(e, values) for e in meta.shape),
                            tuple(evaluate(e, values) for e in meta.stride), evaluate(meta.offset, values),
                            meta.dtype, meta.device, meta.requires_grad)
                    if desc not in made:
                        made[desc] = _from_layout(desc)
                    args.append(made[desc])
                else:
                    args.append(evaluate(meta, values) if isinstance(meta, sympy.Basic) else meta)
        _run_split(program, args, mode, run_piece, seen)
    except Exception as e:  # noqa: BLE001 - the traced layouts are the fallback
        log.debug("shapewise: eager layouts at %s not observed (%s: %s); pieces after %s keep the traced ones",
                  binding, type(e).__name__, e, list(seen)[-1:] or "the start")
    return seen


def _need_split_and_shapes(program: Program) -> list[str]:
    needs = [] if program.is_split else ["split"]
    if program.shapes is None or any(p.shapes is None for p in program.pieces):
        needs.append("analyze_shapes")
    return needs
