"""Fake tensors, ShapeEnvs and symbols: reading a trace's sizes, guards and ranges; making
symbolic inputs for range compiles and checking what a compile assumed."""

from __future__ import annotations

import contextlib
import itertools
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
    "compute_required_storage_length", "data_env_mode", "has_traced_unbacked", "refake", "skip_unbacked_names",
    "evaluate_at", "fake_mode_active", "made_for", "range_guard_failures", "serving_run",
    "fresh_tracing_context", "make_symint", "no_zero_one_specialisation",
    "node_value", "range_guard_violations", "shape_env_of", "storage_length", "sym_expr", "symbol_hints",
    "symbolic_env", "trace_guards", "value_range",
    "copy_graph_module", "scalars_passed_as_tensors", "specialise_scalar_inputs",
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


def data_env_mode() -> FakeTensorMode:
    """A FakeTensorMode with a ShapeEnv of its own, for a static compile of a graph that reads a
    tensor's value (``.item()``: the compile makes an unbacked size, which needs a ShapeEnv)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def refake(args: Sequence[Any], mode: FakeTensorMode) -> list[Any]:
    """Fake tensors in ``mode`` with the shapes, strides, offsets and dtypes of (concrete) ``args``."""
    out: list[Any] = []
    with mode:
        for a in args:
            if isinstance(a, torch.Tensor) and not is_traceable_wrapper_subclass(a):
                length = compute_required_storage_length(a.shape, a.stride(), a.storage_offset())
                t = torch.empty(length, dtype=a.dtype, device=a.device).as_strided(a.shape, a.stride(),
                                                                                  a.storage_offset())
                out.append(t.requires_grad_(a.requires_grad) if a.requires_grad else t)
            else:
                out.append(a)
    return out


def has_traced_unbacked(gm: torch.fx.GraphModule) -> bool:
    """Whether a node of ``gm`` binds an unbacked size of its trace (``.item()``, ``nonzero``)."""
    return any(node.meta.get("unbacked_bindings") for node in gm.graph.nodes)


def skip_unbacked_names(mode: FakeTensorMode | None, gm: torch.fx.GraphModule) -> None:
    """Make ``mode``'s ShapeEnv name its unbacked sizes past the ones ``gm``'s trace made: a compile
    rebinds each traced ``u0`` to the one it makes, and the same name for both is refused
    ("u0 possible memo disaster")."""
    env = getattr(mode, "shape_env", None)
    if env is None or not isinstance(getattr(env, "unbacked_symint_counter", None), int):
        return
    used = -1
    for node in gm.graph.nodes:
        for sym in (node.meta.get("unbacked_bindings") or {}):
            name = str(sym)
            if name.startswith("u") and name[1:].isdigit():
                used = max(used, int(name[1:]))
    env.unbacked_symint_counter = max(env.unbacked_symint_counter, used + 1)


def symbolic_env(symbols: dict[sympy.Symbol, tuple[int, int, int]], assumptions: Sequence[Any] = (),
                 unbacked: Sequence[sympy.Symbol] = ()):
    """A fresh ShapeEnv + FakeTensorMode with one backed symbol per entry of
    ``{old symbol: (low, high, hint)}``, an unbacked one (no hint: what the compile assumes of it is
    checked at run time, not guarded on a made-up value) for those in ``unbacked``; returns (mode,
    {old symbol: new sympy symbol}). ``assumptions``: the trace's guards over the old symbols;
    ``range_guard_violations`` does not count a point where one fails (no call there reaches this
    compile: the trace refuses it)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    new = {}
    for old in unbacked:
        new[old] = env.create_unbacked_symint().node.expr
        lo, hi, _ = symbols[old]
        env.constrain_symbol_range(new[old], compiler_min=lo, compiler_max=hi)
    if unbacked and isinstance(getattr(env, "pending_fresh_unbacked_symbols", None), list):
        env.pending_fresh_unbacked_symbols.clear()  # inputs, not an op's outputs: nothing in the trace binds them
    for old, (lo, hi, hint) in symbols.items():
        if old in new:
            continue
        e = env.create_symbol(hint, ConstantSource(f"shapewise_{old}"), dynamic_dim=DimDynamic.DYNAMIC,
                              do_not_specialize_zero_one=True)
        env.constrain_symbol_range(e, compiler_min=lo, compiler_max=hi)
        new[old] = e
    # The ranges as made: a guard that specialises a symbol narrows var_to_range to the
    # hint, so a later check must compare against these, not the env's current ranges.
    _MADE_RANGES[env] = {new[old]: (lo, hi) for old, (lo, hi, _) in symbols.items() if old not in unbacked}
    subs = {old: e for old, e in new.items()}
    mapped = [sympy.sympify(g).xreplace(subs) for g in assumptions]
    _ASSUMED[env] = [g for g in mapped if g.free_symbols and g.free_symbols <= _MADE_RANGES[env].keys()]
    return mode, new


_MADE_RANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ASSUMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decided(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> bool | None:
    try:
        return bool(expr.xreplace({k: sympy.Integer(v) for k, v in values.items()}))
    except TypeError:
        return None


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
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return mode.shape_env.create_symintnode(expr, hint=None if free_unbacked_symbols(expr) else hint)


_MOST_GUARD_SYMBOLS = 4  # 6**4 points; a guard over more sizes is left to the per-call guards


def range_guard_violations(mode: FakeTensorMode) -> list[str]:
    """Guards a compile added to ``mode``'s ShapeEnv that do not hold at every corner of
    the symbols' ranges (e.g. a compile that specialised a ranged size to its hint)."""
    return [f"{g} fails at {c}" if c else f"{g.lhs} fixed to {g.rhs}" for g, c in range_guard_failures(mode)]


def range_guard_failures(mode: FakeTensorMode) -> list[tuple[sympy.Expr, dict[sympy.Symbol, int]]]:
    """``range_guard_violations`` as (guard, a point where it fails); a symbol the compile fixed
    to a value is ``(Eq(symbol, value), {})``."""
    env = mode.shape_env
    if env is None:
        return []
    made = _MADE_RANGES.get(env)  # ({} where every symbol is unbacked: no corners)
    points: dict[sympy.Symbol, list[int]] = {}
    # Only the symbols the range was made of: a compile's own symbols (a view's -1, an
    # unbacked size) have no corners, and a guard over them cannot be decided here.
    # Besides the ends, the sizes next to them and to the middle: a guard with a floor or a
    # modulus (T even: Eq(4*T, 8*((T + 1)//2))) can hold at both ends and fail between them.
    for sym, vr in (made.items() if made is not None else env.var_to_range.items()):
        lo, hi = vr if made is not None else (vr.lower, vr.upper)
        ends = [int(b) for b in (lo, hi) if sympy.sympify(b).is_Integer]
        vals = set(ends)
        if len(ends) == 2:
            mid = (ends[0] + ends[1]) // 2
            vals |= {v for v in (ends[0] + 1, ends[1] - 1, mid, mid + 1) if ends[0] <= v <= ends[1]}
        if vals:
            points[sym] = sorted(vals)
    bad: list[tuple[sympy.Expr, dict[sympy.Symbol, int]]] = [
        (sympy.Eq(sym, value), {}) for sym, value in env.replacements.items()
        if sym in (made or {}) and sympy.sympify(value).is_number]
    for g in env.guards:
        if made is not None and not g.expr.free_symbols <= made.keys():
            continue
        # Each guard at the points of its own symbols (6**k for k of them), not of all the
        # range's symbols: a cache's dozens of sizes make the full box uncountable.
        syms = sorted((s for s in g.expr.free_symbols if s in points), key=str)
        if len(syms) > _MOST_GUARD_SYMBOLS:
            continue
        # Only points the trace itself can be called at: its guards over these sizes hold
        # (decode's kv and pos ranges are one box, but a call has kv == pos + 1).
        assumed = [a for a in _ASSUMED.get(env, ()) if a.free_symbols <= set(syms)]
        for combo in itertools.product(*(points[s] for s in syms)):
            c = dict(zip(syms, combo))
            if any(_decided(a, c) is False for a in assumed):
                continue
            if _decided(g.expr, c) is False:
                bad.append((g.expr, c))
                break
    return bad


def made_for(mode: FakeTensorMode) -> dict[sympy.Symbol, str]:
    """{a ``symbolic_env`` symbol: the name of the trace's symbol it was made for}."""
    env = mode.shape_env
    out = {}
    for sym in _MADE_RANGES.get(env, {}):
        name = next((src.name for src in env.var_to_sources.get(sym, []) if src.name.startswith("shapewise_")), None)
        if name is not None:
            out[sym] = name.removeprefix("shapewise_")
    return out


_MOST_PART_POINTS = 1 << 14  # a range split into parts is scanned size by size, up to this many


def serving_run(mode: FakeTensorMode, failures: Sequence[tuple[sympy.Expr, Mapping[sympy.Symbol, int]]]
                ) -> tuple[str, int, int] | None:
    """Where a range compile that broke ``failures`` is still right, when all of them are over one
    symbol of the range: (the trace's symbol it was made for, low, high), the sizes around the
    compile's hint at which every guard the compile added over that symbol holds. None when the
    failures span several symbols, or the range is too long to scan."""
    env = mode.shape_env
    made = _MADE_RANGES.get(env, {})
    syms = set().union(*(g.free_symbols for g, _ in failures)) if failures else set()
    if len(syms) != 1 or not syms <= made.keys():
        return None
    (sym,) = syms
    lo, hi = made[sym]
    hint = symbol_hints(env).get(sym)
    if hint is None or hi - lo + 1 > _MOST_PART_POINTS:
        return None
    guards = [g.expr for g in env.guards if g.expr.free_symbols == {sym}]
    guards += [sympy.Eq(sym, v) for s, v in env.replacements.items() if s == sym and sympy.sympify(v).is_number]

    def holds(v: int) -> bool:
        return all(_decided(g, {sym: v}) is not False for g in guards)

    h = int(hint)
    if not holds(h):
        return None
    a = b = h
    while a > lo and holds(a - 1):
        a -= 1
    while b < hi and holds(b + 1):
        b += 1
    name = made_for(mode).get(sym)
    return (name, a, b) if name is not None else None


def scalars_passed_as_tensors(gm: torch.fx.GraphModule) -> list[str]:
    """The Python floats Dynamo passed to ``gm`` as 0-d tensors (``torch.compile(dynamic=True)``
    leaves floats unspecialised: a module's ``Dropout.p`` becomes an input read with ``.item()``),
    by their source names."""
    out = []
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        if arg is not None and getattr(arg, "pass_arg_as_tensor", False):
            name = getattr(arg.source, "name", node.name)  # a method in older torch, a property now
            out.append(name() if callable(name) else str(name))
    return out


def specialise_scalar_inputs(gm: torch.fx.GraphModule) -> list[tuple[int, str, float]]:
    """Read the Python floats Dynamo passed as 0-d tensors (``scalars_passed_as_tensors``) as the
    constants they were at the trace: each ``.item()`` of one becomes its traced value, so the
    graph compiles to static kernels. Returns (input position, source name, value) per float,
    for the caller to check at run time (a float that changed is not what was compiled)."""
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        arg = node.meta.get("grapharg")
        if arg is None or not getattr(arg, "pass_arg_as_tensor", False):
            continue
        example = arg.example
        value = float(example.item()) if isinstance(example, torch.Tensor) else float(example)
        for user in list(node.users):
            reads = (user.op == "call_method" and user.target == "item") or (
                user.op == "call_function" and user.target in (torch.ops.aten._local_scalar_dense.default,
                                                               torch.ops.aten.item.default))
            if reads:
                user.replace_all_uses_with(value)
                gm.graph.erase_node(user)
        name = getattr(arg.source, "name", node.name)
        out.append((i, name() if callable(name) else str(name), value))
    if out:
        _fold_scalar_arithmetic(gm)
        gm.graph.lint()
        gm.recompile()
    return out


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with a graph of its own (nodes and their meta copied; the module's
    parameters and submodules shared), to keep as it is while ``gm`` is rewritten."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def _fold_scalar_arithmetic(gm: torch.fx.GraphModule) -> None:
    """Evaluate the Python arithmetic on constants left by ``specialise_scalar_inputs``
    (``2.0 / math.pi`` once ``math.pi`` is a constant again), in graph order."""
    import math
    import operator

    pure = {getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "floordiv", "pow", "neg", "mod")} | {
        getattr(math, n) for n in ("sqrt", "exp", "log", "pow", "floor", "ceil", "tanh", "sin", "cos")} | {
        f for f in (getattr(torch, n, None) for n in ("_sym_sqrt", "sym_sqrt", "sym_float", "sym_max", "sym_min"))
        if f is not None}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in pure:
            continue
        if any(isinstance(a, torch.fx.Node) for a in (*node.args, *node.kwargs.values())):
            continue
        value = node.target(*node.args, **node.kwargs)
        node.replace_all_uses_with(float(value) if isinstance(value, torch.SymFloat) else value)
        gm.graph.erase_node(node)
