"""Fake tensors, ShapeEnvs and symbols: reading a trace's sizes, guards and ranges; making
symbolic inputs for range compiles and checking what a compile assumed."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "is_traceable_wrapper_subclass", "subclass_inner",
    "compute_required_storage_length",
    "evaluate_at", "fake_mode_active", "fresh_tracing_context", "make_symint", "no_zero_one_specialisation",
    "node_value", "range_guard_violations", "shape_env_of", "storage_length", "sym_expr", "symbol_hints",
    "symbolic_env", "trace_guards", "value_range",
]


TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def subclass_inner(t: torch.Tensor) -> list[tuple[str, Any]]:
    """A traceable subclass's inner values, in ``__tensor_flatten__`` order: (attribute, value),
    each a tensor or an object it carries (a DTensor's ``_local_tensor`` and, in newer torch,
    its ``device_mesh``)."""
    return [(name, getattr(t, name)) for name in t.__tensor_flatten__()[0]]


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is active here (tensors made now would be fake)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def node_value(node: torch.fx.Node) -> Any:
    """The fake value an FX node carries: ``val`` (AOT / make_fx) or ``example_value`` (Dynamo)."""
    meta = node.meta
    if "val" in meta:
        return meta["val"]
    return meta.get("example_value")


def sym_expr(value: Any) -> sympy.Expr:
    """A SymInt or int as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


def shape_env_of(values: Sequence[Any]):
    """The ShapeEnv behind the first symbolic value found in ``values`` (or None)."""
    for v in values:
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
        if isinstance(v, FakeTensor) and v.fake_mode.shape_env is not None:
            return v.fake_mode.shape_env
    return None


def symbol_hints(shape_env) -> dict[sympy.Symbol, int]:
    """Traced (example) values of the backed symbols."""
    if shape_env is None:
        return {}
    table = getattr(shape_env, "backed_var_to_val", None)
    if table is None:  # torch 2.11 spelling
        table = shape_env.var_to_val
    return {k: int(v) for k, v in table.items()}


def value_range(shape_env, symbol: sympy.Symbol) -> tuple[int | None, int | None]:
    """The (lower, upper) bounds the trace proved for ``symbol``; None where unbounded."""
    vr = shape_env.var_to_range.get(symbol) if shape_env is not None else None
    if vr is None:
        return None, None

    def as_int(b):
        b = sympy.sympify(b)
        return int(b) if b.is_Integer else None

    return as_int(vr.lower), as_int(vr.upper)


def trace_guards(shape_env) -> list[tuple[sympy.Basic, str]]:
    """The shape guards of a trace, as (sympy boolean, where it came from), over the trace's
    final symbols: a guard made before Dynamo replaced a symbol by another (labels' length,
    later proven equal to the tokens') is rewritten with the replacement, not lost."""
    if shape_env is None:
        return []
    replacements = dict(getattr(shape_env, "replacements", {}) or {})
    out = []
    for g in shape_env.guards:
        where = ""
        sloc = getattr(g, "sloc", None)
        if sloc is not None:
            where = _repair_location(str(getattr(sloc, "maybe_user_loc", "") or "").strip())
        expr = g.expr.xreplace(replacements) if replacements else g.expr
        if expr in (sympy.true, sympy.false) and expr is not g.expr:
            expr = g.expr  # decided by the replacement alone: keep it as written
        out.append((expr, where))
    return out


def _repair_location(where: str) -> str:
    """torch shortens a file path by its common path with torch's folder; for a file outside
    it that is ``/``, and the first letter after it is lost (``/tmp/m.py`` → ``mp/m.py``).
    Put it back when exactly that path exists."""
    import os
    import re

    m = re.search(r"# (\S+):(\d+) in ", where)
    if m is None or os.path.isabs(m.group(1)) or os.path.exists(m.group(1)):
        return where
    path = m.group(1)
    try:
        roots = os.listdir("/")
    except OSError:
        return where
    fixed = [f"/{e[0]}{path}" for e in roots if e and path.startswith(e[1:] + "/") and os.path.exists(f"/{e[0]}{path}")]
    return where[:m.start(1)] + fixed[0] + where[m.end(1):] if len(fixed) == 1 else where




def storage_length(shape: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """Exact number of storage elements a strided view needs."""
    return int(compute_required_storage_length(tuple(shape), tuple(stride), int(offset)))


@contextlib.contextmanager
def no_zero_one_specialisation(on: bool = True) -> Iterator[None]:
    """Trace so that a dynamic size of 0 or 1 does not get specialised (one trace for all sizes);
    ``on=False``: the default reasoning, also inside a trace that has it on."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=on):
        yield


@contextlib.contextmanager
def fresh_tracing_context(fake_mode: FakeTensorMode | None = None) -> Iterator[None]:
    """Leave any surrounding Dynamo tracing context, so a compile sees only its own inputs.

    ``compile_fx`` and AOTAutograd look up the active context's fake mode; inside a Dynamo
    backend that is Dynamo's (symbolic) one, which would make a "static" compile dynamic and
    let the compile's guards leak into Dynamo's. With ``fake_mode``, that mode's context.
    """
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(fake_mode) if fake_mode is not None else None):
        yield


def symbolic_env(symbols: dict[sympy.Symbol, tuple[int, int, int]]):
    """A fresh ShapeEnv + FakeTensorMode with one backed symbol per entry of
    ``{old symbol: (low, high, hint)}``; returns (mode, {old symbol: new sympy symbol})."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    new = {}
    for old, (lo, hi, hint) in symbols.items():
        e = env.create_symbol(hint, ConstantSource(f"shapewise_{old}"), dynamic_dim=DimDynamic.DYNAMIC,
                              do_not_specialize_zero_one=True)
        env.constrain_symbol_range(e, compiler_min=lo, compiler_max=hi)
        new[old] = e
    # The ranges as made: a guard that specialises a symbol narrows var_to_range to the
    # hint, so a later check must compare against these, not the env's current ranges.
    _MADE_RANGES[env] = {e: (lo, hi) for (lo, hi, _), e in zip(symbols.values(), new.values())}
    return mode, new


_MADE_RANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def evaluate_at(value: Any, values: Mapping[sympy.Symbol, int]) -> int:
    """An int, or a SymInt of a ``symbolic_env`` (its symbols stand for the trace's symbols
    they were made for), evaluated at ``values`` given over the trace's symbols."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = value.node.expr
    env = value.node.shape_env
    by_name = {f"shapewise_{s}": sympy.Integer(v) for s, v in values.items()}
    subs = {}
    for sym in expr.free_symbols:
        names = [src.name for src in env.var_to_sources.get(sym, [])]
        subs[sym] = next(by_name[n] for n in names if n in by_name)
    return int(expr.xreplace(subs))


def make_symint(mode: FakeTensorMode, expr: sympy.Expr, hint: int) -> Any:
    """A SymInt (or int, if constant) for ``expr`` over ``mode``'s symbols."""
    if not expr.free_symbols:
        return int(expr)
    return mode.shape_env.create_symintnode(expr, hint=hint)


def range_guard_violations(mode: FakeTensorMode) -> list[str]:
    """Guards a compile added to ``mode``'s ShapeEnv that do not hold at every corner of
    the symbols' ranges (e.g. a compile that specialised a ranged size to its hint)."""
    env = mode.shape_env
    if env is None:
        return []
    made = _MADE_RANGES.get(env, {})
    corners: list[dict[sympy.Symbol, int]] = [{}]
    # Only the symbols the range was made of: a compile's own symbols (a view's -1, an
    # unbacked size) have no corners, and a guard over them cannot be decided here.
    # Besides the ends, the sizes next to them and to the middle: a guard with a floor or a
    # modulus (T even: Eq(4*T, 8*((T + 1)//2))) can hold at both ends and fail between them.
    for sym, vr in (made.items() if made else env.var_to_range.items()):
        lo, hi = vr if made else (vr.lower, vr.upper)
        ends = [int(b) for b in (lo, hi) if sympy.sympify(b).is_Integer]
        vals = set(ends)
        if len(ends) == 2:
            mid = (ends[0] + ends[1]) // 2
            vals |= {v for v in (ends[0] + 1, ends[1] - 1, mid, mid + 1) if ends[0] <= v <= ends[1]}
        corners = [{**c, sym: v} for c in corners for v in sorted(vals)] or corners
    bad = [f"{sym} was fixed to {value}" for sym, value in env.replacements.items()
           if sym in made and sympy.sympify(value).is_number]
    for g in env.guards:
        if made and not g.expr.free_symbols <= made.keys():
            continue
        for c in corners:
            try:
                ok = bool(g.expr.xreplace({k: sympy.Integer(v) for k, v in c.items()}))
            except TypeError:
                continue
            if not ok:
                bad.append(f"{g.expr} fails at {c}")
                break
    return bad
