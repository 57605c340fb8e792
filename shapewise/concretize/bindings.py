"""Sizes and ranges into bindings: parse and check what the user asked for (``check_sizes``),
bind it to the trace's symbols by dim name (``make_bindings``), and check each binding
against the trace's guards and proven ranges (``check_binding``, ``refusal``)."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import sympy

from shapewise.errors import BindingError, ConfigError, GuardViolation
from shapewise.ir.program import Binding, ShapeInfo, TensorMeta
from shapewise.ir.symbolic import INT_MAX, range_text

__all__ = ['check_binding', 'check_sizes', 'clip_binding', 'make_bindings', 'primary_symbols', 'refusal',
           'resolve_names', 'serves_neither_end']

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


_OF_SIZES = "ints, a {name: [sizes]} dict or a list of {name: size} dicts"
_OF_RANGES = "a list of inclusive (low, high) pairs, a {name: [(low, high)]} dict or a list of {name: range} dicts"


def parse_sizes(sizes: Any, names: Collection[str] | None = None) -> tuple[str, Any]:
    """``sizes`` as given, checked (ints >= 1, none twice, names that are dims when ``names``
    is given) and in one of three forms: ``("primary", [8, 16])`` (sizes of the primary dims),
    ``("product", {name: [sizes]})`` or ``("list", [{name: size}, ...])``. Raises ConfigError."""
    if sizes is None:
        return "primary", []
    if _is_int(sizes):
        return "primary", [_check_size(sizes, "sizes")]
    if isinstance(sizes, Mapping):
        product = {}
        for name, v in sizes.items():
            _check_name(name, names, "sizes")
            what = f"sizes[{str(name)!r}]"
            listed = [v] if _is_int(v) else _listing(v, what, "an int or a list of ints")
            vals = [_check_size(x, what) for x in listed]
            _no_duplicates(vals, what)
            product[name] = vals
        return "product", product
    items = _listing(sizes, "sizes", _OF_SIZES)
    if any(isinstance(b, Mapping) for b in items):
        if not all(isinstance(b, Mapping) for b in items):
            raise ConfigError(f"sizes mixes ints and dicts: give {_OF_SIZES}")
        listed = []
        for b in items:
            for name in b:
                _check_name(name, names, "sizes")
            listed.append({name: _check_size(v, f"sizes[{str(name)!r}]") for name, v in b.items()})
        _no_duplicates(listed, "sizes")
        return "list", listed
    vals = [_check_size(v, "sizes") for v in items]
    _no_duplicates(vals, "sizes")
    return "primary", vals


def parse_ranges(ranges: Any, names: Collection[str] | None = None) -> tuple[str, Any]:
    """``ranges`` as given, checked (inclusive (low, high) pairs of ints >= 1, not empty, not
    overlapping) and in the forms of ``parse_sizes``: ``("primary", [(lo, hi)])``,
    ``("product", {name: [(lo, hi)]})`` or ``("list", [{name: (lo, hi) or size}])``."""
    if ranges is None:
        return "primary", []
    if isinstance(ranges, Mapping):
        product = {}
        for name, v in ranges.items():
            _check_name(name, names, "ranges")
            what = f"ranges[{str(name)!r}]"
            rs = [_check_range(r, what) for r in ([v] if _is_pair(v) else _listing(v, what, "pairs"))]
            _no_overlap(rs, what)
            product[name] = rs
        return "product", product
    items = _listing(ranges, "ranges", _OF_RANGES)
    if len(items) == 2 and all(_is_int(x) for x in items):
        raise ConfigError(f"ranges must be {_OF_RANGES}; got {ranges!r}: did you mean ranges=[{tuple(items)}]?")
    if any(isinstance(b, Mapping) for b in items):
        if not all(isinstance(b, Mapping) for b in items):
            raise ConfigError(f"ranges mixes pairs and dicts: give {_OF_RANGES}")
        listed = []
        for b in items:
            box = {}
            for name, v in b.items():
                _check_name(name, names, "ranges")
                what = f"ranges[{str(name)!r}]"
                box[name] = _check_size(v, what) if _is_int(v) else _check_range(v, what)
            listed.append(box)
        spans = [{str(k): (v, v) if _is_int(v) else v for k, v in box.items()} for box in listed]
        for x, y in itertools.combinations(spans, 2):
            if x.keys() == y.keys() and all(x[k][0] <= y[k][1] and y[k][0] <= x[k][1] for k in x):
                raise ConfigError(f"ranges {x} and {y} overlap; each run-time size must fall in at most one range")
        return "list", listed
    rs = [_check_range(r, "ranges") for r in items]
    _no_overlap(rs, "ranges")
    return "primary", rs


def check_sizes(sizes: Any = (), ranges: Any = (), names: Collection[str] | None = None) -> None:
    """Check ``sizes`` and ``ranges`` before any trace (``parse_sizes``, ``parse_ranges``):
    types, sizes >= 1, sizes listed twice, empty or overlapping ranges, and (given ``names``,
    the names of the dynamic dims) names that are not dims. Raises ``ConfigError``."""
    parse_sizes(sizes, names)
    parse_ranges(ranges, names)


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

    def bind(what: str, form: str, parsed: Any, ranged: bool) -> list[Binding]:
        if form == "product":
            # A product over the names: the dims that share a name (input_ids' and attention_mask's
            # batch) take the same size in every binding.
            groups = _by_name(shapes, resolve_names(shapes, parsed, what))
            return [complete({s: v for (syms, _), v in zip(groups.values(), combo) for s in syms}, ranged, what)
                    for combo in itertools.product(*(vals for _, vals in groups.values()))]
        if form == "list":
            return [complete(resolve_names(shapes, b, what), ranged, what) for b in parsed]
        prim = primary_symbols(shapes) if parsed else []
        return [complete({s: v for s in prim}, ranged, what) for v in parsed]

    # A trace whose dim 0 Dynamo fixed (its first trace, at batch 1) serves only that size: one
    # binding, when a primary size or range holds it.
    fixed0 = _specialised_dim0(shapes)
    (s_form, s_parsed), (r_form, r_parsed) = parse_sizes(sizes), parse_ranges(ranges)
    if s_form == "primary" and fixed0 is not None:
        out = [complete({}, False, "sizes")] if fixed0 in s_parsed else []
    else:
        out = bind("sizes", s_form, s_parsed, False)
    dup = [b for i, b in enumerate(out) if b in out[:i]]
    if dup:
        raise ConfigError(f"sizes lists {dup[0].describe(shapes.names)} more than once; give each size once")
    range_out: list[Binding] = []
    if r_form == "primary" and fixed0 is not None:
        if not out and any(lo <= fixed0 <= hi for lo, hi in r_parsed):
            out.append(complete({}, False, "ranges"))
    else:
        range_out = bind("ranges", r_form, r_parsed, True)
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
    if not (sizes or ranges):  # none agrees (not "none given", which would mean every size): it serves none
        return ()
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




_MOST_CORNER_SYMBOLS = 10  # a guard over more ranged symbols than this is not checked at its corners


def check_binding(shapes: ShapeInfo, binding: Binding, single_symbol: bool = False) -> None:
    """Refuse a binding that contradicts the trace's guards or proven value ranges. A range is
    checked at its ends (the sizes it names), so ``(1, 8)`` under a guard ``n != 1`` fails here,
    before any compile; sizes inside it that a guard refuses (odd ones under ``n % 2 == 0``) are
    the model's to refuse at run time (behind Dynamo, its guards trace them again). ``single_symbol``:
    a range's corners are checked against the guards over one symbol only (its symbols can vary
    together, seq with ctx, so a corner of the box may be a call that never comes; the other
    guards are checked per call, by Dynamo or a direct call)."""
    for s, v in binding.items:
        lo, hi = shapes.ranges.get(s, (None, None))
        vlo, vhi = (v, v) if isinstance(v, int) else v
        if (lo is not None and vlo < lo) or (hi is not None and vhi > hi):
            raise GuardViolation(
                f"size {shapes.name_of(s)}={v if isinstance(v, int) else f'{vlo}..{vhi}'} is outside the range "
                f"the trace allows for it {range_text(lo, hi)}"
            )
    guards = [sympy.sympify(g) for g, _ in shapes.guards]
    bound = dict(binding.items)
    for (guard, where), g in zip(shapes.guards, guards):
        if single_symbol and len(g.free_symbols) > 1:
            continue  # a range's corners pair sizes that never come together (seq=11 with ctx=2)
        ranged = [s for s in g.free_symbols if not isinstance(bound.get(s, 0), int)]
        if len(ranged) > _MOST_CORNER_SYMBOLS:
            continue  # 2**k corners: left to the per-call guards (Dynamo's, or a direct call's)
        points = [binding.static_values()] if binding.is_static else binding.corners(over=g.free_symbols)
        for values in points:
            if _holds(g, values) is not False:
                continue
            where_text = f" (from: {where})" if where else ""
            if binding.is_static:
                raise GuardViolation(
                    f"size {binding.describe(shapes.names)} contradicts the trace's guard "
                    f"`{_guard_text(shapes, guard)}`{where_text}; choose sizes that satisfy it"
                )
            at = Binding(tuple((s, values.get(s, v)) for s, v in binding.items)).describe(shapes.names)
            raise GuardViolation(
                f"range {binding.describe(shapes.names)} ends at the size {at}, which contradicts the trace's guard "
                f"`{_guard_text(shapes, guard)}`{where_text}; give a range whose ends satisfy it"
            )


def serves_neither_end(shapes: ShapeInfo, binding: Binding) -> bool:
    """Whether some ranged symbol of ``binding`` fails a guard over it alone at both its ends:
    the range lies past a branch of the model's Python this trace took (it is another trace's
    to serve), rather than reaching past its edge."""
    single = [sympy.sympify(g) for g, _ in shapes.guards]
    single = [g for g in single if len(g.free_symbols) == 1]
    for s, v in binding.items:
        if isinstance(v, int):
            continue
        mine = [g for g in single if g.free_symbols == {s}]
        if mine and all(any(_holds(g, {s: end}) is False for g in mine) for end in v):
            return True
    return False


def clip_binding(shapes: ShapeInfo, binding: Binding) -> Binding | None:
    """The part of a range binding this trace can serve: each ranged symbol's range cut to the
    range the trace proved for it (a trace made on one side of a branch of the model's Python,
    ``n < window``, serves only that side; a call past it fails the trace's guards and traces
    again, for the other side). None when some symbol has nothing left; a static binding is
    returned as it is (``check_binding`` judges it)."""
    if binding.is_static:
        return binding
    items = []
    for s, v in binding.items:
        lo, hi = shapes.ranges.get(s, (None, None))
        if isinstance(v, int):
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                return None  # a size of it this trace cannot have (decode's seq=1 in a prefill trace)
            items.append((s, v))
            continue
        vlo, vhi = max(v[0], lo if lo is not None else v[0]), min(v[1], hi if hi is not None else v[1])
        if vlo > vhi:
            return None
        items.append((s, (vlo, vhi) if vlo < vhi else vlo))
    return Binding(tuple(items))


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
            return f"{name}={value} is outside the range the trace allows for it {range_text(lo, hi)}"
    values = {s: value for s in syms}
    for guard, _ in shapes.guards:
        g = sympy.sympify(guard)
        if g.free_symbols <= set(syms) and _holds(g, values) is False:
            return f"{name}={value} contradicts the trace's guard `{_guard_text(shapes, guard)}`"
    return None
