"""The "shapewise" Dynamo backend: a traced graph (sizes 0/1 not specialised, only the named
dims dynamic) is handed to a ``Pipeline([Split, Concretize, Lower, ...])``; the runnable it
returns is what Dynamo calls. ``shapewise.compile`` (``shapewise.module``) drives it."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shapewise import _compat
from shapewise.concretize import Concretize, resolve_symbol_names
from shapewise.dispatch.cudagraphs import CudaGraphs
from shapewise.dispatch.runnable import Runnable
from shapewise.errors import ConfigError
from shapewise.graph_split import Split
from shapewise.ir.program import Program
from shapewise.lower import Lower
from shapewise.passes import Instrument, Pipeline
from shapewise.rewrite import Rewrite

__all__ = ["build_pipeline", "cudagraphs_options", "shapewise_backend"]

DEFAULT_DIM_NAME = "n"

log = logging.getLogger("shapewise")


def _op_list(ops: Any) -> tuple[Any, ...]:
    """``splitting_ops`` as a tuple: one op (a name, an op, a callable) or a list of them."""
    return tuple(ops) if isinstance(ops, (list, tuple)) else (ops,)


def cudagraphs_options(cudagraphs: bool | str | Mapping[str, Any]) -> dict[str, Any]:
    """The ``cudagraphs`` option as ``CudaGraphs`` keywords: True / "piecewise" / "full" /
    "full_and_piecewise", or a dict of them ({"mode": "full_and_piecewise", "full_up_to": 64,
    "capture": "startup", "pad": True}); {} when off."""
    if not cudagraphs:
        return {}
    if isinstance(cudagraphs, Mapping):
        return dict(cudagraphs)
    return {"mode": cudagraphs if isinstance(cudagraphs, str) else "piecewise"}


def build_pipeline(
    *,
    sizes: Any = (),
    ranges: Any = (),
    splitting_ops: Sequence[Any] = (),
    whole_traces: Mapping[str, int] | None = None,
    backend: Any = "inductor",
    options: Mapping[str, Any] | None = None,
    static_options: Mapping[str, Any] | None = None,
    range_options: Mapping[str, Any] | None = None,
    on_compile_error: str = "raise",
    instruments: Sequence[Instrument] = (),
    cudagraphs: bool | str | Mapping[str, Any] = False,
    capture_sizes: Any = None,
    refused: str = "error",
    fixed: Mapping[str, int] | None = None,
    compile: str = "eager_all",
    cache: Any = None,
    dedupe: bool = True,
    progress: bool | None = None,
    lean: bool = True,
    compile_workers: Any = "auto",
    wait_for_workers: bool | str = False,
    graph_passes: Sequence[Any] = (),
    inductor_passes: Sequence[Any] = (),
) -> Pipeline:
    """The standard pipeline for the given options. ``whole_traces`` ({dim name: size}, e.g. {"seq": 1}):
    a trace that fixes each of these dims at that size (``fixed``: a decode trace) is not split,
    ``splitting_ops`` split the others."""
    if whole_traces is not None and not (isinstance(whole_traces, Mapping) and all(
            isinstance(n, str) and isinstance(v, int) and not isinstance(v, bool) for n, v in whole_traces.items())):
        raise ConfigError(f"whole_traces must map dim names to sizes (e.g. {{'seq': 1}}), got {whole_traces!r}")
    whole = bool(whole_traces) and all((fixed or {}).get(n) == v for n, v in whole_traces.items())
    passes: list[Any] = [
        Split(ops=() if whole else _op_list(splitting_ops)),
        Concretize(sizes=sizes, ranges=ranges, refused=refused, fixed=dict(fixed or {})),
        *([Rewrite(passes=tuple(graph_passes), inductor_passes=tuple(inductor_passes))]
          if graph_passes or inductor_passes else []),
        Lower(backend=backend, options=options or (), static_options=static_options or (),
              range_options=range_options or (), on_compile_error=on_compile_error,
              compile=compile, cache=cache, dedupe=dedupe, progress=progress, lean=lean,
              compile_workers=compile_workers,
              # (start-up capture runs every size on the first call: nothing to gain by leaving any pending)
              wait_for_workers=wait_for_workers or cudagraphs_options(cudagraphs).get("capture") == "startup"),
    ]
    if wait_for_workers == "never" and cudagraphs_options(cudagraphs).get("capture") == "startup":
        raise ConfigError("wait_for_workers='never' runs the first calls eagerly while workers compile, but "
                          "cudagraphs capture='startup' captures every size as it compiles: drop one of the two")
    if cudagraphs and compile != "eager_all":
        raise ConfigError(f"cudagraphs captures compiled pieces up front: use compile='eager_all', not {compile!r}")
    if cudagraphs:
        passes.append(CudaGraphs(capture_sizes=capture_sizes, **cudagraphs_options(cudagraphs)))
    elif capture_sizes is not None:
        raise ConfigError("capture_sizes is given but cudagraphs is off: pass cudagraphs=True")
    return Pipeline(passes, instruments=instruments)


_PIPELINE_KEYS = {"sizes", "ranges", "splitting_ops", "whole_traces", "backend", "options", "static_options",
                  "range_options",
                  "on_compile_error", "instruments", "cudagraphs", "capture_sizes", "compile", "cache", "dedupe",
                  "progress", "lean", "compile_workers", "wait_for_workers", "graph_passes",
                  "inductor_passes"}


def shapewise_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> Runnable:
    """Dynamo backend: ``torch.compile(model, backend="shapewise", options={"sizes": [1, 8]})``.

    Options: sizes, ranges, splitting_ops, backend, options, static_options, range_options,
    on_compile_error, on_miss, symbol_names ({symbol name or Symbol: dim name}; a name this trace
    has no symbol of, e.g. a dim it fixed, is left out), refused
    ("skip", the default here: leave out the sizes this trace's guards refuse, with a warning;
    Dynamo traces again when one is called, and a trace with every size fixed, e.g. its first
    one without dynamic=True, compiles as it is; or "error"), fixed ({dim name: size}: dims this
    trace fixed, e.g. seq=1 for decode; it serves the sizes that agree with them).
    """
    opts = {"refused": "skip", **dict(options or {}), **kwargs}
    extra = {"on_miss", "symbol_names", "refused", "fixed"}
    unknown = set(opts) - _PIPELINE_KEYS - extra
    if unknown:
        known = sorted(_PIPELINE_KEYS | extra)
        raise ConfigError(f"unknown shapewise option(s) {sorted(unknown)}; known: {known}")
    names = dict(opts.pop("symbol_names", {}) or {})
    on_miss = opts.pop("on_miss", "error")
    # torch.compile(dynamic=True) leaves floats unspecialised (Dropout.p, an embedding's
    # norm_type): they arrive as 0-d tensors. Static kernels take them as the constants they were
    # at the trace, and each call checks they still are.
    as_traced = _compat.copy_graph_module(gm) if _compat.scalars_passed_as_tensors(gm) else None
    floats = _compat.specialise_scalar_inputs(gm)
    _specialise_layout_symbols(gm)
    # A name of a dim this trace fixed (its first, static trace; a decode trace's seq=1) names no
    # symbol here: left out, where a Program's AnalyzeShapes would refuse it.
    names = resolve_symbol_names(names, _trace_symbols(gm), strict=False)
    program = Program(gm=gm, symbol_names=names, on_miss=on_miss, inputs_guarded_by="dynamo")
    runnable = build_pipeline(**opts).run(program)
    return _FloatsChecked(runnable, floats, as_traced) if floats else runnable


class _FloatsChecked:
    """A runnable whose trace read Python floats as constants (``specialise_scalar_inputs``):
    each call checks them first. A call with a float that changed since the trace (Dynamo does
    not guard unspecialised floats) runs the graph as traced, eagerly, with a warning: right,
    not fast."""

    def __init__(self, runnable: Runnable, floats: Sequence[tuple[int, str, float]],
                 as_traced: torch.fx.GraphModule) -> None:
        self.runnable, self.floats, self.as_traced = runnable, tuple(floats), as_traced
        self._warned: set[str] = set()

    def __call__(self, *args: Any) -> Any:
        for i, name, value in self.floats:
            now = args[i].item()
            if now != value and not (now != now and value != value):  # NaN stays NaN
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("shapewise: %s was %s when this graph was traced and is %s now; the compiled "
                                "kernels have it as a constant, so calls with the new value run the graph eagerly "
                                "(set torch._dynamo.config.specialize_float = True to trace again instead)",
                                name, value, now)
                return self.as_traced(*args)
        return self.runnable(*args)

    def __getattr__(self, name: str) -> Any:  # report(), program, table: the runnable's
        return getattr(self.runnable, name)


def _trace_symbols(gm: torch.fx.GraphModule) -> tuple[Any, ...]:
    """The symbols of the trace's inputs (sizes, SymInts, strides, offsets)."""
    symbols: dict[Any, None] = {}
    for n in gm.graph.nodes:
        v = _compat.node_value(n) if n.op == "placeholder" else None
        exprs = [*v.shape, *v.stride(), v.storage_offset()] if isinstance(v, torch.Tensor) else \
            [v] if isinstance(v, torch.SymInt) else []
        for e in exprs:
            symbols.update(dict.fromkeys(sorted(_compat.sym_expr(e).free_symbols, key=str)))
    return tuple(symbols)


def _specialise_layout_symbols(gm: torch.fx.GraphModule) -> list[str]:
    """Fix every symbol that is only a stride or offset (Dynamo makes the strides of a
    non-contiguous tensor with a dynamic dim symbols of their own) to its traced value.

    Such a symbol is a layout, not a size: the variants are compiled for the traced layout, and
    Dynamo would otherwise accept any other (a contiguous call after a strided one then fails to
    dispatch). Fixing it adds a guard to the trace, so another layout makes Dynamo trace again.
    """
    values = [_compat.node_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    in_shapes = {s for v in values if isinstance(v, torch.Tensor) for d in v.shape
                 for s in _compat.sym_expr(d).free_symbols}
    in_layouts = {s for v in values if isinstance(v, torch.Tensor)
                  for e in (*v.stride(), v.storage_offset()) for s in _compat.sym_expr(e).free_symbols}
    fixed = []
    for v in values:
        if isinstance(v, torch.SymInt) and _compat.sym_expr(v).free_symbols <= in_layouts - in_shapes:
            fixed.append(f"{_compat.sym_expr(v)}={int(v)}")  # int() guards the value in the trace
    return fixed
