"""Input checks for runnables with no Dynamo guards in front (``Pipeline.run``).

A variant is compiled for one layout of each input: dtype, device, rank, shape and strides.
``InputGuards(program).wrap(binding, runner)`` generates, once per binding, one Python
function that checks exactly those facts with a handful of attribute reads and tuple
compares, then calls the runner::

    def guarded(a0, a1, a2):
        try:
            ok = a1.dtype is _dtype_a1 and a1.is_cpu and a1.shape == (8, 4) and a1.stride() == (4, 1) and ...
        except AttributeError:  # free unless raised: a non-tensor where a tensor belongs
            ok = False
        if ok:
            return _run(a0, a1, a2)
        return _slow(a0, a1, a2)

The slow path (only when something differs) either fixes the call (inputs whose strides
differ are copied into the compiled layout, or re-viewed without a copy when only size-1
dims differ; inputs the graph mutates are copied back afterwards) or raises
``InputMismatch`` naming the argument, what was expected and what came.

``sw.compile`` and the ``"shapewise"`` backend skip all this: Dynamo's guards already check
every input before the runnable is called (a new dtype or layout makes Dynamo trace again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from shapewise import _compat
from shapewise.dispatch.table import key_function
from shapewise.errors import InputMismatch
from shapewise.ir.effects import mutated_inputs
from shapewise.ir.program import Binding, Program, ShapeInfo, SymbolSource, TensorMeta
from shapewise.ir.symbolic import evaluate

__all__ = ["InputGuards", "python_expr"]

GUARDED_BY_DYNAMO = "dynamo"


# -- sympy → Python source ------------------------------------------------------------------

def python_expr(expr: Any, names: Mapping[sympy.Symbol, str]) -> str:
    """Python source computing the integer ``expr`` (torch's FloorDiv, CeilDiv, Mod, Max, Min
    included), with each symbol spelt ``names[symbol]``. Raises ``NotImplementedError`` for
    anything else."""
    if isinstance(expr, int):
        return str(expr)
    e = sympy.sympify(expr)
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return names[e]
    args = [python_expr(a, names) for a in e.args]
    if e.is_Add:
        return "(" + " + ".join(args) + ")"
    if e.is_Mul:
        return "(" + " * ".join(args) + ")"
    if e.is_Pow and e.args[1].is_Integer and int(e.args[1]) >= 0:
        return f"({args[0]} ** {args[1]})"
    if isinstance(e, _compat.FloorDiv):
        return f"({args[0]} // {args[1]})"
    if isinstance(e, _compat.CeilDiv):
        return f"(-(-{args[0]} // {args[1]}))"
    if isinstance(e, (_compat.Mod, _compat.PythonMod, sympy.Mod)):
        return f"({args[0]} % {args[1]})"
    if isinstance(e, (_compat.Max, sympy.Max)):
        return f"max({', '.join(args)})"
    if isinstance(e, (_compat.Min, sympy.Min)):
        return f"min({', '.join(args)})"
    raise NotImplementedError(f"no Python spelling for {type(e).__name__} in {expr}")


# -- the guards -------------------------------------------------------------------------------

class _SlowPath:
    """Diagnose a call the fast check refused: fix what can be fixed (strides), raise
    ``InputMismatch`` for the rest, then run."""

    def __init__(self, guards: InputGuards, binding: Binding | None, run: Callable[..., Any]) -> None:
        self.guards = guards
        self.binding = binding
        self.run = run
        self.values = binding.static_values() if binding is not None else {}

    def expected(self, exprs: Sequence[Any], args: Sequence[Any]) -> tuple[int, ...]:
        values = dict(self.values)
        missing = [s for s in self.guards.shapes.symbols if s not in values]
        if missing:
            key = self.guards.key_fn(args)
            values.update({s: v for s, v in zip(self.guards.shapes.symbols, key) if s in missing})
        return tuple(evaluate(e, values) for e in exprs)

    def __call__(self, *args: Any) -> Any:
        g = self.guards
        if len(args) != len(g.names):
            raise InputMismatch(
                f"expected {len(g.names)} arguments ({', '.join(g.names)}), got {len(args)}"
            )
        fixed = list(args)
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (name, meta) in enumerate(zip(g.names, g.shapes.inputs)):
            a = args[i]
            what = f"argument {i} ({name})"
            if not isinstance(meta, TensorMeta):
                if isinstance(meta, sympy.Basic) and not (isinstance(a, int) and not isinstance(a, bool)):
                    raise InputMismatch(f"{what}: expected an int (a size), got {type(a).__name__} {a!r}")
                continue
            if not isinstance(a, torch.Tensor):
                raise InputMismatch(f"{what}: expected a tensor, got {type(a).__name__}")
            if a.dtype != meta.dtype:
                raise InputMismatch(
                    f"{what}: expected dtype {meta.dtype}, got {a.dtype}; this runnable was compiled for "
                    f"{meta.dtype} (cast with .to({meta.dtype}), or build one from a graph traced with {a.dtype})"
                )
            if a.device != meta.device:
                raise InputMismatch(
                    f"{what}: expected a tensor on {meta.device}, got one on "
                    f"{a.device} (move it with .to({str(meta.device)!r}))"
                )
            if a.dim() != len(meta.shape):
                raise InputMismatch(
                    f"{what}: expected a {len(meta.shape)}-dim tensor, got {a.dim()} dims (shape {tuple(a.shape)})"
                )
            shape = self.expected(meta.shape, args)
            if tuple(a.shape) != shape:
                where = f" for size {self.binding.describe(g.shapes.names)}" if self.binding is not None else ""
                raise InputMismatch(
                    f"{what}: expected shape {shape}{where}, got {tuple(a.shape)}"
                    + (" (the size arguments and the tensors' shapes disagree)" if g.has_int_sources else "")
                )
            stride = self.expected(meta.stride, args)
            if a.stride() == stride:
                continue
            if a.numel() == 0 or all(s == t for s, t, n in zip(a.stride(), stride, shape) if n != 1):
                # Only strides of size-1 (or empty) dims differ: the same memory, viewed as compiled.
                fixed[i] = a.as_strided(shape, stride, a.storage_offset())
                continue
            if any(t == 0 and n > 1 for t, n in zip(stride, shape)):
                # Compiled for a broadcast (stride-0) input: a copy would drop all but one slice.
                raise InputMismatch(
                    f"{what}: compiled for a broadcast input with strides {stride} (0: one slice repeated), "
                    f"got strides {a.stride()}; pass it expanded as it was traced, or trace it as it comes"
                )
            fixed[i] = torch.empty_strided(shape, stride, dtype=a.dtype, device=a.device).copy_(a)
            if i in g.mutated:
                copy_back.append((a, fixed[i]))
        out = self.run(*fixed)
        for orig, new in copy_back:
            orig.copy_(new)
        return out


class InputGuards:
    """Per program: the expected inputs; ``wrap(binding, runner)`` adds the checks."""

    def __init__(self, program: Program) -> None:
        shapes: ShapeInfo = program.shapes
        self.shapes = shapes
        self.names = tuple(shapes.input_names)
        self.enabled = program.inputs_guarded_by != GUARDED_BY_DYNAMO
        self.mutated = mutated_inputs(program.gm) if self.enabled else frozenset()

        self.key_fn = key_function([shapes.sources[s] for s in shapes.symbols])
        self.has_int_sources = any(src.kind == "int" for src in shapes.sources.values())
        self._miss_cache: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}

    def _params(self) -> list[str]:
        return [f"a{i}" for i in range(len(self.names))]

    def _symbol_spelling(self, params: Sequence[str]) -> dict[sympy.Symbol, str]:
        return {s: _source_expr(src, params) for s, src in self.shapes.sources.items()}

    def condition(self, binding: Binding | None) -> str:
        """The fast check for ``binding`` (None: the general binding, every symbol free) as a
        Python expression over parameters ``a0, a1, ...``; "False" when it cannot be spelt."""
        params = self._params()
        values = binding.static_values() if binding is not None else {}
        spell = {**{s: str(v) for s, v in values.items()}, **{s: e for s, e in self._symbol_spelling(params).items()
                                                              if s not in values}}
        conds: list[str] = []
        for p, meta in zip(params, self.shapes.inputs):
            if not isinstance(meta, TensorMeta):
                continue
            try:
                shape = [python_expr(sympy.sympify(e).xreplace(_ints(values)), spell) for e in meta.shape]
                stride = [python_expr(sympy.sympify(e).xreplace(_ints(values)), spell) for e in meta.stride]
            except (NotImplementedError, KeyError):
                return "False"  # unusual size expressions: every call takes the slow path
            conds.append(f"{p}.dtype is _dtype_{p}")
            conds.append(f"{p}.is_cpu" if meta.device.type == "cpu" else f"{p}.device == _device_{p}")
            conds.append(f"{p}.shape == {_tuple(shape)}")
            conds.append(f"{p}.stride() == {_tuple(stride)}")
        return " and ".join(conds) or "True"

    def wrap(self, binding: Binding | None, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` behind the checks for ``binding`` (unchanged when Dynamo guards the inputs)."""
        if not self.enabled:
            return run
        params = self._params()
        env: dict[str, Any] = {"_run": run, "_slow": _SlowPath(self, binding, run)}
        for p, meta in zip(params, self.shapes.inputs):
            if isinstance(meta, TensorMeta):
                env[f"_dtype_{p}"] = meta.dtype
                env[f"_device_{p}"] = meta.device
        sig = ", ".join(params)
        cond = self.condition(binding)
        # try costs nothing unless it raises (a non-tensor where a tensor belongs).
        src = (f"def guarded({sig}):\n"
               f"    try:\n"
               f"        ok = {cond}\n"
               f"    except AttributeError:\n"
               f"        ok = False\n"
               f"    if ok:\n"
               f"        return _run({sig})\n"
               f"    return _slow({sig})\n")
        exec(compile(src, "<shapewise-guards>", "exec"), env)  # noqa: S102 - generated from the graph's metadata
        fn = env["guarded"]
        fn.__source__ = src
        fn.__wrapped__ = run
        return fn

    def wrap_miss(self, miss_runner: Callable[[tuple], Callable[..., Any]] | None):
        """A miss policy whose runners check the inputs against the general binding."""
        if miss_runner is None or not self.enabled:
            return miss_runner

        def resolve(key: tuple) -> Callable[..., Any]:
            run = miss_runner(key)
            cached = self._miss_cache.get(id(run))
            if cached is None or cached[0] is not run:
                cached = (run, self.wrap(None, run))
                self._miss_cache[id(run)] = cached
            return cached[1]

        resolve.__wrapped__ = miss_runner
        return resolve


def _source_expr(src: SymbolSource, params: Sequence[str]) -> str:
    p = params[src.index]
    if src.kind == "int":
        return p
    if src.kind == "size":
        return f"{p}.shape[{src.dim}]"
    return f"{p}.stride({src.dim})"


def _ints(values: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, sympy.Integer]:
    return {s: sympy.Integer(v) for s, v in values.items()}


def _tuple(items: Sequence[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
